#!/usr/bin/env python
"""Look at a Flax training script's checkpoints outside its run, on this machine's devices (a laptop's one CPU does):

  compare A B      bitwise, every array of two checkpoints' train states (step, params, opt_state), on one device:
                   how a copy checks its own exact resume. Exit 0 when identical, 1 when not.
  curve SCRIPT RUN -- FLAGS
                   a learning curve: every checkpoint-N of the run's folder RUN evaluated by SCRIPT (--do_eval
                   --resume_from_checkpoint, the checkpoint's own config and tokenizer), with FLAGS (the validation
                   data and length flags); RUN/learning_curve.json and RUN/learning_curve.png, each evaluation's
                   files in RUN/learning_curve/checkpoint-N.

  python flax/checkpoint_tools.py compare out/a/checkpoint-8 out/b/checkpoint-8
  python flax/checkpoint_tools.py curve flax/run_clm_flax.py out/gpt2/run -- \\
      --validation_file data/ptb/validation.txt --block_size 64

Both read checkpoints with the script's own read_checkpoint (digest checked; `--script` for compare: any of the four,
or a copy), which a notebook can call as well: `arrays, trainer_state = script.read_checkpoint(path)`.
"""

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def load_script(path):
    """A Flax training script imported by its path, under a name of its own (flax/ shares its name with the
    package)."""
    if not os.path.isfile(path):
        fail(f"{path} does not exist: name a Flax training script, such as flax/run_mlm_flax.py")
    spec = importlib.util.spec_from_file_location("checkpoints_" + os.path.basename(path)[:-3], path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if not hasattr(script, "read_checkpoint"):
        fail(f"{path} is not a Flax training script of this project: it has no read_checkpoint")
    return script


def read(script, path):
    try:
        return script.read_checkpoint(path)
    except ValueError as e:
        fail(f"{path} is damaged: {e}")


def compare(script, first, second):
    """The arrays that differ between two checkpoints, with their largest difference; prints a line each."""
    import jax
    import numpy as np

    (a, state_a), (b, state_b) = read(script, first), read(script, second)
    leaves_a, leaves_b = (dict(jax.tree_util.tree_flatten_with_path(x)[0]) for x in (a, b))
    differ = []
    for key in sorted(set(leaves_a) | set(leaves_b), key=jax.tree_util.keystr):
        name = jax.tree_util.keystr(key)
        if key not in leaves_a or key not in leaves_b:
            differ.append(f"{name}: only in {first if key in leaves_a else second}")
            continue
        x, y = np.asarray(leaves_a[key]), np.asarray(leaves_b[key])
        if x.shape != y.shape or x.dtype != y.dtype:
            differ.append(f"{name}: {x.dtype}{list(x.shape)} against {y.dtype}{list(y.shape)}")
        elif x.tobytes() != y.tobytes():
            largest = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))
            differ.append(f"{name}: {np.sum(x != y):,} of {x.size:,} values differ, by up to {largest:.3g}")
    steps = f"steps {state_a['global_step']} and {state_b['global_step']}"
    print("\n".join(differ) if differ else f"identical: {len(leaves_a)} arrays, bit for bit ({steps})")
    return differ


def curve(script_path, run_dir, flags):
    """Every checkpoint of run_dir evaluated in this process by the script's main(); the curve's points."""
    checkpoints = sorted(Path(run_dir).glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    checkpoints = [path for path in checkpoints if re.fullmatch(r"checkpoint-\d+", path.name)]
    if not checkpoints:
        fail(f"{run_dir} holds no checkpoint-N folder: name a training run's --output_dir")
    script, points = load_script(script_path), []
    for checkpoint in checkpoints:
        model = checkpoint if (checkpoint / "config.json").is_file() else Path(run_dir)  # an earlier release's: none
        named = [f"--{name}" for name in ("config_name", "tokenizer_name") if f"--{name}" not in flags]
        out = Path(run_dir) / "learning_curve" / checkpoint.name
        script.main(
            [*flags, *[arg for name in named for arg in (name, str(model))], "--output_dir", str(out)]
            + [
                "--overwrite_output_dir",
                "--do_eval",
                "--resume_from_checkpoint",
                str(checkpoint),
                "--report_to",
                "none",
            ]
        )
        step = int(checkpoint.name.split("-")[1])
        points.append(
            {"step": step, "checkpoint": str(checkpoint), **json.loads((out / "eval_results.json").read_text())}
        )
    Path(run_dir, "learning_curve.json").write_text(json.dumps(points, indent=2))
    plot(points, Path(run_dir) / "learning_curve.png")
    print(f"{len(points)} checkpoints evaluated: {run_dir}/learning_curve.json and learning_curve.png")
    return points


def plot(points, path):
    """One panel a metric (the means: loss, perplexity, accuracy, ...), against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skip = ("eval_samples", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    names = [k for k in points[0] if k.startswith("eval_") and k not in skip and not k.endswith("_tokens")]
    figure, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for axis, name in zip(axes[0], names):
        axis.plot([p["step"] for p in points], [p[name] for p in points], marker="o")
        axis.set(xlabel="step", title=name)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = fail
    commands = parser.add_subparsers(dest="command", required=True)
    compared = commands.add_parser("compare", help="two checkpoints' arrays, bit for bit")
    compared.add_argument("first")
    compared.add_argument("second")
    compared.add_argument("--script", default=os.path.join(os.path.dirname(__file__), "run_mlm_flax.py"))
    curved = commands.add_parser("curve", help="every checkpoint of a run evaluated: a learning curve")
    curved.add_argument("script")
    curved.add_argument("run_dir")
    for sub in (compared, curved):
        sub.error = fail
    args = parser.parse_args(argv[:cut])
    if args.command == "compare":
        for path in (args.first, args.second):
            if not (Path(path) / "trainer_state").is_dir():
                fail(f"{path} is not a checkpoint-N folder written by a Flax training script")
        sys.exit(1 if compare(load_script(args.script), args.first, args.second) else 0)
    curve(args.script, args.run_dir, argv[cut + 1 :])


if __name__ == "__main__":
    main()
