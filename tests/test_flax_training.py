"""The training loop the four Flax training scripts share: the non-finite guard, gradient accumulation,
Trainer-compatible outputs, and multi-host runs (exact resume: test_flax_resume.py)."""

import json
import os
import re
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
    FOUR_DEVICES,
    ROOT,
    TWO_DEVICES,
    check_ok,
    error_line,
    flax_args,
    logged_losses,
    run,
)

MLM = "flax/run_mlm_flax.py"
T5 = "flax/run_t5_mlm_flax.py"


def params_of(model_dir):
    import jax
    from flax.serialization import msgpack_restore

    return jax.tree_util.tree_leaves(msgpack_restore((model_dir / "flax_model.msgpack").read_bytes()))


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


@pytest.mark.parametrize("path", [MLM, "flax/run_bart_dlm_flax.py"])
def test_two_sharded_hosts_match_one_host_with_four_devices(path, request, corpus, tmp_path):
    """Multi-host sharded training: two processes with two devices each (JAX over localhost), with --fsdp full_shard
    (MLM) or hybrid_shard (BART), train as one data-parallel process with four devices: same batches, noise, dropout
    and updates, and the same evaluation (in bf16 with two micro-batches, so that --dtype bfloat16 is also run
    under the sharded step and lax.scan). --dtype bfloat16
    warns once on a CPU without bf16 instructions (LM_CPU_BF16=0), and not on one with them (LM_CPU_BF16=1).
    An encoder and an encoder-decoder: the machinery is the same text in the four scripts (test_layout.py), and
    each objective's per-row noise is checked against batch splits by the accumulation tests."""
    steps = [
        "--do_train",
        "--do_eval",
        "--per_device_train_batch_size",
        "2",
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
        run(flax_args(path, request, corpus, tmp_path / "single", *steps), env={**FOUR_DEVICES, "LM_CPU_BF16": "0"})
    )
    warnings = [line for line in single.stderr.splitlines() if "no bf16 instructions" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "--dtype bfloat16: this CPU" in warnings[0], (
        single.stderr[-3000:]
    )
    fsdp = ("--fsdp", "full_shard" if path == MLM else "hybrid_shard")
    multi = flax_args(path, request, corpus, tmp_path / "multi", *steps, *fsdp)
    procs = start_two_hosts(multi, tmp_path, LM_CPU_BF16="1", **TWO_DEVICES)
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "4 devices (2 local)" in logs[0] and not any("no bf16 instructions" in log for log in logs)
    expected = logged_losses(single.stdout + single.stderr)
    assert len(expected) == 4
    for log in logs:  # every process reports the global loss
        assert logged_losses(log) == pytest.approx(expected, abs=1e-4)
    one, two = (json.loads((tmp_path / d / "eval_results.json").read_text()) for d in ("single", "multi"))
    assert two["eval_samples"] == one["eval_samples"] and two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-4)
    assert (tmp_path / "multi" / "checkpoint-4" / "trainer_state").is_dir()


def start_two_hosts(args, tmp_path, **env):
    """Two processes (of one device each, unless `env` sets XLA_FLAGS), joined by JAX over localhost, running a
    script with `args`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        environment = {
            **{name: value for name, value in os.environ.items() if name != "XLA_FLAGS"},
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(rank),
            "HF_DATASETS_CACHE": str(tmp_path / f"cache{rank}"),
            **env,
        }
        popen = dict(cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(subprocess.Popen([sys.executable, *args], **popen))
    return procs


def test_sigterm_to_one_host_stops_both_at_one_step_with_a_checkpoint(request, corpus, tmp_path):
    """A preemption notice reaches one process of a multi-host run sharded with --fsdp full_shard: both stop after the
    same step, with that step's checkpoint, each saying so in one line, and exit 143; the run resumes on the same
    hosts sharded otherwise (--fsdp hybrid_shard)."""
    out, steps = tmp_path / "multi", ["--save_steps", "2", "--logging_steps", "1", "--report_to", "none"]
    args = flax_args(MLM, request, corpus, out, "--do_train", "--per_device_train_batch_size", "2", *steps)
    procs = start_two_hosts([*args, "--max_steps", "200", "--fsdp", "full_shard"], tmp_path, **TWO_DEVICES)
    deadline = time.time() + 300
    while not (out / "checkpoint-2" / "trainer_state").is_dir():
        assert all(p.poll() is None for p in procs) and time.time() < deadline, "no first checkpoint"
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGTERM)
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [143, 143], logs[0][-3000:] + logs[1][-3000:]
    stopped = [re.search(r"stopped at step (\d+) on SIGTERM; (\S+) saved", log) for log in logs]
    assert stopped[0] and stopped[1] and stopped[0].groups() == stopped[1].groups(), logs[0][-2000:]
    assert int(stopped[0][1]) < 200 and (out / f"checkpoint-{stopped[0][1]}" / "trainer_state").is_dir()
    resume = ["--resume_from_checkpoint", "--max_steps", str(int(stopped[0][1]) + 2), "--fsdp", "hybrid_shard"]
    procs = start_two_hosts([*args, *resume], tmp_path, **TWO_DEVICES)
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert f"Resuming at step {stopped[0][1]}" in logs[0] and len(logged_losses(logs[0])) == 2


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
