#!/usr/bin/env python
"""One masked-LM workload in every framework, timed side by side: the runtime table of the original
README (Flax vs PyTorch vs PyTorch/XLA), on this machine, plus TensorFlow.

  python benchmarks/run_benchmark.py --quick --output_dir out/bench            # tiny model, a few minutes
  python benchmarks/run_benchmark.py --size base --output_dir out/bench-base   # roberta-base, batch 8 x 128
  python benchmarks/run_benchmark.py --end_to_end --size tiny --steps 300 --output_dir out/bench-e2e   # the real scripts

Every mode runs --repeats times (3), interleaved round-robin so that the machine's drift hits every mode
alike; tables give the median with the range, and ratios between modes are taken round by round.

--end_to_end runs the training scripts themselves, as a user would (flax/run_mlm_flax.py in fp32 and
--dtype bfloat16, pytorch/run_mlm.py eager and --bf16, pytorch/xla_spawn.py --num_cores 1, tensorflow/run_mlm.py
in fp32 and --bfloat16 after prepare_tfrecord_shards.py, whose time counts in TensorFlow's wall time) on the same text,
tokenizer, initial weights, sequence length, global batch, schedule and steps, each evaluating on the same
held-out blocks every --eval_steps: wall time of the whole command (the original README's table), training
time, tokens/s, final eval loss and accuracy (the scripts' own eval_results.json), peak RSS, the time each
first reaches a target eval loss, and the eval-loss curves by step and by wall-clock second (curves.png).
Each script picks its device as it always does, so the same command runs on a GPU or TPU host.

The same work everywhere: one tokenizer (8,192-token ByteLevelBPE on Penn Treebank), one RoBERTa
config (dropout 0, so runs are deterministic), the same initial weights (PyTorch init, loaded into Flax
and TF with from_pt), the same pre-masked batches in the same order (masked by flax/run_mlm_flax.py's
collator), the same loss (mean cross-entropy over masked tokens), and AdamW with the same warm-up and
linear decay and weight decay on the same parameters. Each mode runs in its own process (fresh peak
RSS), with the scripts' code paths where they have one: the Flax step, written here, uses run_mlm_flax.py's
masked_lm_logits, token_sums, decay_mask_fn and learning-rate schedule under jit; the PyTorch optimizer is the Trainer's
(transformers.Trainer.create_optimizer/create_scheduler); TF's is tensorflow/run_mlm.py's
create_optimizer. The loops are minimal (no Trainer/Keras fit bookkeeping), so they time the framework.

Per mode: first step (tracing/compilation included), median of the timed steps (each synchronised by
fetching its loss), tokens/s, model FLOPs per step and MFU against the matrix-multiply peak measured
in this run, peak RSS, and the train loss after the common number of steps. Also: tokenization and
grouping throughput (linear-time group_texts vs upstream's sum(lists, [])), and run_bert_flax.py fp32
vs bf16 inference. Writes OUTPUT_DIR/results.{md,json,png}, with the CPU model and its bf16 support; as each mode
ends, partial.{md,json,png} hold what has run (a run cut short leaves them; a finished one removes them).
--profile_steps N profiles N more steps of each Flax and PyTorch mode (jax.profiler, torch.profiler): the device's busy
time against the step's wall time, by kernel group (matrix products, attention, copies, other) and the top kernels;
where Flax's fastest mode is slower than the fastest other, the goals name the part it loses most in.

On a GPU (nvidia-smi lists one) the modes are GPU_MODES (`--modes gpu` names them anywhere): Flax fp32, ours
--dtype bfloat16 and upstream's (the model's dtype), PyTorch fp32, bf16 autocast and torch.compile bf16; MFU is taken
against NVIDIA's published dense peak for the precision the row's products ran in (JAX's f32 products run in TF32
there, torch's in f32), and each row gives its peak device memory. benchmarks/gpu.sh runs it on a GPU machine.

On a CPU without bf16 instructions (AVX2 only, say) bf16 is computed in f32 or emulated, no faster than fp32 and in
PyTorch many times slower: the bf16 modes and the bf16 inference line are skipped, with the reason in their rows,
unless --modes names a bf16 mode (then they run, after a warning). LM_CPU_BF16=1 or 0 overrides what the CPU's flags say.
"""

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    # hidden, layers, heads, intermediate, vocab, sequence length, global batch
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        vocab_size=8192,
        seq_len=64,
        batch_size=64,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=8192,
        seq_len=128,
        batch_size=16,
    ),
    "base": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        vocab_size=50265,
        seq_len=128,
        batch_size=8,
    ),
}
# name: (framework, precision, what)
MODES = {
    "flax": ("flax", "fp32", "jax.jit, donated state, LM head at masked positions"),
    "flax_bf16": ("flax", "bf16", "as flax, dense layers bf16 x bf16 -> f32 (f32 model)"),
    "flax_model_bf16": ("flax", "bf16", "as flax, the model's dtype bfloat16 (upstream's --dtype bfloat16)"),
    "flax_fsdp": ("flax", "fp32", "as flax, --fsdp full_shard over fake CPU devices"),
    "torch": ("pytorch", "fp32", "eager"),
    "torch_bf16": ("pytorch", "bf16", "eager, CPU autocast bfloat16"),
    "torch_compile": ("pytorch", "fp32", "torch.compile (inductor)"),
    "torch_compile_bf16": ("pytorch", "bf16", "torch.compile (inductor), autocast bfloat16"),
    "torch_xla": ("pytorch/xla", "fp32", "XLA:CPU, own venv"),
    "tf": ("tensorflow", "fp32", "tf.function"),
    "tf_xla": ("tensorflow", "fp32", "tf.function(jit_compile=True)"),
    "tf_bf16": ("tensorflow", "bf16", "mixed_bfloat16"),
}
DEFAULT_MODES = [m for m in MODES if m not in ("flax_fsdp", "flax_model_bf16", "torch_compile_bf16")]
# On a GPU (the default there; `--modes gpu` anywhere): no TensorFlow on the GPU machines we are lent, and no CPU-only
# modes; upstream's bf16 (the model's dtype) as a reference row beside ours.
GPU_MODES = ["flax", "flax_bf16", "flax_model_bf16", "torch", "torch_bf16", "torch_compile_bf16"]
# Published dense peaks, TFLOP/s, by the products' precision: NVIDIA's datasheets (SXM parts unless named). The first
# name found in the GPU's name wins; a GPU not listed is measured against this run's matrix-product peak.
GPU_PEAKS = {
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.3},
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
LEARNING_RATE, WEIGHT_DECAY, BETAS, EPS = 5e-4, 0.01, (0.9, 0.999), 1e-8
MLM_PROBABILITY = 0.15


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def cpu_bf16(cpuinfo="/proc/cpuinfo"):
    """(CPU model, its bf16 support) from cpuinfo's flags (Linux): "AMX-BF16" or "AVX-512 BF16" (bf16 products in
    hardware), "none, AVX2 only" or the like (bf16 computed in f32 or emulated: no faster than float32, or slower),
    "unknown" (no cpuinfo). LM_CPU_BF16=1 or 0 overrides the flags, for tests and for CPUs not listed here."""
    first_cpu = ""
    with contextlib.suppress(OSError), open(cpuinfo) as f:
        first_cpu = f.read().split("\n\n")[0]
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first_cpu.splitlines())}
    flags = set(fields.get("flags", "").split())
    widest = next((f", {name} only" for name in ("AVX-512F", "AVX2") if name.lower().replace("-", "") in flags), "")
    support = "AMX-BF16" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else f"none{widest}"
    override = os.environ.get("LM_CPU_BF16", "")
    if override not in ("", "0", "1"):
        fail(f"LM_CPU_BF16 must be 1 (this CPU has bf16 instructions) or 0 (it has none), got {override!r}")
    overrides = {"": support if flags else "unknown", "1": "native, LM_CPU_BF16=1", "0": "none, LM_CPU_BF16=0"}
    return fields.get("model name", "unknown CPU"), overrides[override]


def slow_bf16(modes, precisions, named):
    """{mode: why it is skipped} for the bf16 modes on a CPU without bf16 instructions, where bf16 is computed in f32
    or emulated (slower than fp32, PyTorch's many times so). Modes named in --modes run anyway, with a warning."""
    model, support = cpu_bf16()
    bf16 = [m for m in modes if precisions[m] == "bf16"]
    if not support.startswith("none") or not bf16:
        return {}
    if named:
        print(
            f"warning: {', '.join(bf16)}: this CPU ({model}, bf16: {support}) has no bf16 instructions; they run as "
            "asked, no faster than fp32 (PyTorch's many times slower)",
            file=sys.stderr,
        )
        return {}
    return {
        m: f"this CPU has no bf16 instructions (bf16: {support}), so bf16 is no faster than fp32 here; name it in "
        "--modes to run it anyway"
        for m in bf16
    }


def model_flops_per_step(config, batch_size, seq_len):
    """Training FLOPs of one step of RoBERTa MLM: 3 x forward (backward = 2 x forward), counting
    multiply-adds as 2 FLOPs, matrix products only (embeddings, softmax, norms left out). Per token and
    layer: Q, K, V and output projections 8h^2, feed-forward 4hf, attention scores and values 4sh; the
    LM head (dense h x h and decoder h x V) runs on every position, as in transformers."""
    h, f, n_layers, v = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
        config["vocab_size"],
    )
    per_token = n_layers * (8 * h * h + 4 * h * f + 4 * seq_len * h) + 2 * h * h + 2 * h * v
    return 3 * batch_size * seq_len * per_token


def load_script(relpath):
    """Import a project script by path (its folder may share a name with a package, so never by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_" + Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- workers: each runs in its own process and prints one JSON line ----------------------------------


def learning_rates(total_steps):
    """Linear warm-up over 10% of the steps from 0, then linear decay to 0 (the Trainer's, optax's and
    create_optimizer's schedules all give these values at steps 0, 1, ...)."""
    warmup = max(1, total_steps // 10)
    return warmup, [
        LEARNING_RATE * (s / warmup if s < warmup else max(0.0, (total_steps - s) / max(1, total_steps - warmup)))
        for s in range(total_steps)
    ]


def data_digest(batches):
    digest = hashlib.sha256()
    for key in ("input_ids", "attention_mask", "labels"):
        digest.update(np.ascontiguousarray(batches[key]).tobytes())
    return digest.hexdigest()[:16]


def timed_loop(step_fn, batches):
    """Run every batch through step_fn (which must return the loss as a Python float, i.e. wait for the
    device); return the per-step wall times and losses."""
    times, losses = [], []
    for i in range(batches["input_ids"].shape[0]):
        batch = {k: batches[k][i] for k in ("input_ids", "attention_mask", "labels")}
        start = time.perf_counter()
        losses.append(step_fn(batch))
        times.append(time.perf_counter() - start)
    return times, losses


# A profiled step's kernels by group, from their names (on a CPU: XLA's ops, torch's aten ops); the first that matches.
KERNEL_GROUPS = {
    "matrix products": r"gemm|xmma|nvjet|cutlass|cublas|matmul|dot|ynn|aten::(add|b)?mm\b",
    "attention": r"flash|fmha|attention|sdpa",  # fused attention only: a softmax may be the loss's
    "copies": r"memcpy|memset|copy",
}


def profile_summary(kernels, steps, wall_s, source):
    """Where a step's time goes, from `steps` profiled steps: their wall time, the device's busy time (kernels summed;
    the rest is the host's: launches, Python, waiting), the kernels a step, the busy time by KERNEL_GROUPS and the
    top kernels. kernels: {name: [microseconds, calls]} over all the steps."""
    import re

    per_step = {name: [us / 1000 / steps, calls / steps] for name, (us, calls) in kernels.items()}
    groups = dict.fromkeys([*KERNEL_GROUPS, "other"], 0.0)
    for name, (ms, _) in per_step.items():
        groups[next((g for g, p in KERNEL_GROUPS.items() if re.search(p, name, re.I)), "other")] += ms
    top = sorted(per_step.items(), key=lambda item: -item[1][0])[:8]
    return {
        "steps": steps,
        "source": source,
        "wall_ms": 1000 * wall_s / steps,
        "busy_ms": sum(groups.values()),
        "kernels_per_step": sum(calls for _, calls in per_step.values()),
        "groups_ms": groups,
        "top": [[name[:100], ms, calls] for name, (ms, calls) in top],
    }


@contextlib.contextmanager
def jax_trace(kernels):
    """jax.profiler.trace, its kernels added to `kernels` on exit: the GPU's streams' (CUPTI), or on a CPU the XLA ops
    of its client threads. Yields the list the lines read go into."""
    import tempfile

    import jax

    lines = []
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            yield lines
        data = jax.profiler.ProfileData.from_file(str(next(Path(trace_dir).rglob("*.xplane.pb"))))
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if planes:  # the streams' kernels and copies; XLA's derived lines (modules, ops, steps) only where no stream is
        read = [line for p in planes for line in p.lines if "Stream" in line.name] or [
            line for p in planes for line in p.lines if not line.name.startswith(("XLA", "Steps", "Framework"))
        ]
        events = [e for line in read for e in line.events]
    else:  # XLA:CPU's ops run on its client's and its thread pool's threads (tf_XLA...), each op an event named by
        # its HLO instruction, among the executor's own ("ThunkExecutor::Execute", "end: NAME"); threads overlap
        read = [
            line for p in data.planes if p.name == "/host:CPU" for line in p.lines if line.name.startswith("tf_XLA")
        ]
        events = [e for line in read for e in line.events if ":" not in e.name]
    lines += sorted({line.name.split("/")[0] for line in read})  # a CPU's threads: "tf_XLAEigen/ID"
    for e in events:
        kernels.setdefault(e.name, [0.0, 0])
        kernels[e.name][0] += e.duration_ns / 1000
        kernels[e.name][1] += 1


@contextlib.contextmanager
def torch_trace(kernels):
    """torch.profiler, its kernels added to `kernels` on exit: the CUDA kernels, or on a CPU the aten ops' self
    time. Yields the list of what was read."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    read = ["CUDA kernels" if cuda else "aten ops (self CPU time)"]
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        yield read
    for a in prof.key_averages():
        if (a.device_type == torch.autograd.DeviceType.CUDA) if cuda else a.key.startswith("aten::"):
            kernels[a.key] = [a.device_time_total if cuda else a.self_cpu_time_total, a.count]


def profiled(run, batches, steps, trace):
    """`steps` more steps of `run` (the first batches again) under `trace` (jax_trace or torch_trace): where their
    time goes (profile_summary), or {"error": why} (a profile is a diagnosis: its failure costs the row nothing)."""
    kernels = {}
    try:
        with trace(kernels) as read:
            start = time.perf_counter()
            for i in range(steps):
                run({k: batches[k][i] for k in ("input_ids", "attention_mask", "labels")})
            wall = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 (the profiler's own failure, reported in the row)
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    if not kernels:
        return {"error": f"the profile held no kernels (read: {', '.join(read) or 'nothing'})"}
    return profile_summary(kernels, steps, wall, ", ".join(read))


def worker_flax(spec, batches):
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state
    from transformers import FlaxAutoModelForMaskedLM

    mlm = load_script("flax/run_mlm_flax.py")
    mlm.release_compiler_memory()
    # run_mlm_flax.py --dtype bfloat16: an f32 model with bf16 dense products; flax_model_bf16: upstream's meaning of
    # the flag, the model's dtype (bf16 activations and products, f32 weights)
    bf16 = spec["mode"] == "flax_bf16"
    dtype = jnp.bfloat16 if spec["mode"] == "flax_model_bf16" else jnp.float32
    # _do_init=False: the model object keeps no copy of the weights beside the train state's.
    model, params = FlaxAutoModelForMaskedLM.from_pretrained(
        os.path.join(spec["init_dir"], "flax"), _do_init=False, dtype=dtype
    )
    total = batches["input_ids"].shape[0]
    warmup, _ = learning_rates(total)
    schedule = mlm.create_learning_rate_fn(total, warmup, LEARNING_RATE)
    tx = optax.adamw(schedule, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, mask=mlm.decay_mask_fn)
    num_params = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
    state = train_state.TrainState.create(apply_fn=model.__call__, params=params, tx=tx)
    del params

    def train_step(state, batch):
        def loss_fn(params):
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "masked_positions")}
            logits = mlm.masked_lm_logits(model, params, inputs, bf16)
            loss, _, count = mlm.token_sums(logits, batch["labels"], batch["labels"] != -100)
            return loss, count

        grad_fn = jax.value_and_grad(jax.checkpoint(loss_fn, policy=mlm.save_all_but_transcendentals), has_aux=True)
        (loss, count), grad = grad_fn(state.params)
        count = jnp.maximum(count, 1)
        grad = jax.tree_util.tree_map(lambda g: g / count, grad)
        return state.apply_gradients(grads=grad), loss / count

    if spec["mode"] == "flax_fsdp":  # the script's mesh and shardings; its batch rows split over the devices
        mesh = mlm.make_mesh("full_shard")
        state = jax.tree_util.tree_map(jnp.asarray, state)  # TrainState.create leaves the step a Python int
        shardings = mlm.state_shardings(state, mesh, "full_shard")
        state = jax.device_put(state, shardings)
        step = jax.jit(train_step, out_shardings=(shardings, None), donate_argnums=(0,))
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("replica", "fsdp")))

        def run(batch):
            nonlocal state
            state, loss = step(state, jax.device_put(mlm.gather_masked(batch, MLM_PROBABILITY), rows))
            return float(loss)

        extra = {"devices": jax.device_count()}
    else:
        step = jax.jit(train_step, donate_argnums=(0,))
        # Committed to the device like the step's outputs, so that the second step does not compile again.
        state = jax.device_put(state, jax.devices()[0])

        def run(batch):
            nonlocal state
            state, loss = step(state, mlm.gather_masked(batch, MLM_PROBABILITY))
            return float(loss)

        extra = {"devices": 1}
    times, losses = timed_loop(run, batches)
    if spec["profile_steps"]:
        extra["profile"] = profiled(run, batches, spec["profile_steps"], jax_trace)
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    return dict(
        times=times,
        losses=losses,
        num_params=num_params,
        versions={"jax": jax.__version__, "flax": __import__("flax").__version__, **backend_version(device)},
        # XLA:GPU computes an f32 product in TF32 at jax's default precision
        products="bf16" if spec["precision"] == "bf16" else "tf32" if gpu else "fp32",
        device_peak_mb=(device.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**20 or None,
        **extra,
    )


def backend_version(device):
    """{"CUDA (jax)": ...} on a GPU: the version XLA's GPU client reports."""
    return {"CUDA (jax)": device.client.platform_version} if device.platform == "gpu" else {}


def worker_torch(spec, batches):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForMaskedLM, Trainer, TrainingArguments

    xla = spec["mode"] == "torch_xla"
    if xla:
        import torch_xla

        device = torch_xla.device()
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForMaskedLM.from_pretrained(os.path.join(spec["init_dir"], "pytorch")).to(device).train()
    total = batches["input_ids"].shape[0]
    warmup, _ = learning_rates(total)
    # The optimizer and schedule exactly as the Trainer (pytorch/run_mlm.py) builds them.
    args = TrainingArguments(
        output_dir=spec["work_dir"],
        learning_rate=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        warmup_steps=warmup,
        lr_scheduler_type="linear",
        optim="adamw_torch",
        report_to="none",
        use_cpu=device.type == "cpu",
    )
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=total)
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    forward = torch.compile(model) if spec["mode"].startswith("torch_compile") else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16")

    def run(batch):
        batch = {k: torch.from_numpy(v).long().to(device) for k, v in batch.items()}
        with autocast:
            logits = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
        )
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if xla:
            torch_xla.sync()
        return float(loss.item())

    times, losses = timed_loop(run, batches)
    profile_steps = 0 if xla else spec["profile_steps"]
    extra = {"profile": profiled(run, batches, profile_steps, torch_trace)} if profile_steps else {}
    versions = (
        {"torch (.venv-xla)": torch.__version__, "torch_xla": torch_xla.__version__}
        if xla
        else {"torch": torch.__version__, **({"CUDA (torch)": torch.version.cuda} if device.type == "cuda" else {})}
    )
    tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32  # off by default: f32 products in f32
    return dict(
        times=times,
        losses=losses,
        num_params=int(sum(p.numel() for p in model.parameters())),
        versions=versions,
        threads=torch.get_num_threads(),
        products="bf16" if spec["precision"] == "bf16" else "tf32" if tf32 else "fp32",
        device_peak_mb=torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        **extra,
    )


def worker_tf(spec, batches):
    import tensorflow as tf
    from transformers import TFAutoModelForMaskedLM, create_optimizer
    from transformers.modeling_tf_utils import keras

    if spec["precision"] == "bf16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = TFAutoModelForMaskedLM.from_pretrained(os.path.join(spec["init_dir"], "tensorflow"))
    total = batches["input_ids"].shape[0]
    warmup, _ = learning_rates(total)
    # As tensorflow/run_mlm.py: AdamWeightDecay, warm-up then linear decay, no decay on LayerNorm/bias.
    optimizer, _ = create_optimizer(
        init_lr=LEARNING_RATE,
        num_train_steps=total,
        num_warmup_steps=warmup,
        weight_decay_rate=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
    )

    @tf.function(jit_compile=spec["mode"] == "tf_xla")
    def train_step(input_ids, attention_mask, labels):
        with tf.GradientTape() as tape:
            logits = tf.cast(
                model(input_ids=input_ids, attention_mask=attention_mask, training=True).logits, tf.float32
            )
            mask = labels != -100
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.where(mask, labels, 0), logits)
            loss = tf.reduce_sum(tf.where(mask, losses, 0.0)) / tf.maximum(
                tf.reduce_sum(tf.cast(mask, tf.float32)), 1.0
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def run(batch):
        return float(train_step(*(tf.constant(batch[k]) for k in ("input_ids", "attention_mask", "labels"))).numpy())

    times, losses = timed_loop(run, batches)
    return dict(
        times=times, losses=losses, num_params=int(model.count_params()), versions={"tensorflow": tf.__version__}
    )


def matmul_worker(spec):
    """GFLOP/s of an n x n matrix product in one framework, in each of spec's precisions, from the fastest of
    `reps` timed calls (a peak: interference from elsewhere on the machine only ever slows a call down)."""
    n, reps, framework = spec["n"], spec["reps"], spec["framework"]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    out = {}
    for precision in spec["precisions"]:
        if framework == "torch":
            import torch

            dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            device = "cuda" if torch.cuda.is_available() else "cpu"
            x, y = torch.from_numpy(a).to(device, dtype), torch.from_numpy(b).to(device, dtype)
            sync = torch.cuda.synchronize if device == "cuda" else lambda: None
            call = lambda x=x, y=y, sync=sync: (torch.mm(x, y), sync())  # noqa: E731
        elif framework == "jax":
            import jax
            import jax.numpy as jnp

            dtype = jnp.float32 if precision == "fp32" else jnp.bfloat16
            x, y = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
            # bf16 x bf16 -> f32, the product flax_bf16 computes (XLA:CPU's bf16 -> bf16 product is slower than f32)
            f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
            call = lambda f=f, x=x, y=y: f(x, y).block_until_ready()  # noqa: E731
        else:
            import tensorflow as tf

            dtype = tf.float32 if precision == "fp32" else tf.bfloat16
            x, y = tf.cast(tf.constant(a), dtype), tf.cast(tf.constant(b), dtype)
            call = lambda x=x, y=y: tf.linalg.matmul(x, y).numpy()  # noqa: E731
        call()
        call()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[precision] = 2 * n**3 / min(times) / 1e9
    return out


def init_worker(spec):
    """The shared initial weights: a PyTorch RoBERTa from the config with seed 0, also saved in Flax's and (where a
    mode needs it) TF's formats, so each training worker loads its own format and imports no other framework."""
    import torch
    import transformers

    torch.manual_seed(0)
    pt_dir = os.path.join(spec["init_dir"], "pytorch")
    config = transformers.AutoConfig.from_pretrained(spec["config_dir"])
    transformers.AutoModelForMaskedLM.from_config(config).save_pretrained(pt_dir)
    for framework, auto in (("flax", "FlaxAutoModelForMaskedLM"), ("tensorflow", "TFAutoModelForMaskedLM")):
        if framework in spec["frameworks"]:
            model = getattr(transformers, auto).from_pretrained(pt_dir, from_pt=True)
            model.save_pretrained(os.path.join(spec["init_dir"], framework))
    return {}


def worker_main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    kind = spec["kind"]
    if kind == "matmul":
        result = matmul_worker(spec)
    elif kind == "init":
        result = init_worker(spec)
    else:
        with np.load(spec["batches"]) as data:
            batches = {k: data[k] for k in data.files}
        start = time.perf_counter()
        worker = {"flax": worker_flax, "pytorch": worker_torch, "pytorch/xla": worker_torch, "tensorflow": worker_tf}[
            MODES[spec["mode"]][0]
        ]
        result = worker(spec, batches)
        result["wall_s"] = time.perf_counter() - start
        result["data_sha256"] = data_digest(batches)
        result["batch_shape"] = list(batches["input_ids"].shape[1:])
        result["config"] = json.loads(Path(spec["config_dir"], "config.json").read_text())
    result["peak_rss_mb"] = peak_rss_mb()
    print("BENCHMARK_RESULT " + json.dumps(result))


# --- the harness ------------------------------------------------------------------------------------


def run_worker(spec, work_dir, python=sys.executable, env=None, timeout=3600):
    """Run one worker process; return its result dict, or {"error": last line of its output}."""
    path = Path(work_dir) / f"spec-{spec.get('mode', spec['kind'])}-{spec.get('framework', '')}.json"
    path.write_text(json.dumps(spec))
    full_env = {k: v for k, v in os.environ.items() if k not in ("USE_TF", "USE_TORCH", "USE_FLAX")}
    framework = MODES[spec["mode"]][0] if "mode" in spec else None
    # Keep transformers from importing the other frameworks (time, and memory in the peak RSS).
    hidden = {"flax": ("USE_TF", "USE_TORCH"), "tensorflow": ("USE_TORCH", "USE_FLAX")}.get(
        framework, ("USE_TF", "USE_FLAX")
    )
    if spec["kind"] != "init":
        full_env.update({name: "0" for name in hidden})
    full_env.update({"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    try:
        proc = subprocess.run(
            [python, str(Path(__file__).resolve()), "--worker", str(path)],
            cwd=ROOT,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("BENCHMARK_RESULT "):
            return json.loads(line[len("BENCHMARK_RESULT ") :])
    lines = [line for line in (proc.stderr + proc.stdout).strip().splitlines() if line.strip()]
    return {"error": lines[-1][:300] if lines else f"exit {proc.returncode}", "log_tail": "\n".join(lines[-30:])}


def run_tool(args, what):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        fail(f"{what} failed: {lines[-1] if lines else proc.returncode}")


def prepare_files(work, args, size):
    """Corpus, tokenizer (cached in the work folder) and the size's config (dropout 0)."""
    corpus, tok = work / "ptb", work / "tokenizer"
    if not (corpus / "train.txt").is_file():
        run_tool(["tokenizers/prepare_corpus.py", "--corpus", "ptb", "--output_dir", str(corpus)], "prepare_corpus.py")
    if not (tok / "tokenizer.json").is_file():
        run_tool(
            [
                "tokenizers/train_tokenizer.py",
                "--train_file",
                str(corpus / "train.txt"),
                "--vocab_size",
                "8192",
                "--min_frequency",
                "2",
                "--output_dir",
                str(tok),
                "--overwrite_output_dir",
            ],
            "train_tokenizer.py",
        )
    config_dir = work / f"config-{args.size}"
    overrides = ",".join(
        f"{k}={size[k]}"
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    )
    run_tool(
        [
            "tokenizers/create_config.py",
            "--model_type",
            "roberta",
            "--tokenizer_name",
            str(tok),
            "--output_dir",
            str(config_dir),
            "--overwrite_output_dir",
            "--config_overrides",
            overrides + ",hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0",
        ],
        "create_config.py",
    )
    return corpus, tok, config_dir


def prepare_data(work, args, size, bar):
    """The files, preprocessing throughput, then the pre-masked batches."""
    corpus, tok, config_dir = prepare_files(work, args, size)
    bar.update(1)

    # Preprocessing throughput: tokenize, then group with the linear-time group_texts and with upstream's sum(lists, []).
    from datasets import Dataset, disable_progress_bars
    from transformers import AutoTokenizer

    disable_progress_bars()
    mlm = load_script("flax/run_mlm_flax.py")
    tokenizer = AutoTokenizer.from_pretrained(str(tok))
    lines = [line for line in (corpus / "train.txt").read_text().splitlines() if line.strip()][: args.preprocess_lines]
    dataset = Dataset.from_dict({"text": lines})
    start = time.perf_counter()
    tokenized = dataset.map(
        lambda b: tokenizer(b["text"], return_special_tokens_mask=True), batched=True, remove_columns=["text"]
    )
    tokenize_s = time.perf_counter() - start
    num_tokens = sum(len(x) for x in tokenized["input_ids"])

    def group_with_sum(examples, block_size):
        concatenated = {k: sum(examples[k], []) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        return {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}

    group_s = {}
    for name, fn in (("group_texts (linear)", mlm.group_texts), ("sum(lists, []) (upstream)", group_with_sum)):
        start = time.perf_counter()
        grouped = tokenized.map(fn, fn_kwargs={"block_size": size["seq_len"]}, batched=True, batch_size=1000)
        group_s[name] = time.perf_counter() - start
    preprocessing = {
        "lines": len(lines),
        "tokens": num_tokens,
        "tokenize_s": tokenize_s,
        "tokenize_tokens_per_s": num_tokens / tokenize_s,
        "group": {name: {"seconds": s, "tokens_per_s": num_tokens / s} for name, s in group_s.items()},
    }
    bar.update(1)

    # The batches every mode trains on: a seeded permutation of the blocks, masked by the Flax script's collator.
    steps, batch_size = args.steps, size["batch_size"]
    if len(grouped) < steps * batch_size:
        fail(
            f"{len(grouped)} blocks of {size['seq_len']} tokens are fewer than --steps x batch ({steps * batch_size}); "
            "raise --preprocess_lines or lower --steps"
        )
    order = np.random.default_rng(args.seed).permutation(len(grouped))[: steps * batch_size]
    collator = mlm.FlaxDataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=MLM_PROBABILITY)
    columns = {k: [] for k in ("input_ids", "attention_mask", "labels")}
    for step in range(steps):
        row_ids = order[step * batch_size : (step + 1) * batch_size]
        rows = grouped.select(row_ids)
        batch = collator(
            {k: rows[k] for k in ("input_ids", "attention_mask", "special_tokens_mask")},
            (args.seed,),
            row_ids,
            row_width=size["seq_len"],
        )
        for k in columns:
            columns[k].append(batch[k].astype(np.int32))
    batches_path = work / f"batches-{args.size}.npz"
    np.savez(batches_path, **{k: np.stack(v) for k, v in columns.items()})
    return config_dir, batches_path, preprocessing


def gpu_info():
    """The machine's first NVIDIA GPU by nvidia-smi ({name, driver, memory, count}), or None."""
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not lines:
        return None
    name, driver, memory = (field.strip() for field in lines[0].split(","))
    return {"name": name, "driver": driver, "memory": memory, "count": len(lines)}


def machine_info(gpu):
    cpu, bf16 = cpu_bf16()
    return {
        "cpu": cpu,
        "bf16": bf16,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": gpu,
    }


def hardware(machine):
    """The machine in words, for titles: the GPU (with its host) or the CPU."""
    cpu = f"{machine['cpu']} (bf16: {machine['bf16']}), {machine['cores']} cores"
    gpu = machine.get("gpu")
    return f"{gpu['name']} (driver {gpu['driver']}, {gpu['memory']}); host: {cpu}" if gpu else cpu


def gpu_peaks(gpu):
    """The GPU's published dense peaks in GFLOP/s by precision ({} for a GPU not in GPU_PEAKS, or none)."""
    name = next((n for n in GPU_PEAKS if gpu and n in gpu["name"]), None)
    return {k: 1000 * v for k, v in GPU_PEAKS[name].items()} if name else {}


def rounds(modes, repeats):
    """The order the modes run in: interleaved rounds (A B C A B C), so that drift hits all alike."""
    return [[r, name] for r in range(repeats) for name in modes]


def summarize(name, results, flops, peaks, warmup_steps, size):
    """One mode's row from its repeats: the median over repeats of each repeat's median step, with the range."""
    framework, precision, what = MODES[name]
    row = {"mode": name, "framework": framework, "precision": precision, "what": what}
    failed = next((r for r in results if "error" in r or "skipped" in r), None)
    if failed is not None:
        return {**row, **failed}
    # against the peak of the precision the products ran in (no bf16 peak: bf16 runs in f32)
    peak = peaks.get(results[0].get("products", precision)) or peaks.get(precision, peaks["fp32"])
    bf16_peak = peaks.get("bf16", peaks["fp32"])
    by_repeat = [1000 * float(np.median(r["times"][warmup_steps:])) for r in results]
    timed = 1000 * np.concatenate([r["times"][warmup_steps:] for r in results])
    step_s = float(np.median(by_repeat)) / 1000
    achieved = flops / step_s / 1e9
    row.update({k: v for k, v in results[0].items() if k != "times"})
    row.update(
        repeats=len(results),
        step_ms_by_repeat=by_repeat,
        times_by_repeat=[r["times"] for r in results],
        first_step_s=float(np.median([r["times"][0] for r in results])),
        step_ms=1000 * step_s,
        step_ms_range=[min(by_repeat), max(by_repeat)],
        step_ms_quartiles=[float(np.percentile(timed, 25)), float(np.percentile(timed, 75))],
        timed_steps=len(timed),
        peak_rss_mb=max(r["peak_rss_mb"] for r in results),
        device_peak_mb=max(r.get("device_peak_mb") or 0 for r in results) or None,
        tokens_per_s=size["batch_size"] * size["seq_len"] / step_s,
        gflops=achieved,
        mfu=achieved / peak,
        mfu_vs_bf16_peak=achieved / bf16_peak,
        final_loss=results[0]["losses"][-1],
    )
    return row


def per_round(a, b):
    """a's step time over b's, round by round: 'median [min-max]'."""
    ratios = [x / y for x, y in zip(a["step_ms_by_repeat"], b["step_ms_by_repeat"], strict=True)]
    return f"{np.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def write_outputs(out, report, stem="results"):
    """STEM.json, STEM.md (the tables) and STEM.png (the bar charts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    lines = modes_table(report) + other_tables(report)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot_modes(plt, out / f"{stem}.png", report)


def modes_table(report):
    """results.md's title, the run's setting and the table of the modes: its lines."""
    rows = report["modes"]
    w = report["workload"]
    lines = [
        f"# MLM training benchmark: RoBERTa {w['size']} ({w['num_params'] / 1e6:.2f} M parameters), batch {w['batch_size']} x {w['seq_len']} tokens",
        "",
        *([f"**Partial: {report['partial']}.**", ""] if "partial" in report else []),
        f"{hardware(report['machine'])}; {report['date']}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(report["versions"].items()))
        + ".",
        f"Command: `{report['command']}`."
        + (f" Flax modes ran with XLA_FLAGS=`{report['xla_flags']}`." if report["xla_flags"] else "")
        + f" {w['steps']} steps per mode, the first {w['warmup_steps']} untimed; step time is the "
        f"median of the other {w['steps'] - w['warmup_steps']}. Model FLOPs per step: {w['flops_per_step'] / 1e9:.1f} GFLOP. "
        + peaks_sentence(report),
        "",
        f"Every mode ran {w['repeats']} time{'s' * (w['repeats'] != 1)}, interleaved (A B C A B C ...); step (ms) is the "
        "median over the repeats, with their range, then the quartiles of all timed steps [25 %-75 %]. Peak device "
        "memory: JAX's peak_bytes_in_use, torch's max_memory_allocated (GPU only).",
        "",
        "| mode | precision | how | first step (s) | step (ms), median (min-max) [quartiles] | tokens/s | GFLOP/s | MFU "
        "| MFU vs bf16 peak | peak RSS (MB) | peak device memory (MB) | loss after last step |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "step_ms" in r:
            products = f" ({r['products']} products)" if r.get("products", r["precision"]) != r["precision"] else ""
            device = f"{r['device_peak_mb']:,.0f}" if r.get("device_peak_mb") else "-"
            lines.append(
                f"| {r['mode']} | {r['precision']}{products} | {r['what']} | {r['first_step_s']:.2f} | "
                f"{r['step_ms']:,.1f} ({r['step_ms_range'][0]:,.1f}-{r['step_ms_range'][1]:,.1f}) "
                f"[{r['step_ms_quartiles'][0]:,.1f}-{r['step_ms_quartiles'][1]:,.1f}] | "
                f"{r['tokens_per_s']:,.0f} | {r['gflops']:.1f} | {100 * r['mfu']:.1f} % | {100 * r['mfu_vs_bf16_peak']:.1f} % | "
                f"{r['peak_rss_mb']:,.0f} | {device} | {r['final_loss']:.4f} |"
            )
        else:
            lines.append(
                f"| {r['mode']} | {r['precision']} | {r['what']} | {'skipped: ' + r['skipped'] if 'skipped' in r else 'failed: ' + r['error']} |"
                + " |" * 8
            )
    return lines


def peaks_sentence(report):
    """What MFU is measured against: the GPU's published peaks, or the matrix-product peak measured in this run."""
    peak, published = report["matmul"]["peak"], report["matmul"].get("published")
    if published:
        return (
            "MFU against the GPU's published dense peak for the precision of the row's products: "
            + ", ".join(f"{k} {v / 1000:.1f} TFLOP/s" for k, v in published.items())
            + "."
        )
    return (
        f"Matrix-multiply peak measured in this run ({report['matmul']['n']}², best framework): fp32 "
        f"{peak['fp32']:.0f} GFLOP/s, bf16 "
        + (
            f"{peak['bf16']:.0f} GFLOP/s."
            if "bf16" in peak
            else "not measured (no bf16 instructions: bf16 modes are measured against the fp32 peak)."
        )
    )


def other_tables(report):
    """results.md after the modes: the goals, the matrix-multiply peaks, preprocessing and inference; its lines."""
    lines = ["", "## Goals", ""]
    for goal in report["goals"]:
        lines.append(f"- {goal}")
    lines += ["", "## Matrix multiply (GFLOP/s)", "", "| framework | fp32 | bf16 |", "| --- | ---: | ---: |"]
    for fw, v in report["matmul"]["frameworks"].items():
        lines.append(
            f"| {fw} | {v['fp32']:.0f} | {v['bf16']:.0f} |"
            if "bf16" in v
            else f"| {fw} | {v['fp32']:.0f} | not measured |"
            if "fp32" in v
            else f"| {fw} | failed: {v.get('error')} | |"
        )
    p = report["preprocessing"]
    lines += [
        "",
        f"## Preprocessing ({p['lines']:,} PTB lines, {p['tokens']:,} tokens)",
        "",
        "| stage | seconds | tokens/s |",
        "| --- | ---: | ---: |",
        f"| tokenize | {p['tokenize_s']:.2f} | {p['tokenize_tokens_per_s']:,.0f} |",
    ]
    for name, g in p["group"].items():
        lines.append(f"| group: {name} | {g['seconds']:.2f} | {g['tokens_per_s']:,.0f} |")
    lines += profile_table(report["modes"])
    inference = report.get("inference") or {}
    if inference:
        lines += [
            "",
            f"## Inference: flax/run_bert_flax.py ({inference.get('setup', '')})",
            "",
            "| precision | median call (s) | examples/s |",
            "| --- | ---: | ---: |",
        ]
        for precision in ("float32", "bfloat16"):
            r = inference.get(precision, {})
            lines.append(
                f"| {precision} | {r['median_s']:.3f} | {r['examples_per_second']:.1f} |"
                if "median_s" in r
                else f"| {precision} | skipped: {r['skipped']} | |"
                if "skipped" in r
                else f"| {precision} | failed: {r.get('error')} | |"
            )
    return lines


def profile_parts(profile):
    """A profiled step's parts, ms: the host's share (wall minus the device's busy time), then the kernel groups."""
    return {"host (wall - busy)": profile["wall_ms"] - profile["busy_ms"], **profile["groups_ms"]}


def profile_table(rows):
    """results.md's profile of the modes run with --profile_steps: where a step's time goes; its lines."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return []
    lines = [
        "",
        "## Where a profiled step's time goes (ms a step; --profile_steps more steps, after the timed ones)",
        "",
        "| mode | read | step wall | device busy | kernels a step | " + " | ".join(KERNEL_GROUPS) + " | other "
        "| top kernels |",
        "| --- | --- | ---: | ---: | ---: |" + " ---: |" * (len(KERNEL_GROUPS) + 1) + " --- |",
    ]
    for r in profiled:
        p = r["profile"]
        if "error" in p:
            lines.append(f"| {r['mode']} | failed: {p['error']} |" + " |" * (len(KERNEL_GROUPS) + 5))
            continue
        top = "; ".join(f"{name[:60]} {ms:.2f}" for name, ms, _ in p["top"][:3])
        lines.append(
            f"| {r['mode']} | {p['source']} | {p['wall_ms']:,.2f} | {p['busy_ms']:,.2f} | {p['kernels_per_step']:,.0f} | "
            + " | ".join(f"{ms:,.2f}" for ms in p["groups_ms"].values())
            + f" | {top} |"
        )
    return lines


def plot_modes(plt, path, report):
    """results.png: tokens/s and MFU of the modes that ran, with their range over the repeats."""
    ok = [r for r in report["modes"] if "step_ms" in r]
    w = report["workload"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["mode"] for r in ok]
    colors = [
        "tab:blue"
        if r["framework"] == "flax"
        else "tab:orange"
        if r["framework"].startswith("pytorch")
        else "tab:green"
        for r in ok
    ]
    tokens = w["batch_size"] * w["seq_len"] * 1000
    spread = np.array(
        [
            [r["tokens_per_s"] - tokens / r["step_ms_range"][1], tokens / r["step_ms_range"][0] - r["tokens_per_s"]]
            for r in ok
        ]
    ).T
    axes[0].bar(names, [r["tokens_per_s"] for r in ok], yerr=spread, capsize=3, color=colors)
    axes[0].set_ylabel(f"training tokens/s (median, min-max of {w['repeats']})")
    axes[1].bar(
        names,
        [100 * r["mfu"] for r in ok],
        yerr=spread * np.array([[100 * r["mfu"] / r["tokens_per_s"] for r in ok]]),
        capsize=3,
        color=colors,
    )
    axes[1].set_ylabel("MFU, % of matmul peak (same precision)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_ha("right")
    fig.suptitle(f"RoBERTa {w['size']} MLM, batch {w['batch_size']} x {w['seq_len']}, {hardware(report['machine'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MEMORY = {"device_peak_mb": "peak device memory", "peak_rss_mb": "peak RSS"}


def goals(rows, peaks, machine):
    ok = {r["mode"]: r for r in rows if "step_ms" in r}
    gpu = machine.get("gpu")
    out = [
        f"These ratios hold for this GPU ({gpu['name']}, driver {gpu['driver']}) and the {len(ok)} modes that ran "
        f"({', '.join(ok) or 'none'})"
        if gpu
        else f"These ratios hold for this CPU class ({machine['cpu']}, bf16: {machine['bf16']}) and the {len(ok)} modes that ran "
        f"({', '.join(ok) or 'none'}); CPUs with other bf16 support give other ratios."
    ]
    peak_name = "bf16" if "bf16" in peaks else "fp32"
    ours, upstream = ok.get("flax_bf16"), ok.get("flax_model_bf16")
    if ours and upstream:
        memory = "device_peak_mb" if gpu else "peak_rss_mb"
        out.append(
            f"Our --dtype bfloat16 (flax_bf16) vs upstream's meaning, the model's dtype (flax_model_bf16): step "
            f"{per_round(ours, upstream)}, {MEMORY[memory]} {ours[memory]:,.0f} / {upstream[memory]:,.0f} MB "
            "(goal: no slower, no larger: <= 1.0x both)"
        )
    flax_best = min((r for r in ok.values() if r["framework"] == "flax"), key=lambda r: r["step_ms"], default=None)
    others = [r for r in ok.values() if r["framework"] != "flax"]
    if flax_best and others:
        fastest = min(others, key=lambda r: r["step_ms"])
        each = ", ".join(f"{r['mode']} {per_round(r, flax_best)}" for r in others)
        out.append(
            f"Flax's fastest mode ({flax_best['mode']}, {flax_best['step_ms']:.1f} ms) vs the fastest other mode "
            f"({fastest['mode']}, {fastest['step_ms']:.1f} ms): {per_round(fastest, flax_best)} as fast, per round, median "
            "[min-max] (goal >= 1.0x)" + (f"; each other mode: {each}" if len(others) > 1 else "")
        )
        out.append(
            f"Flax ({flax_best['mode']}) vs the {peak_name} "
            + (
                f"published peak ({peaks[peak_name] / 1000:.1f} TFLOP/s): "
                if gpu
                else f"matmul peak ({peaks[peak_name]:.0f} GFLOP/s): "
            )
            + f"{100 * flax_best['gflops'] / peaks[peak_name]:.1f} % (goal >= {50 if gpu else 60} %)"
        )
        profiles = [r.get("profile", {}) for r in (flax_best, fastest)]
        if flax_best["step_ms"] > fastest["step_ms"] and all("busy_ms" in p for p in profiles):
            parts = [profile_parts(p) for p in profiles]
            worst = max(parts[0], key=lambda k: parts[0][k] - parts[1][k])
            out.append(
                f"Where Flax's time goes, per profiled step ({flax_best['mode']} vs {fastest['mode']}, ms): "
                + ", ".join(f"{k} {parts[0][k]:.2f} vs {parts[1][k]:.2f}" for k in parts[0])
                + f"; the most Flax loses: {worst}, {parts[0][worst] - parts[1][worst]:.2f} ms"
            )
        torch_modes = [r for r in others if r["framework"].startswith("pytorch")]
        if torch_modes:
            torch_fastest = min(torch_modes, key=lambda r: r["step_ms"])
            memory = "device_peak_mb" if gpu else "peak_rss_mb"
            out.append(
                f"Flax {MEMORY[memory]} vs PyTorch's fastest mode ({torch_fastest['mode']}): {flax_best[memory]:,.0f} / "
                f"{torch_fastest[memory]:,.0f} MB = {flax_best[memory] / torch_fastest[memory]:.2f}x (goal <= 1.0x)"
            )
    reference = ok.get("torch") or ok.get("flax")
    if reference:
        worst = max(ok.values(), key=lambda r: abs(r["final_loss"] - reference["final_loss"]))
        out.append(
            f"Same work: loss after the last step differs from {reference['mode']}'s ({reference['final_loss']:.4f}) by at most "
            f"{abs(worst['final_loss'] - reference['final_loss']):.4f} ({worst['mode']})"
        )
    out.append("MFU: " + ", ".join(f"{r['mode']} {100 * r['mfu']:.1f} %" for r in ok.values()))
    return out


# --- end to end: the real scripts -------------------------------------------------------------------

# name: (framework, precision, script and flags beyond the shared ones)
E2E_MODES = {
    "flax": ("flax", "fp32", ["flax/run_mlm_flax.py", "--model_type", "roberta"]),
    "flax_bf16": ("flax", "bf16", ["flax/run_mlm_flax.py", "--model_type", "roberta", "--dtype", "bfloat16"]),
    "torch": ("pytorch", "fp32", ["pytorch/run_mlm.py"]),
    "torch_bf16": ("pytorch", "bf16", ["pytorch/run_mlm.py", "--bf16"]),
    "torch_xla": ("pytorch/xla", "fp32", ["pytorch/xla_spawn.py", "--num_cores", "1", "pytorch/run_mlm.py"]),
    "tf": ("tensorflow", "fp32", ["tensorflow/run_mlm.py"]),
    "tf_bf16": ("tensorflow", "bf16", ["tensorflow/run_mlm.py", "--bfloat16"]),
}


def run_measured(commands, env, log_path):
    """Run commands one after the other as a user would; return (exit code, wall seconds in all, peak RSS in MB of the
    largest process, from wait4)."""
    started, peak = time.perf_counter(), 0.0
    with open(log_path, "w") as log:
        for argv in commands:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            peak = max(peak, usage.ru_maxrss / 1024)
            if os.waitstatus_to_exitcode(status) != 0:
                return os.waitstatus_to_exitcode(status), time.perf_counter() - started, peak
    return 0, time.perf_counter() - started, peak


def eval_curve(output_dir, launched):
    """(step, eval loss, seconds since launch) of every evaluation the script logged to TensorBoard (as scalars, or as
    tf.summary's scalar tensors)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    points = {}
    for events in Path(output_dir, "runs").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
        accumulator.Reload()
        tags = accumulator.Tags()
        if "eval/loss" in tags["scalars"]:
            points.update(
                {e.step: (e.step, e.value, e.wall_time - launched) for e in accumulator.Scalars("eval/loss")}
            )
        if "eval/loss" in tags["tensors"]:
            points.update(
                {
                    e.step: (e.step, float(make_ndarray(e.tensor_proto)), e.wall_time - launched)
                    for e in accumulator.Tensors("eval/loss")
                }
            )
    return [points[step] for step in sorted(points)]


def e2e_commands(name, args, files, size, out):
    """The commands of one mode, as a user would type them after `python`: the script with the shared settings, after
    TensorFlow's TFRecord shards of the same text."""
    framework, _, script = E2E_MODES[name]
    common = {
        "--learning_rate": files["learning_rate"],
        "--warmup_steps": args.steps // 10,
        "--max_steps": args.steps,
        "--eval_steps": args.eval_steps,
        "--seed": args.seed,
        "--output_dir": out,
    }
    if framework == "tensorflow":
        shards = out.parent / f"{name}-shards"
        prepare = [
            [
                "tensorflow/prepare_tfrecord_shards.py",
                "--tokenizer_name_or_path",
                files["tokenizer"],
                "--train_file",
                files[split],
                "--split",
                split,
                "--max_length",
                size["seq_len"],
                "--output_dir",
                shards,
                "--overwrite_output_dir",
            ]
            for split in ("train", "validation")
        ]
        flags = {
            **common,
            "--model_name_or_path": files["init"] / "tensorflow",
            "--tokenizer": files["tokenizer"],
            "--train_dataset": shards / "train",
            "--eval_dataset": shards / "validation",
            "--max_length": size["seq_len"],
            "--per_replica_batch_size": size["batch_size"],
            "--weight_decay_rate": WEIGHT_DECAY,
        }
        # The other scripts repeat a seeded run exactly by default; TF's input pipeline needs the flag.
        commands = [
            *prepare,
            [*script, *(x for kv in flags.items() for x in kv), "--overwrite_output_dir", "--full_determinism"],
        ]
    else:
        flags = {
            **common,
            "--model_name_or_path": files["init"] / ("flax" if framework == "flax" else "pytorch"),
            "--tokenizer_name": files["tokenizer"],
            "--train_file": files["train"],
            "--validation_file": files["validation"],
            "--max_seq_length": size["seq_len"],
            "--per_device_train_batch_size": size["batch_size"],
            "--per_device_eval_batch_size": size["batch_size"],
            "--weight_decay": WEIGHT_DECAY,
            "--logging_steps": args.eval_steps,
            "--report_to": "tensorboard",
        }
        # The Trainer clips gradients at norm 1.0 by default; the Flax and TF scripts do not clip, so neither does it here.
        flags.update(
            {"--save_steps": 10 * args.steps}
            if framework == "flax"
            else {"--eval_strategy": "steps", "--save_strategy": "no", "--max_grad_norm": 0}
        )
        commands = [
            [*script, *(x for kv in flags.items() for x in kv), "--overwrite_output_dir", "--do_train", "--do_eval"]
        ]
    return [[str(x) for x in argv] for argv in commands]


def end_to_end_mode(name, args, files, size, work):
    """Run one framework's script on the shared corpus, tokenizer, initial weights and schedule; its row."""
    framework, precision, _ = E2E_MODES[name]
    row = {"mode": name, "framework": framework, "precision": precision}
    if name in args.skipped:
        return {**row, "skipped": args.skipped[name]}
    python, env = sys.executable, {k: v for k, v in os.environ.items() if k not in ("USE_TF", "USE_TORCH", "USE_FLAX")}
    if name == "torch_xla":
        if not os.path.exists(args.xla_python):
            return {**row, "skipped": f"no PyTorch/XLA environment at {args.xla_python} (bash run.sh setup-xla)"}
        python, env = args.xla_python, {**env, "PJRT_DEVICE": "CPU"}
    out = work / "e2e" / name
    commands = e2e_commands(name, args, files, size, out)
    launched = time.time()
    code, wall, rss = run_measured([[python, *argv] for argv in commands], env, work / "e2e" / f"{name}.log")
    if code != 0:
        lines = [line for line in (work / "e2e" / f"{name}.log").read_text().splitlines() if line.strip()]
        return {**row, "error": lines[-1][:300] if lines else f"exit {code}"}
    train = json.loads((out / "train_results.json").read_text())
    evaluation = json.loads((out / "eval_results.json").read_text())
    return {
        **row,
        "command": " && ".join(" ".join(["python", *argv]) for argv in commands),
        "wall_s": wall,
        "peak_rss_mb": rss,
        "train_s": train["train_runtime"],
        "tokens_per_s": args.steps * size["batch_size"] * size["seq_len"] / train["train_runtime"],
        "eval_loss": evaluation["eval_loss"],
        "eval_accuracy": evaluation["eval_accuracy"],
        "curve": eval_curve(out, launched),
    }


def end_to_end(args, work, size, config_dir, bar):
    """Every framework's real script, the same work: the report of --end_to_end."""
    corpus, tokenizer = work / "ptb", work / "tokenizer"
    files = {
        "tokenizer": tokenizer,
        "init": work / f"init-{args.size}",
        "train": work / "e2e" / "train.txt",
        "validation": work / "e2e" / "validation.txt",
        "learning_rate": 2e-3 if args.size == "tiny" else LEARNING_RATE,
    }
    files["train"].parent.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", args.preprocess_lines), ("validation", max(args.preprocess_lines // 10, 200))):
        text = (corpus / f"{split}.txt").read_text().splitlines(keepends=True)
        files[split].write_text("".join(text[:lines]))
    make_initial_weights(config_dir, files["init"], sorted({E2E_MODES[m][0] for m in args.modes_e2e}), work, bar)
    rows = []
    for name in args.modes_e2e:
        bar.set_postfix_str(name)
        rows.append(end_to_end_mode(name, args, files, size, work))
        bar.update(1)
    ran = [r for r in rows if "eval_loss" in r]
    target = args.target_loss if args.target_loss is not None else max((r["eval_loss"] for r in ran), default=None)
    for r in ran:
        # TensorBoard keeps float32: the mode that set the target reaches it within that rounding
        r["time_to_target_s"] = next((seconds for _, loss, seconds in r["curve"] if loss <= target * (1 + 1e-6)), None)
    curves = [{step: loss for step, loss, _ in r["curve"]} for r in ran]
    common = set.intersection(*map(set, curves)) if curves else set()
    gaps = [(max(c[step] for c in curves) - min(c[step] for c in curves), step) for step in sorted(common)]
    from safetensors.numpy import load_file

    num_params = sum(a.size for a in load_file(files["init"] / "pytorch" / "model.safetensors").values())
    return {
        "modes": rows,
        "target_loss": target,
        "parity_gap": max(gaps, default=None),
        "learning_rate": files["learning_rate"],
        "num_params": num_params,
        "files": {k: str(v) for k, v in files.items()},
    }


def minutes(seconds):
    return (
        f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
        if seconds >= 3600
        else f"{int(seconds // 60)}m{seconds % 60:04.1f}s"
    )


def write_end_to_end(out, report):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "results.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    e2e, w = report["end_to_end"], report["workload"]
    rows, ran = e2e["modes"], [r for r in e2e["modes"] if "eval_loss" in r]
    cell = {
        r["mode"]: minutes(r["wall_s"]) if "wall_s" in r else ("skipped" if "skipped" in r else "failed") for r in rows
    }
    lines = [
        f"# MLM end to end: the real scripts, RoBERTa {w['size']} ({w['num_params'] / 1e6:.2f} M parameters)",
        "",
        f"{report['machine']['cpu']} (bf16: {report['machine']['bf16']}), {report['machine']['cores']} cores; {report['date']}. "
        f"Command: `{report['command']}`. "
        f"{w['steps']} steps of {w['batch_size']} x {w['seq_len']} tokens, learning rate {w['learning_rate']} after "
        f"{w['steps'] // 10} warm-up steps with linear decay, no gradient clipping, the same initial weights, tokenizer, text and held-out blocks; "
        f"evaluation every {w['eval_steps']} steps. Wall time of each whole command:",
        "",
        "| task | " + " | ".join(cell) + " |",
        "| --- |" + " ---: |" * len(cell),
        "| MLM | " + " | ".join(cell.values()) + " |",
        "",
        "| mode | wall time | training (s) | tokens/s | eval loss | eval accuracy | time to target (s) | peak RSS (MB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "eval_loss" in r:
            reached = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "not reached"
            lines.append(
                f"| {r['mode']} | {minutes(r['wall_s'])} | {r['train_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['eval_loss']:.4f} | "
                f"{100 * r['eval_accuracy']:.2f} % | {reached} | {r['peak_rss_mb']:,.0f} |"
            )
        else:
            lines.append(
                f"| {r['mode']} | {'skipped: ' + r['skipped'] if 'skipped' in r else 'failed: ' + r['error']} |"
                + " |" * 6
            )
    lines += [
        "",
        f"Target eval loss: {e2e['target_loss']:.4f}"
        + (" (given)" if report["target_given"] else " (the worst final eval loss)")
        if e2e["target_loss"] is not None
        else "No mode finished.",
    ]
    if e2e["parity_gap"]:
        lines.append(
            f"Largest gap between the eval-loss curves at a common step: {e2e['parity_gap'][0]:.4f} (step {e2e['parity_gap'][1]}); "
            "each script masks with its own random draws, so the curves agree to that noise, not bitwise."
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ran:
        steps, losses, seconds = zip(*r["curve"], strict=True) if r["curve"] else ((), (), ())
        axes[0].plot(steps, losses, marker="o", label=r["mode"])
        axes[1].plot(seconds, losses, marker="o", label=r["mode"])
    for ax, xlabel in zip(axes, ("step", "seconds since launch"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss")
        ax.legend()
    fig.suptitle(f"RoBERTa {w['size']} MLM end to end, {report['machine']['cpu']}")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)


def run_end_to_end(args, out, work, size, argv):
    from tqdm import tqdm

    started = time.perf_counter()
    bar = tqdm(total=2 + len(args.modes_e2e), desc="end to end", unit="task")
    bar.set_postfix_str("corpus, tokenizer, config")
    _, _, config_dir = prepare_files(work, args, size)
    bar.update(1)
    e2e = end_to_end(args, work, size, config_dir, bar)
    bar.close()
    config = json.loads((config_dir / "config.json").read_text())
    report = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": machine_info(args.gpu),
        "command": "python benchmarks/run_benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "workload": {
            "size": args.size,
            **size,
            "steps": args.steps,
            "eval_steps": args.eval_steps,
            "config": config,
            "learning_rate": e2e["learning_rate"],
            "num_params": e2e["num_params"],
        },
        "target_given": args.target_loss is not None,
        "end_to_end": e2e,
        "runtime_s": time.perf_counter() - started,
    }
    write_end_to_end(out, report)
    print((out / "results.md").read_text())
    print(f"Wrote {out / 'results.md'}, results.json and curves.png in {report['runtime_s']:.0f} s")


def build_parser():
    """The command line: the benchmark's flags, and --worker for its own subprocesses."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", help="Where results.{md,json,png} (and a work/ cache) go.")
    parser.add_argument(
        "--work_dir", help="The cache of corpus, tokenizer, batches and weights (default OUTPUT_DIR/work)."
    )
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="Model and batch preset (default: base; tiny with --quick).",
    )
    parser.add_argument("--quick", action="store_true", help="Tiny model, few steps, small matmul: a few minutes.")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="Training steps per mode (default 8 quick, 20 otherwise; --end_to_end: 20 quick, 300 otherwise).",
    )
    parser.add_argument(
        "--warmup_steps", type=int, default=None, help="Untimed first steps (default 2 quick, 3 otherwise)."
    )
    parser.add_argument("--batch_size", type=int, default=None, help="Override the preset's global batch.")
    parser.add_argument("--seq_len", type=int, default=None, help="Override the preset's sequence length.")
    parser.add_argument(
        "--modes",
        default=None,
        help=f"Comma-separated, from: {', '.join(MODES)} (with --end_to_end: {', '.join(E2E_MODES)}). "
        "Default: all but flax_fsdp, and no bf16 mode on a CPU without bf16 instructions.",
    )
    parser.add_argument(
        "--end_to_end",
        action="store_true",
        help="Run the real training scripts instead (flax/run_mlm_flax.py, "
        "pytorch/run_mlm.py eager and --bf16, xla_spawn.py, tensorflow/run_mlm.py fp32 and --bfloat16): whole-command wall time, eval curves, time to a target.",
    )
    parser.add_argument(
        "--eval_steps", type=int, default=None, help="--end_to_end: evaluate every K steps (default: steps / 4)."
    )
    parser.add_argument(
        "--target_loss",
        type=float,
        default=None,
        help="--end_to_end: eval loss whose first crossing is timed "
        "(default: the worst final eval loss among the modes).",
    )
    parser.add_argument("--flax_devices", type=int, default=2, help="Fake CPU devices for the flax_fsdp mode.")
    parser.add_argument(
        "--xla_flags",
        default=os.environ.get("XLA_FLAGS", ""),
        help="XLA_FLAGS for the Flax modes (default: the environment's; e.g. --xla_cpu_max_isa=AVX2).",
    )
    parser.add_argument(
        "--xla_python",
        default=os.environ.get("XLA_PYTHON", str(ROOT / ".venv-xla" / "bin" / "python")),
        help="Python of the PyTorch/XLA venv (bash run.sh setup-xla); torch_xla is skipped without it.",
    )
    parser.add_argument(
        "--preprocess_lines",
        type=int,
        default=None,
        help="PTB lines to preprocess (default 5000 quick, all otherwise).",
    )
    parser.add_argument(
        "--no_inference", action="store_true", help="Skip the run_bert_flax.py fp32/bf16 inference benchmark."
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="Runs of every mode, interleaved round-robin (default 3)."
    )
    parser.add_argument(
        "--profile_steps",
        type=int,
        default=0,
        help="After the timed steps, profile this many more in each Flax and PyTorch mode (jax.profiler, "
        "torch.profiler): where a step's time goes, by kernel group (default 0: none).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def resolve_args(args):
    """Fill in the defaults that depend on --quick and --end_to_end, check the flags, mark the bf16 modes to skip;
    return the modes to run and the model and batch size."""
    args.size = args.size or ("tiny" if args.quick else "base")
    args.steps = args.steps or ((20 if args.quick else 300) if args.end_to_end else (8 if args.quick else 20))
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (2 if args.quick else 3)
    args.preprocess_lines = args.preprocess_lines or (5000 if args.quick else 10**9)
    known = E2E_MODES if args.end_to_end else MODES
    defaults = list(E2E_MODES) if args.end_to_end else GPU_MODES if args.gpu else DEFAULT_MODES
    if args.modes == "gpu" and not args.end_to_end:
        args.modes = ",".join(GPU_MODES)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else defaults
    unknown = [m for m in modes if m not in known]
    if unknown:
        fail(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.repeats < 1:
        fail(f"--repeats must be at least 1, got {args.repeats}")
    if not 0 <= args.warmup_steps < args.steps:
        fail(f"--warmup_steps must be in [0, --steps), got {args.warmup_steps} with --steps {args.steps}")
    if not 0 <= args.profile_steps <= args.steps or (args.profile_steps and args.end_to_end):
        fail(f"--profile_steps must be in [0, --steps] and without --end_to_end, got {args.profile_steps}")
    size = dict(SIZES[args.size])
    size.update({k: v for k, v in (("batch_size", args.batch_size), ("seq_len", args.seq_len)) if v})
    if "flax_fsdp" in modes and size["batch_size"] % args.flax_devices:
        fail(f"--batch_size {size['batch_size']} is not divisible by --flax_devices {args.flax_devices}")
    named = args.modes is not None
    args.skipped = {} if args.gpu else slow_bf16(modes, {m: known[m][1] for m in modes}, named=named)
    return modes, size


def measure_matmul(args, frameworks, native_bf16, work, bar):
    """The matrix-multiply GFLOP/s of every framework and the peak per precision, and on a GPU the published peaks
    (what MFU is taken against there): the report's "matmul"."""
    n = 1024 if args.quick else 8192 if args.gpu else 4096
    matmul = {}
    for fw in frameworks:
        bar.set_postfix_str(f"matmul {fw}")
        # without bf16 instructions, a bf16 product is no peak (PyTorch's 4096^2 one takes many minutes): fp32 only
        res = run_worker(
            {
                "kind": "matmul",
                "framework": fw,
                "n": n,
                "reps": 5 if args.quick else 7,
                "precisions": ["fp32", "bf16"] if native_bf16 else ["fp32"],
            },
            work,
        )
        matmul[fw] = {k: v for k, v in res.items() if k in ("fp32", "bf16", "error")}
        bar.update(1)
    measured = [v for v in matmul.values() if "fp32" in v]
    if not measured:
        fail(
            "no framework could time a matrix product: "
            + "; ".join(f"{fw}: {v.get('error')}" for fw, v in matmul.items())
        )
    peaks = {p: max(v[p] for v in measured) for p in ("fp32", "bf16") if all(p in v for v in measured)}
    return {"n": n, "frameworks": matmul, "peak": peaks, "published": gpu_peaks(args.gpu)}


def make_initial_weights(config_dir, init_dir, frameworks, work, bar):
    """The initial weights every mode starts from, in each framework's format, in init_dir: drawn and converted on
    the host's CPU (XLA:GPU compiles a model's initialisation slowly)."""
    bar.set_postfix_str("initial weights")
    spec = {"kind": "init", "config_dir": str(config_dir), "init_dir": str(init_dir), "frameworks": frameworks}
    res = run_worker(spec, work, env={"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    if "error" in res:
        fail(f"creating the initial weights failed: {res['error']}")
    bar.update(1)


def train_modes(args, modes, config_dir, init_dir, batches_path, work, bar, after_each):
    """Every mode --repeats times, interleaved round-robin, each in its own worker: their results and versions.
    after_each(results, versions) is called as each run ends."""
    results, versions = {name: [] for name in modes}, {}
    for round_index, name in rounds(modes, args.repeats):
        bar.set_postfix_str(f"{name} ({round_index + 1}/{args.repeats})")
        spec = {
            "kind": "train",
            "mode": name,
            "precision": MODES[name][1],
            "config_dir": str(config_dir),
            "init_dir": str(init_dir),
            "batches": str(batches_path),
            "warmup_steps": args.warmup_steps,
            "profile_steps": args.profile_steps,
            "work_dir": str(work / name),
        }
        if name in args.skipped:
            result = {"skipped": args.skipped[name]}
        elif name == "torch_xla":
            if not os.path.exists(args.xla_python):
                result = {"skipped": f"no PyTorch/XLA environment at {args.xla_python} (bash run.sh setup-xla)"}
            else:
                result = run_worker(spec, work, python=args.xla_python, env={"PJRT_DEVICE": "CPU"})
        else:
            flags = args.xla_flags + (
                f" --xla_force_host_platform_device_count={args.flax_devices}" if name == "flax_fsdp" else ""
            )
            result = run_worker(spec, work, env={"XLA_FLAGS": flags.strip()} if MODES[name][0] == "flax" else None)
        versions.update(result.get("versions", {}))
        results[name].append(result)
        bar.write(
            f"{name}: "
            + (
                f"median step {1000 * np.median(result['times'][args.warmup_steps :]):,.1f} ms, loss {result['losses'][-1]:.4f}"
                if "times" in result
                else result.get("skipped") or f"failed: {result['error']}"
            )
        )
        bar.update(1)
        after_each(results, versions)
    return results, versions


def run_inference(args, modes, native_bf16, work, bar):
    """flax/run_bert_flax.py in float32 and bfloat16 (skipped on a CPU without bf16 instructions unless a bf16 mode
    was named): the report's "inference"."""
    inference = {}
    setup = (
        [
            "--batch_size",
            "8",
            "--seq_length",
            "64",
            "--num_warmup",
            "1",
            "--num_iterations",
            "3",
            "--config_overrides",
            "hidden_size=128,num_hidden_layers=2,num_attention_heads=2,intermediate_size=512",
        ]
        if args.quick
        else ["--num_warmup", "2", "--num_iterations", "10"]
    )
    inference["setup"] = "tiny BERT, batch 8 x 64, 3 calls" if args.quick else "bert-base, batch 32 x 128, 10 calls"
    for precision in ("float32", "bfloat16"):
        if precision == "bfloat16" and not (
            native_bf16 or any(MODES[m][1] == "bf16" for m in modes if m not in args.skipped)
        ):
            inference[precision] = {
                "skipped": "this CPU has no bf16 instructions; name a bf16 mode in --modes to run it anyway"
            }
            bar.update(1)
            continue
        bar.set_postfix_str(f"inference {precision}")
        path = work / f"bert-{precision}.json"
        proc = subprocess.run(
            [
                sys.executable,
                "flax/run_bert_flax.py",
                "--precision",
                precision,
                "--output_file",
                str(path),
                *setup,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if proc.returncode == 0 and path.is_file():
            inference[precision] = json.loads(path.read_text())
        else:
            inference[precision] = {
                "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
            }
        bar.update(1)
    return inference


def build_report(args, argv, modes, size, config, flops, matmul, preprocessing, rows, inference, versions, started):
    """Everything results.{md,json,png} are made of, the goals included."""
    import transformers

    versions["transformers"] = transformers.__version__
    num_params = next((r["num_params"] for r in rows if "num_params" in r), 0)
    report = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/run_benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(args.gpu),
        "versions": versions,
        "xla_flags": args.xla_flags,
        "schedule": rounds(modes, args.repeats),
        "workload": {
            "size": args.size,
            **size,
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "repeats": args.repeats,
            "num_params": num_params,
            "flops_per_step": flops,
            "learning_rate": LEARNING_RATE,
            "weight_decay": WEIGHT_DECAY,
            "config": config,
        },
        "matmul": matmul,
        "preprocessing": preprocessing,
        "modes": rows,
        "inference": inference,
        "runtime_s": time.perf_counter() - started,
    }
    report["goals"] = goals(rows, matmul["published"] or matmul["peak"], report["machine"])
    return report


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if not args.output_dir:
        fail("--output_dir is required")
    args.gpu = gpu_info()
    modes, size = resolve_args(args)
    native_bf16 = bool(args.gpu) or not cpu_bf16()[1].startswith("none")
    out = Path(args.output_dir)
    work = Path(args.work_dir) if args.work_dir else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if args.end_to_end:
        args.modes_e2e, args.eval_steps = modes, args.eval_steps or max(args.steps // 4, 1)
        return run_end_to_end(args, out, work, size, argv)

    from tqdm import tqdm

    # the matrix product in each framework the modes use (PyTorch/XLA's is not timed)
    frameworks = [
        fw
        for fw in ("torch", "jax", "tensorflow")
        if any(MODES[m][0] == {"torch": "pytorch", "jax": "flax"}.get(fw, fw) for m in modes)
    ]
    total = 2 + len(frameworks) + 1 + len(modes) * args.repeats + (0 if args.no_inference else 2)
    bar = tqdm(total=total, desc="benchmark", unit="task")
    started = time.perf_counter()
    bar.set_postfix_str("corpus, tokenizer, config, preprocessing")
    config_dir, batches_path, preprocessing = prepare_data(work, args, size, bar)
    matmul = measure_matmul(args, frameworks, native_bf16, work, bar)
    init_dir = work / f"init-{args.size}"
    make_initial_weights(config_dir, init_dir, sorted({MODES[m][0] for m in modes}), work, bar)
    config = json.loads((config_dir / "config.json").read_text())
    flops = model_flops_per_step(config, size["batch_size"], size["seq_len"])
    peaks = matmul["published"] or matmul["peak"]

    def report_of(results, versions, inference):
        ran = [name for name in modes if results[name]]
        rows = [summarize(name, results[name], flops, peaks, args.warmup_steps, size) for name in ran]
        return build_report(
            args, argv, ran, size, config, flops, matmul, preprocessing, rows, inference, dict(versions), started
        )

    def write_partial(results, versions):  # what a run cut short (a device call's time limit) still leaves
        report = report_of(results, versions, {})
        report["partial"] = f"{sum(map(len, results.values()))} of {len(modes) * args.repeats} runs of the modes done"
        write_outputs(out, report, stem="partial")

    results, versions = train_modes(args, modes, config_dir, init_dir, batches_path, work, bar, write_partial)
    inference = {} if args.no_inference else run_inference(args, modes, native_bf16, work, bar)
    bar.close()
    report = report_of(results, versions, inference)
    write_outputs(out, report)
    for suffix in ("json", "md", "png"):
        (out / f"partial.{suffix}").unlink(missing_ok=True)
    print((out / "results.md").read_text())
    print(f"Wrote {out / 'results.md'}, results.json and results.png in {report['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
