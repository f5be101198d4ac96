"""A checkpoint-N is a model, as the Trainer's: from_pretrained, --model_name_or_path, export and evaluation read it;
the best one is the final model with --load_best_model_at_end; an earlier release's still resumes; a branch from an
earlier checkpoint sets the later ones aside, and a rerun resumes the checkpoint its run saved last."""

import json
import os
import re
import shutil
import signal
import sys
import time
import types
from pathlib import Path

import pytest
from conftest import (
    FLAX_TRAINING_SCRIPTS,
    ROOT,
    TWO_DEVICES,
    check_ok,
    finish,
    flax_args,
    load_script,
    refusal,
    run,
    script_env,
    start,
)

CLM = "flax/run_clm_flax.py"
TRAIN = ["--do_train", "--per_device_train_batch_size", "8", "--learning_rate", "1e-3", "--warmup_steps", "2"]
TRAIN += ["--logging_steps", "2", "--save_steps", "2", "--report_to", "none", "--seed", "3"]


@pytest.mark.parametrize("path", list(FLAX_TRAINING_SCRIPTS))
def test_every_checkpoint_is_a_model(path, request, corpus, tmp_path):
    """An intermediate checkpoint of a run on two devices with --fsdp loads with from_pretrained (model and
    tokenizer): the model of its step, the train state's params["model"] bit for bit, read back whole by
    read_checkpoint outside the run, on this process's one device."""
    import jax
    import numpy as np
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    check_ok(
        run(flax_args(path, request, corpus, out, *TRAIN, "--max_steps", "4", "--fsdp", "full_shard"), TWO_DEVICES)
    )
    script = load_script(path, "model_" + Path(path).stem)
    checkpoint = out / "checkpoint-2"
    model = script.MODEL_CLASS.from_pretrained(checkpoint)
    assert 0 < len(AutoTokenizer.from_pretrained(checkpoint)) <= model.config.vocab_size
    arrays, trainer_state = script.read_checkpoint(str(checkpoint))
    assert trainer_state["global_step"] == 2 and trainer_state["format"] == script.CHECKPOINT_FORMAT
    assert all(leaf.sharding.num_devices == 1 for leaf in jax.tree_util.tree_leaves(arrays))  # read whole
    saved, stepped = (jax.tree_util.tree_leaves_with_path(p) for p in (model.params, arrays["params"]["model"]))
    assert [k for k, _ in saved] == [k for k, _ in stepped]
    assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for (_, a), (_, b) in zip(saved, stepped))
    final = script.MODEL_CLASS.from_pretrained(out)  # the last step's model differs from step 2's
    assert not all(np.array_equal(a, b) for a, b in zip(*map(jax.tree_util.tree_leaves, (final.params, model.params))))


@pytest.fixture(scope="module")
def best_run(request, corpus, tmp_path_factory):
    """CLM, 6 steps saved and evaluated every 2, the best by the largest eval_loss (the first: the loss falls), at
    most one checkpoint kept besides it."""
    out = tmp_path_factory.mktemp("best") / "run"
    extra = ["--do_eval", "--max_steps", "6", "--eval_steps", "2", "--load_best_model_at_end", "--greater_is_better"]
    result = check_ok(run(flax_args(CLM, request, corpus, out, *TRAIN, *extra, "true", "--save_total_limit", "1")))
    return out, result.stdout + result.stderr


def test_the_best_checkpoint_is_the_final_model_and_survives_the_limit(best_run):
    out, log = best_run
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-6"]
    assert f"The best checkpoint: {out / 'checkpoint-2'} (eval_loss " in log
    assert (out / "flax_model.msgpack").read_bytes() == (out / "checkpoint-2" / "flax_model.msgpack").read_bytes()
    last = json.loads((out / "checkpoint-6" / "trainer_state" / "metadata").read_text())
    assert last["best_model_checkpoint"] == str(out / "checkpoint-2")
    # Evaluated at steps 2, 4 and 6, then the best model again, under its own step.
    evaluations = re.findall(r"Step (\d): eval accuracy [0-9.]+, eval loss ([0-9.]+)", log)
    assert [step for step, _ in evaluations] == ["2", "4", "6", "2"] and evaluations[0] == evaluations[3]
    assert evaluations[0][1] == max(loss for _, loss in evaluations)
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_loss"] == pytest.approx(last["best_metric"], rel=1e-6)


def test_a_checkpoint_evaluates_alone_starts_a_new_run_and_exports(best_run, request, corpus, tmp_path):
    """--do_eval alone on a checkpoint gives its step's evaluation; --model_name_or_path starts a new run from it
    (said in one line); the learning-curve tool evaluates every checkpoint; compare tells two checkpoints apart;
    flax/export_to_pytorch.py exports one."""
    out, _ = best_run
    best = json.loads((out / "checkpoint-6" / "trainer_state" / "metadata").read_text())["best_metric"]
    evaluated = tmp_path / "eval"
    args = flax_args(
        CLM, request, corpus, evaluated, "--do_eval", "--resume_from_checkpoint", str(out / "checkpoint-2")
    )
    check_ok(run(args))
    assert json.loads((evaluated / "eval_results.json").read_text())["eval_loss"] == pytest.approx(best, rel=1e-6)

    new = run(
        flax_args(
            CLM,
            request,
            corpus,
            tmp_path / "new",
            *TRAIN,
            "--max_steps",
            "2",
            "--model_name_or_path",
            str(out / "checkpoint-2"),
        )
    )
    check_ok(new)
    assert "a new run from the model of that checkpoint, with a fresh optimizer" in new.stderr

    flags = ["--validation_file", str(corpus / "validation_slice.txt"), "--block_size", "32"]
    check_ok(run(["flax/checkpoint_tools.py", "curve", CLM, str(out), "--", *flags]))
    points = json.loads((out / "learning_curve.json").read_text())
    assert [p["step"] for p in points] == [2, 6] and points[0]["eval_loss"] == pytest.approx(best, rel=1e-6)
    assert (out / "learning_curve.png").stat().st_size > 0
    same = check_ok(run(["flax/checkpoint_tools.py", "compare", str(out / "checkpoint-2"), str(out / "checkpoint-2")]))
    assert "identical: " in same.stdout
    refused = run(["flax/checkpoint_tools.py", "compare", str(out / "checkpoint-2"), str(tmp_path)])
    assert refused.returncode == 1 and f"{tmp_path} is not a checkpoint-N folder" in refused.stderr
    differ = run(["flax/checkpoint_tools.py", "compare", str(out / "checkpoint-2"), str(out / "checkpoint-6")])
    assert differ.returncode == 1 and "['step']: 1 of 1 values differ" in differ.stdout

    exported = run(
        ["flax/export_to_pytorch.py", "--model_dir", str(out / "checkpoint-2"), "--output_dir", str(tmp_path / "pt")]
    )
    check_ok(exported)
    assert (tmp_path / "pt" / "model.safetensors").is_file()


def earlier_release(checkpoint):
    """Rewrites a checkpoint as the release before the digest wrote it (format 1): the same Orbax items, its
    trainer_state without digest, format or best model, and no model beside them."""
    metadata = checkpoint / "trainer_state" / "metadata"
    trainer_state = json.loads(metadata.read_text())
    for name in trainer_state.pop("digest")["model"]:
        os.remove(checkpoint / name)
    for key in ("format", "best_metric", "best_model_checkpoint"):
        del trainer_state[key]
    metadata.write_text(json.dumps(trainer_state))


def test_an_earlier_release_checkpoint_resumes_with_one_warning(request, corpus, tmp_path):
    """The previous release's checkpoint-4 (no digest, no model) resumes, said once; it evaluates too; as a model it
    is refused in one line that points to what it can do; no line advises --overwrite_output_dir."""
    out = tmp_path / "run"
    args = flax_args(CLM, request, corpus, out, *TRAIN, "--max_steps", "4")
    check_ok(run(args))
    earlier_release(out / "checkpoint-4")
    earlier_release(out / "checkpoint-2")
    resumed = check_ok(run([*args[:-1], "6", "--resume_from_checkpoint"]))
    log = resumed.stdout + resumed.stderr
    assert log.count("was written by an earlier release, without a digest: it is read unverified") == 1
    assert f"Resuming at step 4 from {out / 'checkpoint-4'}" in log and "--overwrite_output_dir" not in log
    assert (out / "checkpoint-6" / "flax_model.msgpack").is_file()
    line = refusal(
        flax_args(CLM, request, corpus, tmp_path / "x", "--do_eval", "--model_name_or_path", str(out / "checkpoint-2"))
    )
    assert "a training checkpoint of an earlier release, which held no model: evaluate it with --do_eval" in line


def test_a_branch_sets_later_checkpoints_aside_and_a_rerun_resumes_its_own(request, corpus, tmp_path):
    """Resumed from checkpoint-2 of a run that went on to checkpoint-40, a branch moves 4..40 aside (kept whole); after
    its SIGTERM a rerun resumes the branch's own checkpoint, the one saved last, even beside a higher number."""
    out = tmp_path / "run"
    args = flax_args(CLM, request, corpus, out, *TRAIN)
    check_ok(run([*args, "--max_steps", "40"]))
    branch = [*args, "--max_steps", "400", "--resume_from_checkpoint"]
    proc = start([*branch, str(out / "checkpoint-2")], tmp_path / "branch.log", script_env())
    deadline = time.time() + 300
    while not ((out / "checkpoint-4" / "trainer_state").is_dir() and list(out.glob("set-aside-*"))):
        assert proc.poll() is None and time.time() < deadline, Path(proc.log).read_text()[-3000:]
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    [log] = finish([proc])
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    [aside] = out.glob("set-aside-*")
    assert sorted(int(p.name.split("-")[1]) for p in aside.iterdir()) == list(range(4, 41, 2))
    assert "resuming at step 2, before checkpoint-4, " in log and f"moved, whole, to {aside}" in log
    stopped = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert stopped < 40 and f"checkpoint-{stopped} saved; rerun with --resume_from_checkpoint" in log
    shutil.copytree(aside / "checkpoint-40", out / "checkpoint-40")  # as an earlier release left a branch's folder
    rerun = start(branch, tmp_path / "rerun.log", script_env())
    while "Resuming at step" not in Path(rerun.log).read_text():
        assert rerun.poll() is None and time.time() < deadline, Path(rerun.log).read_text()[-3000:]
        time.sleep(0.05)
    rerun.send_signal(signal.SIGTERM)
    [log] = finish([rerun])
    assert f"Resuming at step {stopped} from {out / f'checkpoint-{stopped}'}" in log, log[-3000:]
    assert "before checkpoint-40 of the run it left" in log


def test_the_probes_one_liners(request, corpus, tmp_path):
    """--max_steps 0 or -3 refused (-1 is unset); --load_best_model_at_end without --eval_steps refused; a failed
    removal beyond --save_total_limit warns and the run goes on; the output folder removed while training is one
    line."""
    for steps in ("0", "-3"):
        line = refusal(flax_args(CLM, request, corpus, tmp_path / "x", *TRAIN, "--max_steps", steps))
        assert f"--max_steps {steps}: positive, or -1 (unset: epochs)" in line
    line = refusal(flax_args(CLM, request, corpus, tmp_path / "x", *TRAIN, "--do_eval", "--load_best_model_at_end"))
    assert "--load_best_model_at_end needs --eval_steps, and --save_steps a round multiple of it" in line

    script = load_script(CLM, "probe_run_clm_flax")
    warnings = []
    deleting = types.SimpleNamespace(
        all_steps=lambda: [2, 4, 6],
        delete=lambda step: (_ for _ in ()).throw(PermissionError(13, "Read-only file system")),
    )
    fake = types.SimpleNamespace(args=types.SimpleNamespace(save_total_limit=1, output_dir="o"), checkpoints=deleting)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(script.logger, "warning", warnings.append)
        script.drop_old_checkpoints(
            fake, script.TrainingProgress(best_model_checkpoint="o/checkpoint-2"), "o/checkpoint-6"
        )
    assert warnings == [
        "o/checkpoint-6 is saved; removing o/checkpoint-4, beyond --save_total_limit 1, failed: "
        "[Errno 13] Read-only file system"
    ]

    # Removed once checkpoint-40 is whole (the step after it logged: its model files are copied in after Orbax's
    # save, which a removal at Orbax's finalisation raced), 40 steps before the next save.
    out = tmp_path / "vanishing"
    args = flax_args(CLM, request, corpus, out, *TRAIN, "--max_steps", "4000", "--save_steps", "40")
    proc = start(args, tmp_path / "v.log", script_env())
    deadline = time.time() + 300
    while "Step 42/4000" not in Path(proc.log).read_text():
        assert proc.poll() is None and time.time() < deadline, Path(proc.log).read_text()[-3000:]
        time.sleep(0.02)
    shutil.rmtree(out, ignore_errors=True)
    [log] = finish([proc])
    assert proc.returncode == 1 and "Traceback" not in log, log[-3000:]
    assert "run_clm_flax.py: error: cannot write " in log and "no checkpoint of this run is left complete" in log, log


def test_the_install_line_for_a_package_too_old_names_this_stacks_pins():
    """requirements.txt's on Python 3.11, requirements-current.txt's on 3.12 and later."""
    script = load_script(CLM, "stack_run_clm_flax")
    pins = Path(ROOT, "requirements-current.txt" if sys.version_info >= (3, 12) else "requirements.txt").read_text()
    with pytest.raises(SystemExit) as too_old:
        script.check_stack("x.py", {"flax": "99.0"})
    advised = str(too_old.value).split("pip install ")[1].split()
    assert advised and all(f"\n{pin}\n" in f"\n{pins}\n" for pin in advised), (advised, pins)


def test_a_checkpoint_stopped_before_its_model_was_whole_resumes_and_is_made_whole(request, corpus, tmp_path):
    """A kill between Orbax's save of the train state and the model's last file leaves files missing: the resume
    writes them again from the verified state, the same bytes the digest names, and goes on."""
    out = tmp_path / "run"
    args = flax_args(CLM, request, corpus, out, *TRAIN)
    check_ok(run([*args, "--max_steps", "2"]))
    checkpoint = out / "checkpoint-2"
    for name in ("flax_model.msgpack", "config.json"):
        (checkpoint / name).unlink()
    resumed = check_ok(run([*args, "--max_steps", "4", "--resume_from_checkpoint"]))
    assert "the run stopped before its model was whole" in resumed.stderr and "Resuming at step 2" in resumed.stderr
    script = load_script(CLM, "whole_run_clm_flax")
    script.read_checkpoint(str(checkpoint))  # the digest of every file matches again
    assert script.MODEL_CLASS.from_pretrained(checkpoint).config.n_layer == 2
