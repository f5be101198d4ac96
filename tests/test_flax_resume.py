"""Exact resume in the Flax scripts: kill -9 then --resume_from_checkpoint is bitwise an uninterrupted run; the
refusals of a resume that cannot be exact. Its own file, so that the suite's workers (one file each) balance."""

import functools
import json
import shutil
import signal

import pytest
from conftest import (
    TWO_DEVICES,
    check_ok,
    fake_devices,
    flax_args,
    kill_after_first_checkpoint,
    load_script,
    losses_by_step,
    refusal,
    run,
)

MLM = "flax/run_mlm_flax.py"
T5 = "flax/run_t5_mlm_flax.py"
RESUMABLE = [
    "--do_train",
    "--per_device_train_batch_size",
    "8",
    "--max_steps",
    "24",
    "--logging_steps",
    "2",
    "--save_steps",
    "4",
    "--learning_rate",
    "1e-3",
    "--warmup_steps",
    "4",
    "--seed",
    "7",
    "--report_to",
    "none",
]


# Run with a Flax script's arguments: the train state's arrays as build_train_state shards them (name: size, bytes,
# bytes of one shard, number of shards) as one JSON line, then the run itself.
SHARDING_REPORT = """
import json, sys
import jax
sys.path.insert(0, "tests")
from conftest import load_script

script = load_script(sys.argv[1], "sharded")
model_args, _, training_args = script.parse_args(sys.argv[2:])
plan = script.plan_training(training_args, {"train": range(64)}, 32)
config = script.load_config_and_tokenizer(model_args)[0]
_, state, _ = script.build_train_state(model_args, training_args, config, plan)
leaves = jax.tree_util.tree_leaves_with_path({"params": state.params, "opt_state": state.opt_state})
shards = lambda x: [x.addressable_shards[0].data.nbytes, len({str(s.index) for s in x.addressable_shards})]
print(json.dumps({jax.tree_util.keystr(k): [x.size, x.nbytes, *shards(x)] for k, x in leaves}))
script.main(sys.argv[2:])
"""


@pytest.fixture(scope="module")
def uninterrupted(request, corpus, tmp_path_factory):
    """For MLM or T5: a 24-step run that saves every 4 steps, its output folder and its logged losses; each run on
    first use (bash run.sh test-current runs only the MLM one's test)."""

    @functools.cache
    def full_run(path):
        out = tmp_path_factory.mktemp("full")
        result = check_ok(run(flax_args(path, request, corpus, out, *RESUMABLE)))
        return out, losses_by_step(result.stdout + result.stderr)

    return full_run


@pytest.mark.parametrize("path,signum", [(MLM, signal.SIGTERM), (T5, signal.SIGKILL)])
def test_stop_then_resume_is_bitwise_exact(path, signum, uninterrupted, request, corpus, tmp_path):
    """kill -9 at any point after the first checkpoint, or SIGTERM (which saves the step it stops after), then the
    same command with --resume_from_checkpoint: the final weights are bitwise those of an uninterrupted run, and
    every logged loss, the train loss and the FLOPs of all_results.json are the same. What a kill cut short (Orbax's
    temporary folder, the model's) is cleaned up."""
    full_dir, full_losses = uninterrupted(path)
    out = tmp_path / "run"
    args = flax_args(path, request, corpus, out, *RESUMABLE)
    stopped = kill_after_first_checkpoint(args, out, signum=signum)
    before = losses_by_step(stopped)
    complete = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "trainer_state").is_dir())
    if signum == signal.SIGTERM:
        assert f"stopped at step {complete[-1]} on SIGTERM; {out / f'checkpoint-{complete[-1]}'} saved" in stopped
    # What a kill in the middle of writing the next checkpoint leaves: partial temporary folders.
    partial = out / f"checkpoint-{complete[-1] + 4}.orbax-checkpoint-tmp-1"
    shutil.copytree(out / f"checkpoint-{complete[-1]}", partial)
    shutil.rmtree(partial / "state")
    (out / ".tmp-save-killed").mkdir()

    resumed = check_ok(run(args + ["--resume_from_checkpoint"]))
    log = resumed.stdout + resumed.stderr
    assert f"skipping {partial}" in log and f"Resuming at step {complete[-1]}" in log
    assert complete[-1] < 24, "the kill came too late to test a resume"
    after = losses_by_step(log)
    assert before and after and min(map(int, after)) > complete[-1]
    for step, loss in {**before, **after}.items():
        assert loss == full_losses[step], (step, loss, full_losses[step])
    assert (out / "flax_model.msgpack").read_bytes() == (full_dir / "flax_model.msgpack").read_bytes()
    assert not list(out.glob("*orbax-checkpoint-tmp*")) and not list(out.glob(".tmp-save-*"))
    ours, full = (json.loads((folder / "all_results.json").read_text()) for folder in (out, full_dir))
    assert [ours[k] for k in ("train_loss", "total_flos")] == [full[k] for k in ("train_loss", "total_flos")], ours


def test_resume_refusals_and_a_resume_on_more_devices(uninterrupted, request, corpus, tmp_path):
    full_dir, _ = uninterrupted(MLM)

    def bad(*extra, output_dir=full_dir):
        return refusal(flax_args(MLM, request, corpus, output_dir, *RESUMABLE, *extra))

    assert "--resume_from_checkpoint to continue it" in bad()
    assert "holds no complete checkpoint" in bad("--resume_from_checkpoint", output_dir=tmp_path / "empty")
    assert "not a complete checkpoint" in bad("--resume_from_checkpoint", str(tmp_path / "nowhere"))
    line = bad("--resume_from_checkpoint", str(full_dir))  # the run's folder, not one of its checkpoints
    assert f"is a run's folder: name one of its checkpoints ({full_dir / 'checkpoint-24'})" in line, line
    line = bad("--resume_from_checkpoint", "--per_device_train_batch_size", "4")
    assert "written for other data (train_batch_size 8 -> 4)" in line and "--ignore_data_skip" in line
    small = tmp_path / "small_config"
    check_ok(
        run(
            [
                "tokenizers/create_config.py",
                "--model_type",
                "roberta",
                "--tokenizer_name",
                str(full_dir),
                "--output_dir",
                str(small),
                "--config_overrides",
                "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64",
            ]
        )
    )
    assert "another shape" in bad("--resume_from_checkpoint", "--config_name", str(small))
    # The same global batch over two devices (4 rows each) resumes, and says what differs.
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copytree(full_dir / "checkpoint-20", moved / "checkpoint-20")
    extra = ("--resume_from_checkpoint", "--per_device_train_batch_size", "4", "--mlm_probability", "0.2")
    extra += ("--max_train_samples", "1000", "--ignore_data_skip")  # other data: its epoch starts afresh
    result = check_ok(
        run(flax_args(MLM, request, corpus, moved, *RESUMABLE, *extra, "--warmup_steps", "2"), env=TWO_DEVICES)
    )
    assert "other objective settings; going on with this run's: --mlm_probability 0.15 -> 0.2" in result.stderr
    assert (
        "another learning-rate schedule (steps, warm-up steps, peak: [24, 4, 0.001] -> [24, 2, 0.001])"
        in result.stderr
    )
    assert "--ignore_data_skip: " in result.stderr and "train_rows" in result.stderr
    assert sorted(map(int, losses_by_step(result.stdout + result.stderr))) == [22, 24]


def test_a_resume_never_lies(uninterrupted, request, corpus, tmp_path):
    """Nothing left to train, other data, a damaged checkpoint: one line each (no traceback), every results file as
    it was. Without a path, a damaged newest checkpoint is skipped for the one before it, and the run still ends
    bitwise where the uninterrupted one did."""
    full_dir, _ = uninterrupted(MLM)

    def bad(*extra, output_dir=full_dir):
        return refusal(flax_args(MLM, request, corpus, output_dir, *RESUMABLE, *extra))

    results = {name: (full_dir / name).read_bytes() for name in ("train_results.json", "all_results.json")}
    assert "at step 24 and this run ends at step 24: nothing left to train" in bad("--resume_from_checkpoint")
    assert "this run ends at step 16: nothing left" in bad("--resume_from_checkpoint", "--max_steps", "16")
    assert all((full_dir / name).read_bytes() == content for name, content in results.items())
    damaged = tmp_path / "damaged"
    for step in (16, 20):
        shutil.copytree(full_dir / f"checkpoint-{step}", damaged / f"checkpoint-{step}")
    line = bad("--resume_from_checkpoint", "--max_seq_length", "24", output_dir=damaged)
    assert "written for other data (" in line and "max_seq_length 32 -> 24" in line
    # The lowest bit of 16 bytes in the middle of the largest file, its size kept: finite values, found only by the
    # digest the checkpoint was written with.
    array = max((damaged / "checkpoint-20" / "state").rglob("d/*"), key=lambda path: path.stat().st_size)
    data = bytearray(array.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(byte ^ 1 for byte in data[len(data) // 2 : len(data) // 2 + 16])
    array.write_bytes(bytes(data))
    line = bad("--resume_from_checkpoint", str(damaged / "checkpoint-20"), output_dir=damaged)
    assert f"--resume_from_checkpoint {damaged / 'checkpoint-20'} is damaged: " in line
    assert "differs from the digest written with it: the file changed after the save" in line
    resumed = check_ok(run(flax_args(MLM, request, corpus, damaged, *RESUMABLE, "--resume_from_checkpoint")))
    log = resumed.stdout + resumed.stderr
    assert f"skipping {damaged / 'checkpoint-20'}: damaged (" in log and "Resuming at step 16" in log
    assert "Traceback" not in log and "Event loop" not in log
    assert (damaged / "flax_model.msgpack").read_bytes() == (full_dir / "flax_model.msgpack").read_bytes()
    # An evaluation of another model into a training run's folder would mix its results with the run's.
    line = refusal(flax_args(MLM, request, corpus, full_dir, "--do_eval", "--model_name_or_path", str(damaged)))
    assert f"{full_dir} already holds another evaluation's or model's results (train_results.json)" in line


def test_a_non_finite_step_right_after_a_resume_names_the_checkpoint_not_the_learning_rate():
    """The first step from a checkpoint that matched its digest diverging says to resume from an earlier one; a
    divergence later keeps the learning-rate advice."""
    script = load_script(MLM, "diverged")
    for step, expected, absent in ((21, "after resuming from", "--learning_rate"), (23, "--learning_rate", "after")):
        progress = script.TrainingProgress(global_step=step - 1, last_checkpoint="out/checkpoint-20")
        with pytest.raises(SystemExit) as stopped:
            script.stop_diverged(step, "the training loss is nan", progress, 20)
        assert expected in str(stopped.value.code) and absent not in str(stopped.value.code), stopped.value.code
        assert "out/checkpoint-20" in str(stopped.value.code)


def test_a_second_signal_ends_the_run_at_once():
    """The first SIGTERM in training asks for a checkpoint after the step; a second one (during that save) kills the
    process as SIGTERM's default does, so the last complete checkpoint stays as it was."""
    code = (
        "import os, signal, sys, time; sys.path.insert(0, 'tests'); from conftest import load_script; "
        f"script = load_script({MLM!r}, 'signals'); script.PROCESS.training = True; "
        "signal.signal(signal.SIGTERM, script.on_signal); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.5); "
        "print('asked', script.PROCESS.signal == signal.SIGTERM, flush=True); os.kill(os.getpid(), signal.SIGTERM); "
        "time.sleep(5); print('still alive')"
    )
    result = run(["-c", code])
    assert result.returncode == -signal.SIGTERM and result.stdout == "asked True\n", result.stdout + result.stderr


def test_fsdp_on_eight_devices_trains_as_one_and_resumes_on_fewer(uninterrupted, request, corpus, tmp_path):
    """--fsdp full_shard on 8 devices: every parameter and Adam moment of more than 2**14 elements is split 8 ways and
    the rest replicated, so a device holds at most 1/8 of the state plus the small arrays; the run logs the losses
    of the one-device run (to the log's 4 decimals, dropout included); its checkpoint resumes on 2 devices without
    --fsdp and on 1 device, and both end with the same losses."""
    _, one_device = uninterrupted(MLM)
    out, eight = tmp_path / "fsdp", fake_devices(8)
    args = flax_args(
        MLM, request, corpus, out, *RESUMABLE, "--per_device_train_batch_size", "1", "--fsdp", "full_shard"
    )
    result = check_ok(run(["-c", SHARDING_REPORT, *args], env=eight))
    arrays = json.loads(result.stdout.splitlines()[0])
    assert any(".mu[" in name and size > 2**14 for name, (size, *_) in arrays.items()), arrays
    for name, (size, nbytes, shard, shards) in arrays.items():
        assert (shards, shard * shards) == ((8, nbytes) if size > 2**14 else (1, nbytes)), name
    small = sum(nbytes for size, nbytes, _, _ in arrays.values() if size <= 2**14)
    assert sum(shard for _, _, shard, _ in arrays.values()) <= sum(v[1] for v in arrays.values()) / 8 + small
    sharded = losses_by_step(result.stdout + result.stderr)
    assert sharded.keys() == one_device.keys()
    # Logged to 4 decimals (each 5e-5 off), from the same sums in another order (float32 noise, 1e-6 of 7).
    assert all(abs(float(sharded[step]) - float(one_device[step])) <= 2e-4 for step in sharded), (sharded, one_device)
    for devices, per_device in ((2, "4"), (1, "8")):
        moved = tmp_path / f"on{devices}"
        shutil.copytree(out / "checkpoint-12", moved / "checkpoint-12")
        resume = ("--per_device_train_batch_size", per_device, "--resume_from_checkpoint")
        env = fake_devices(devices)
        resumed = check_ok(run(flax_args(MLM, request, corpus, moved, *RESUMABLE, *resume), env=env))
        log = resumed.stdout + resumed.stderr
        after = losses_by_step(log)
        assert min(map(int, after)) == 14 and "Resuming at step 12" in log
        assert all(abs(float(after[step]) - float(sharded[step])) <= 2e-4 for step in after), (
            after,
            sharded,
        )  # as above
