#!/usr/bin/env python
"""What a checkpoint's digest and its model cost a save: a Flax script's train state (roberta-base by default:
RoBERTa's published sizes, new weights and Adam's two moments) saved as save_checkpoint does (stage_model,
write_checkpoint, export_model; the tokenizer, a few MB, left out), with the model in the checkpoint and, as the
release before checkpoints were models saved, without it (the model exported to output_dir only), and its state_digest
alone, each timed over --repeats saves into a temporary folder on the disk of --work_dir, with each checkpoint's size
on disk (new Adam moments are zeros, which Orbax's files compress: a trained state's are larger):

  python benchmarks/checkpoint_digest.py --repeats 3 --work_dir out/digest
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("USE_TF", "0")
os.environ.setdefault("USE_TORCH", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import load_script  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="flax/run_mlm_flax.py")
    parser.add_argument("--config_overrides", default="", help="create_config.py's, e.g. hidden_size=128 (tiny runs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work_dir", default=None, help="a folder on the disk to time (default: the temporary one)")
    args = parser.parse_args(argv)
    import jax

    script, create_config = load_script(args.script), load_script("tokenizers/create_config.py")
    config = create_config.build_config("roberta", vocab_size=50265, config_overrides=args.config_overrides)
    model_args = script.ModelArguments(model_type="roberta")
    training_args = script.TrainingArguments(output_dir="unused", do_train=True)
    plan = script.TrainingPlan(script.make_mesh(""), 1, 1, 0, 8, 8, total_steps=10)
    model, state, _ = script.build_train_state(model_args, training_args, config, plan)
    arrays = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
    size = sum(x.nbytes for x in jax.tree_util.tree_leaves(arrays))
    script.state_digest(arrays)  # compiled once, as a run compiles it at its first save
    work = Path(tempfile.mkdtemp(dir=args.work_dir))
    tokenizer = types.SimpleNamespace(save_pretrained=lambda folder: None)
    times, disk = {"digest": [], "save_without_model": [], "save_with_model": []}, {}
    try:
        for repeat in range(args.repeats):
            start = time.perf_counter()
            script.state_digest(arrays)
            times["digest"].append(time.perf_counter() - start)
            for kind in ("save_without_model", "save_with_model"):
                out = work / f"{kind}-{repeat}"
                out.mkdir()
                training_args.output_dir = str(out)
                checkpoints = script.checkpoint_manager(out, writes=True)
                run = types.SimpleNamespace(args=training_args, objective={}, data={}, plan=plan)
                run.__dict__.update(checkpoints=checkpoints, model=model, tokenizer=tokenizer)
                start = time.perf_counter()
                staged = script.stage_model(state.params["model"], run)
                in_checkpoint = staged if kind == "save_with_model" else None
                script.write_checkpoint(state, script.TrainingProgress(global_step=1), run, in_checkpoint)
                script.export_model(staged, run)
                times[kind].append(time.perf_counter() - start)
                run.checkpoints.close()
                disk[kind] = sum(f.stat().st_size for f in (out / "checkpoint-1").rglob("*") if f.is_file())
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work)
    median = {kind: statistics.median(values) for kind, values in times.items()}
    result = dict(state_mb=round(size / 2**20, 1), **{f"{k}_s": round(v, 3) for k, v in median.items()})
    result.update({f"checkpoint_{k}_mb": round(v / 2**20, 1) for k, v in disk.items()})
    result.update(digest_share_of_save=round(median["digest"] / median["save_with_model"], 3), times_s=times)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
