"""The training loop the four Flax training scripts share: exact resume after kill -9, resume refusals, the
non-finite guard, gradient accumulation, Trainer-compatible outputs, and multi-host runs."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import (
    FLAX_TRAINING_SCRIPTS,
    ROOT,
    TWO_DEVICES,
    check_ok,
    error_line,
    flax_args,
    logged_losses,
    losses_by_step,
    run,
)

MLM = "flax/run_mlm_flax.py"
T5 = "flax/run_t5_mlm_flax.py"
RESUMABLE = [
    "--do_train",
    "--per_device_train_batch_size",
    "8",
    "--max_steps",
    "60",
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


def params_of(model_dir):
    import jax
    from flax.serialization import msgpack_restore

    return jax.tree_util.tree_leaves(msgpack_restore((model_dir / "flax_model.msgpack").read_bytes()))


def kill_after_first_checkpoint(args, output_dir):
    """Start a training run and kill -9 it once its first checkpoint is complete; return what it printed."""
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 300
    while not (output_dir / "checkpoint-4" / "trainer_state").is_dir():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    return proc.communicate()[0]


@pytest.fixture(scope="module")
def uninterrupted(request, corpus, tmp_path_factory):
    """For MLM and T5: a 60-step run that saves every 4 steps, its output folder and its logged losses."""
    runs = {}
    for path in (MLM, T5):
        out = tmp_path_factory.mktemp("full")
        result = check_ok(run(flax_args(path, request, corpus, out, *RESUMABLE)))
        runs[path] = out, losses_by_step(result.stdout + result.stderr)
    return runs


@pytest.mark.parametrize("path", [MLM, T5])
def test_kill_9_then_resume_is_bitwise_exact(path, uninterrupted, request, corpus, tmp_path):
    """kill -9 at any point after the first checkpoint, then the same command with --resume_from_checkpoint:
    the final weights are bitwise those of an uninterrupted run, and every logged loss is the same. A
    checkpoint the kill cut short (Orbax's temporary folder) is skipped with a warning."""
    full_dir, full_losses = uninterrupted[path]
    out = tmp_path / "run"
    args = flax_args(path, request, corpus, out, *RESUMABLE)
    before = losses_by_step(kill_after_first_checkpoint(args, out))
    complete = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "trainer_state").is_dir())
    # What a kill in the middle of writing the next checkpoint leaves: a partial temporary folder.
    partial = out / f"checkpoint-{complete[-1] + 4}.orbax-checkpoint-tmp-1"
    shutil.copytree(out / f"checkpoint-{complete[-1]}", partial)
    shutil.rmtree(partial / "state")

    resumed = check_ok(run(args + ["--resume_from_checkpoint"]))
    log = resumed.stdout + resumed.stderr
    assert f"skipping {partial}" in log and f"Resuming at step {complete[-1]}" in log
    assert complete[-1] < 60, "the kill came too late to test a resume"
    after = losses_by_step(log)
    assert before and after and min(map(int, after)) > complete[-1]
    for step, loss in {**before, **after}.items():
        assert loss == full_losses[step], (step, loss, full_losses[step])
    assert (out / "flax_model.msgpack").read_bytes() == (full_dir / "flax_model.msgpack").read_bytes()
    assert not list(out.glob("*orbax-checkpoint-tmp*"))


def test_resume_refusals_and_a_resume_on_more_devices(uninterrupted, request, corpus, tmp_path):
    full_dir, _ = uninterrupted[MLM]

    def bad(*extra, env=None, output_dir=full_dir):
        return error_line(
            run(flax_args(MLM, request, corpus, output_dir, *RESUMABLE, *extra), env=env), "run_mlm_flax.py"
        )

    assert "--resume_from_checkpoint to continue it" in bad()
    assert "holds no complete checkpoint" in bad("--resume_from_checkpoint", output_dir=tmp_path / "empty")
    assert "not a complete checkpoint" in bad("--resume_from_checkpoint", str(tmp_path / "nowhere"))
    line = bad("--resume_from_checkpoint", "--per_device_train_batch_size", "4")
    assert "train_batch_size 8" in line and "this run has 4" in line
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
    shutil.copytree(full_dir / "checkpoint-56", moved / "checkpoint-56")
    extra = ("--resume_from_checkpoint", "--per_device_train_batch_size", "4", "--mlm_probability", "0.2")
    result = check_ok(run(flax_args(MLM, request, corpus, moved, *RESUMABLE, *extra), env=TWO_DEVICES))
    assert "other objective settings; going on with this run's: --mlm_probability 0.15 -> 0.2" in result.stderr
    assert "written on 1 devices and this run has 2" in result.stderr and sorted(
        map(int, losses_by_step(result.stdout + result.stderr))
    ) == [58, 60]


def test_non_finite_loss_stops_before_any_checkpoint_holds_it(request, corpus, tmp_path):
    out = tmp_path / "diverged"
    args = flax_args(
        MLM,
        request,
        corpus,
        out,
        "--do_train",
        "--do_eval",
        "--per_device_train_batch_size",
        "8",
        "--max_steps",
        "20",
        "--logging_steps",
        "1",
        "--save_steps",
        "1",
        "--learning_rate",
        "1e6",
    )
    line = error_line(run(args), "run_mlm_flax.py")
    assert "step 2: the training loss is nan" in line and f"the last good checkpoint is {out / 'checkpoint-1'}" in line
    assert (
        sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
        and not (out / "eval_results.json").exists()
    )
    assert all(np.isfinite(w).all() for w in params_of(out))  # the from_pretrained weights are checkpoint-1's


@pytest.mark.parametrize(
    "path,no_dropout", [(MLM, "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"), (T5, "dropout_rate=0.0")]
)
def test_gradient_accumulation_equals_the_larger_batch(path, no_dropout, request, corpus, tmp_path):
    """4 micro-batches of 4 rows give the losses and weights of one batch of 16 (per-token mean over the
    global batch; masks and spans drawn per example)."""
    model_type, fixture, _ = FLAX_TRAINING_SCRIPTS[path]
    model_dir = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update({k: float(v) for k, v in (kv.split("=") for kv in no_dropout.split(","))})
    (model_dir / "config.json").write_text(json.dumps(config))
    common = [
        "--do_train",
        "--max_steps",
        "5",
        "--logging_steps",
        "1",
        "--learning_rate",
        "3e-3",
        "--config_name",
        str(model_dir),
        "--report_to",
        "none",
    ]
    losses, weights = {}, {}
    for name, batch in (
        ("accumulated", ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"]),
        ("one_batch", ["--per_device_train_batch_size", "16"]),
    ):
        result = check_ok(run(flax_args(path, request, corpus, tmp_path / name, *common, *batch)))
        losses[name], weights[name] = logged_losses(result.stdout + result.stderr), params_of(tmp_path / name)
    assert len(losses["accumulated"]) == 5
    np.testing.assert_allclose(losses["accumulated"], losses["one_batch"], rtol=1e-5)
    # The sums run in another order: float noise, which Adam's division by sqrt(v) magnifies for weights with
    # near-zero gradients (measured up to 5e-6 after 5 steps at learning rate 3e-3; weights are ~0.02).
    for a, b in zip(weights["accumulated"], weights["one_batch"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_trainer_compatible_logs_and_results(request, corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "logged"
    args = flax_args(
        MLM,
        request,
        corpus,
        out,
        "--do_train",
        "--do_eval",
        "--per_device_train_batch_size",
        "8",
        "--max_steps",
        "6",
        "--logging_steps",
        "3",
        "--eval_steps",
        "3",
        "--overwrite_output_dir",
        "--hub_token",
        "hf_SECRET",
        "--peak_tflops",
        "1",
    )
    first = check_ok(run(args))
    time.sleep(1.1)  # the run folder is named to the second
    second = check_ok(run(args))
    assert "hf_SECRET" not in first.stdout + first.stderr + second.stdout + second.stderr
    assert "First step (compilation included)" in first.stderr and "TFLOP/s | MFU" in first.stdout
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == 2  # a rerun never merges its curves into the earlier run's
    events = EventAccumulator(str(runs[-1]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/learning_rate",
        "train/tokens_per_second",
        "eval/loss",
        "eval/accuracy",
        "eval/perplexity",
    } <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [3, 6] and [
        e.step for e in events.Scalars("eval/loss")
    ] == [3, 6]
    results = json.loads((out / "all_results.json").read_text())
    for key in (
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "train_loss",
        "epoch",
        "eval_loss",
        "eval_accuracy",
        "eval_perplexity",
        "eval_runtime",
        "eval_samples_per_second",
    ):
        assert key in results, key
    assert json.loads((out / "train_results.json").read_text())["global_step"] == 6
    quiet = check_ok(
        run(
            flax_args(
                MLM, request, corpus, tmp_path / "quiet", "--do_eval", "--report_to", "none", "--log_level", "warning"
            )
        )
    )
    assert " - INFO - " not in quiet.stderr and not (tmp_path / "quiet" / "runs").exists()


@pytest.mark.parametrize("path", FLAX_TRAINING_SCRIPTS)
def test_two_hosts_match_one_host_with_two_devices(path, request, corpus, tmp_path):
    """Multi-host data parallelism: two processes with one device each (JAX over localhost) train exactly
    as one process with two devices: same batches, noise, dropout and updates, and the same evaluation
    (in bf16 with two micro-batches, so that --dtype bfloat16 is also run under pmap and lax.scan). --dtype bfloat16
    warns once on a CPU without bf16 instructions (LM_CPU_BF16=0), and not on one with them (LM_CPU_BF16=1)."""
    steps = [
        "--do_train",
        "--do_eval",
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--max_steps",
        "4",
        "--logging_steps",
        "1",
        "--learning_rate",
        "1e-3",
        "--save_steps",
        "2",
        "--report_to",
        "none",
        "--dtype",
        "bfloat16",
    ]
    single = check_ok(
        run(flax_args(path, request, corpus, tmp_path / "single", *steps), env={**TWO_DEVICES, "LM_CPU_BF16": "0"})
    )
    warnings = [line for line in single.stderr.splitlines() if "no bf16 instructions" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "--dtype bfloat16: this CPU" in warnings[0], (
        single.stderr[-3000:]
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(rank),
            "HF_DATASETS_CACHE": str(tmp_path / f"cache{rank}"),
            "LM_CPU_BF16": "1",
        }
        env.pop("XLA_FLAGS", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, *flax_args(path, request, corpus, tmp_path / "multi", *steps)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "2 devices (1 local)" in logs[0] and not any("no bf16 instructions" in log for log in logs)
    expected = logged_losses(single.stdout + single.stderr)
    assert len(expected) == 4
    for log in logs:  # every process reports the global loss
        assert logged_losses(log) == pytest.approx(expected, abs=1e-4)
    one, two = (json.loads((tmp_path / d / "eval_results.json").read_text()) for d in ("single", "multi"))
    assert two["eval_samples"] == one["eval_samples"] and two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-4)
    assert (tmp_path / "multi" / "checkpoint-4" / "trainer_state").is_dir()


def test_compiler_memory_goes_back_to_the_os_after_each_compilation(monkeypatch):
    """release_compiler_memory (shared verbatim by the four scripts) calls malloc_trim once per XLA compilation."""
    import ctypes
    import platform

    import jax
    import jax.numpy as jnp
    from conftest import load_script

    if platform.libc_ver()[0] == "glibc":
        assert ctypes.CDLL("libc.so.6").malloc_trim  # the real path, not the no-op, runs here
    script = load_script(MLM, "memory_run_mlm_flax")
    calls = []
    monkeypatch.setattr(
        script.ctypes, "CDLL", lambda name: type("Libc", (), {"malloc_trim": staticmethod(calls.append)})
    )
    script.release_compiler_memory()
    script.release_compiler_memory()  # a second main() in the same process adds no second listener
    step = jax.jit(lambda x: jnp.cos(x) * 3)
    step(np.ones(13, np.float32)).block_until_ready()  # a new function: one compilation
    assert calls == [0]
    step(np.ones(13, np.float32)).block_until_ready()  # compiled already: no trim
    assert calls == [0]


def test_a_copied_script_names_itself(request, corpus, tmp_path):
    """A researcher's copy refuses bad input under its own name, and neither that nor a short training run's output
    names the file it was copied from (fail() is the same text in the four scripts: test_layout.py)."""
    copy = tmp_path / "run_wwm_flax.py"
    shutil.copy(os.path.join(ROOT, MLM), copy)
    line = error_line(run([str(copy), "--output_dir", str(tmp_path / "refused"), "--no_such_flag"]), "run_wwm_flax.py")
    assert "unknown argument --no_such_flag" in line
    args = flax_args(
        MLM,
        request,
        corpus,
        tmp_path / "out",
        "--do_train",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
    )
    result = check_ok(run([str(copy), *args[1:]]))
    written = "".join(
        p.read_text(errors="ignore")
        for p in (tmp_path / "out").rglob("*")
        if p.is_file() and p.suffix in (".json", ".txt")
    )
    assert "run_mlm_flax" not in result.stdout + result.stderr + written
