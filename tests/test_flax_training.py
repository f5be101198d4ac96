"""The training loop the four Flax training scripts share: the non-finite guard, gradient accumulation,
Trainer-compatible outputs, and multi-host runs (exact resume: test_flax_resume.py)."""

import functools
import json
import os
import re
import shutil
import signal
import socket
import time

import numpy as np
import pytest
from conftest import (
    FLAX_TRAINING_SCRIPTS,
    FOUR_DEVICES,
    TWO_DEVICES,
    check_ok,
    error_line,
    finish,
    flax_args,
    load_script,
    logged_losses,
    run,
    start,
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


def train_in_process(script, model_dir, train_file, output_dir, steps, **batch):
    """`steps` train steps through the script's own functions (main()'s calls), on one device; returns each step's
    loss and the first step's gradient, read from AdamW's first moment (which is (1 - beta1) x the gradient)."""
    import datasets
    import jax
    import optax

    model_args = script.ModelArguments(config_name=str(model_dir), tokenizer_name=str(model_dir))
    data_args = script.DataTrainingArguments(**{script.LENGTH_FLAG: 32})
    training_args = script.TrainingArguments(
        output_dir=str(output_dir), do_train=True, max_steps=steps, learning_rate=3e-3, report_to="none", **batch
    )
    config, tokenizer = script.load_config_and_tokenizer(model_args)
    length = script.resolve_max_seq_length(data_args, config, tokenizer)
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train_file.read_text().splitlines()})})
    rows = script.preprocess(raw, data_args, tokenizer, length)["train"]
    plan = script.plan_training(training_args, {"train": rows}, length)
    collator = script.build_collator(data_args, config, tokenizer, length, {"train": rows})
    model, state, schedule = script.build_train_state(model_args, training_args, config, plan)
    train_step = script.make_train_step(model, schedule, bf16=False, seed=training_args.seed, state=state)
    losses, gradient = [], None
    for ids in script.epoch_batches(plan.num_train_examples, plan.train_batch_size, training_args.seed, 0)[:steps]:
        batch = script.collate_batch(collator, rows[ids], (training_args.seed, 0), ids, len(ids))
        state, metrics = train_step(state, script.global_batch(batch, plan, training_args.gradient_accumulation_steps))
        losses.append(float(script.objective_means(metrics["sums"])["loss"]))
        if gradient is None:
            first_moment = optax.tree_utils.tree_get(state.opt_state, "mu")
            gradient = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(first_moment)]) / 0.1
    return np.array(losses), gradient


@pytest.mark.parametrize(
    "path,no_dropout", [(MLM, "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"), (T5, "dropout_rate=0.0")]
)
def test_gradient_accumulation_equals_the_larger_batch(path, no_dropout, request, corpus, tmp_path):
    """4 micro-batches of 4 rows give the gradient and losses of one batch of 16 (per-token mean over the global
    batch; masks and spans drawn per example), up to float32 rounding: the same sums in another order."""
    model_dir = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(FLAX_TRAINING_SCRIPTS[path][1]), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update({k: float(v) for k, v in (kv.split("=") for kv in no_dropout.split(","))})
    (model_dir / "config.json").write_text(json.dumps(config))
    script = load_script(path, "accumulation_" + path.split("/")[-1][:-3])
    train = functools.partial(train_in_process, script, model_dir, corpus / "train_slice.txt", tmp_path, 5)
    accumulated = train(per_device_train_batch_size=4, gradient_accumulation_steps=4)
    one_batch = train(per_device_train_batch_size=16)
    # The first step starts from the same weights: only the order of float32 additions differs, which moves a sum of
    # n terms by at most n x 2**-24 of the sum of their magnitudes (n <= 512 tokens here: 3e-5; the bound leaves room
    # for cancellation), in practice by about sqrt(n) x 2**-24 (measured 2e-7 to 7e-7 in norm). A dropped micro-batch,
    # a wrong divisor or a mean of micro-batch means moves the gradient by 30 % and more; Adam's first update ignores
    # its scale, so the losses alone would miss a wrong divisor.
    loss_error = abs(accumulated[0][0] - one_batch[0][0]) / one_batch[0][0]
    gradient_error = np.linalg.norm(accumulated[1] - one_batch[1]) / np.linalg.norm(one_batch[1])
    assert loss_error < 1e-5 and gradient_error < 1e-3, (loss_error, gradient_error)
    # Later, Adam moves a weight whose gradient is within rounding of zero by up to the learning rate either way, but
    # such a weight changes the loss by its near-zero gradient times that step: the losses stay close (measured 1e-7).
    np.testing.assert_allclose(accumulated[0], one_batch[0], rtol=1e-4)


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
    # A Flax run never imports torch (requirements.txt has it for the PyTorch scripts; tensorboardX would import it,
    # 1 s at each start): here torch's import fails the run.
    (tmp_path / "no_torch" / "torch").mkdir(parents=True)
    (tmp_path / "no_torch" / "torch" / "__init__.py").write_text("raise RuntimeError('a Flax run imported torch')")
    path = os.pathsep.join(filter(None, [str(tmp_path / "no_torch"), os.environ.get("PYTHONPATH")]))
    first = check_ok(run(args, env={"PYTHONPATH": path}))
    time.sleep(1.1)  # the run folder is named to the second
    second = check_ok(run(args))
    assert "hf_SECRET" not in first.stdout + first.stderr + second.stdout + second.stderr
    assert "First step (compilation included)" in first.stderr and "TFLOP/s | MFU" in first.stdout
    assert "Unable to initialize backend" not in first.stderr  # jax's INFO line on every machine without a TPU
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
    logs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "4 devices (2 local)" in logs[0] and not any("no bf16 instructions" in log for log in logs)
    expected = logged_losses(single.stdout + single.stderr)
    assert len(expected) == 4
    # The same sums over 4 devices in another order (float32 noise, 1e-6 of 7), logged to 4 decimals: each printed
    # value within half a unit of the last digit (5e-5) of its own, so two printed values of losses a float's noise
    # apart differ by up to 1e-4 + noise (6.99985 and 6.99984 print 6.9999 and 6.9998), and 1e-4 itself is not exact
    # in binary: 2e-5 added for the noise. The unrounded mean of the 4 losses (train_loss) at the noise's own 1e-5.
    for log in logs:  # every process reports the global loss
        assert logged_losses(log) == pytest.approx(expected, abs=1.2e-4)
    one, two = (json.loads((tmp_path / d / "train_results.json").read_text()) for d in ("single", "multi"))
    assert two["train_loss"] == pytest.approx(one["train_loss"], abs=1e-5)
    # The evaluation of weights that differ by that noise after 4 steps, as close.
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
            **os.environ,
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(rank),
            "HF_DATASETS_CACHE": str(tmp_path / f"cache{rank}"),
            **env,
        }
        procs.append(start(args, tmp_path / f"host{rank}.log", environment))
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
    logs = finish(procs, timeout=300)
    assert [p.returncode for p in procs] == [143, 143], logs[0][-3000:] + logs[1][-3000:]
    stopped = [re.search(r"stopped at step (\d+) on SIGTERM; (\S+) saved", log) for log in logs]
    assert stopped[0] and stopped[1] and stopped[0].groups() == stopped[1].groups(), logs[0][-2000:]
    assert int(stopped[0][1]) < 200 and (out / f"checkpoint-{stopped[0][1]}" / "trainer_state").is_dir()
    resume = ["--resume_from_checkpoint", "--max_steps", str(int(stopped[0][1]) + 2), "--fsdp", "hybrid_shard"]
    procs = start_two_hosts([*args, *resume], tmp_path, **TWO_DEVICES)
    logs = finish(procs, timeout=300)
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert f"Resuming at step {stopped[0][1]}" in logs[0] and len(logged_losses(logs[0])) == 2


# `python -c COUNTED script args...`: the script run as __main__, every host collective a process can make counted at
# the runtime, printed at exit as one JSON line: each call (not made from inside another) of a function of
# jax.experimental.multihost_utils; each call of the distributed runtime's client (its key-value store and barriers);
# and each execution of an XLA program with a collective (all-reduce, all-gather, ...) over the processes' devices:
# jit's C++ fast path is turned off, so that every execution passes through ExecuteReplicated.
COUNTED = """import atexit, collections, functools, json, re, runpy, sys, weakref
from jax._src import pjit
from jax._src.interpreters import pxla
from jax._src.lib import _jax
from jax.experimental import multihost_utils
counts, depth, programs = collections.Counter(), [0], weakref.WeakKeyDictionary()  # by executable
def counted(kind, name, f):
    @functools.wraps(f)
    def call(*args, **kwargs):
        if not depth[0]:
            counts[f"{kind}.{name}"] += 1
        depth[0] += 1
        try:
            return f(*args, **kwargs)
        finally:
            depth[0] -= 1
    return call
for name, f in list(vars(multihost_utils).items()):
    if callable(f) and getattr(f, "__module__", "") == multihost_utils.__name__ and not name.startswith("_"):
        setattr(multihost_utils, name, counted("multihost_utils", name, f))
client = _jax.DistributedRuntimeClient
for name in [n for n in dir(client) if not n.startswith("_")]:
    setattr(client, name, counted("client", name, getattr(client, name)))
COLLECTIVE = re.compile(r"\\b(all-reduce|all-gather|all-to-all|reduce-scatter|collective-)")
pjit._get_fastpath_data = lambda *args, **kwargs: None
execute = pxla.ExecuteReplicated.__call__
def executed(self, *args):
    if self not in programs:
        text = "".join(module.to_string() for module in self.xla_executable.hlo_modules())
        programs[self] = bool(COLLECTIVE.search(text))
    counts["collective programs"] += programs[self]
    return execute(self, *args)
pxla.ExecuteReplicated.__call__ = executed
atexit.register(lambda: print("host collectives: " + json.dumps(counts), file=sys.stderr, flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_multi_process_run_makes_no_host_collective_at_a_step_where_nothing_is_due(request, corpus, tmp_path):
    """Two processes agree on each batch's shapes and on a stop inside the train step (ProcessAgreement): a run of
    12 steps makes the same host collectives as one of 4 (at the start, and for the log line and the checkpoint at
    the end), and runs exactly one program with a collective a step more (the train step, gradients and votes in
    one): at no step does a process wait on the others but inside the step."""
    counts = []
    for steps in ("4", "12"):
        out = tmp_path / f"steps-{steps}"
        args = flax_args(MLM, request, corpus, out, "--do_train", "--per_device_train_batch_size", "2", "--max_steps")
        procs = start_two_hosts(["-c", COUNTED, *args, steps, "--report_to", "none"], tmp_path)
        logs = finish(procs)
        assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
        counts.append([json.loads(re.search(r"host collectives: (\{.*\})", log)[1]) for log in logs])
        assert len(logged_losses(logs[0])) == 1 and (out / f"checkpoint-{steps}" / "trainer_state").is_dir()
    for short, long in zip(*counts):  # each process's counts: 4 steps, 12 steps
        programs = short.pop("collective programs"), long.pop("collective programs")
        assert programs[1] - programs[0] == 8 and programs[0] >= 4, (programs, short)
        assert short["multihost_utils.process_allgather"] > 0 and short == long, (short, long)


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


def test_new_weights_are_drawn_on_the_default_device_where_jax_platforms_leaves_out_the_cpu(monkeypatch):
    """init_model draws a new model's weights with XLA:CPU; with JAX_PLATFORMS=cuda (no CPU backend, faked here) it
    draws the same weights on the default device instead of stopping."""
    from types import SimpleNamespace

    import jax
    import transformers

    script = load_script(MLM, "platforms_run_mlm_flax")
    config = transformers.RobertaConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    args = (None, SimpleNamespace(dtype="float32", trust_remote_code=False))
    args += (SimpleNamespace(seed=3, gradient_checkpointing=False), False)
    _, on_cpu = script.init_model(transformers.FlaxAutoModelForMaskedLM, config, *args)
    local_devices = jax.local_devices

    def no_cpu_backend(process_index=None, backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return local_devices(process_index, backend)

    monkeypatch.setattr(jax, "local_devices", no_cpu_backend)
    platforms = jax.config.jax_platforms
    jax.config.update("jax_platforms", "cuda")  # read by init_model only: this process's backends stay as they are
    try:
        _, on_default = script.init_model(transformers.FlaxAutoModelForMaskedLM, config, *args)
    finally:
        jax.config.update("jax_platforms", platforms)
    assert jax.tree.all(jax.tree.map(np.array_equal, on_cpu, on_default))
