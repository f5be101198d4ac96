"""The Flax modes: flax/run_mlm_flax.py's own train state and train step (build_train_state, make_train_step, its
--fsdp mesh), loaded from the script as flax/train_compile.py loads it, on the harness's batches: the step a user's
run executes, on any device (it recomputes activations on a CPU only, as the script does)."""

import contextlib
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.measure import profiled, step_batch, timed_loop, worker_main
from benchmarks.modes import BETAS, EPS, LEARNING_RATE, MODES, WEIGHT_DECAY, warmup_steps_for
from benchmarks.workload import load_script


def script_flags(spec, mode, rows, length, steps):
    """The script's command line for this mode's run: its learning rate, warm-up, AdamW and --dtype, --fsdp."""
    dtype = "bfloat16" if mode.precision == "bf16" and mode.model_dtype == "float32" else "float32"
    flags = {
        "--output_dir": spec["work_dir"],
        "--model_name_or_path": os.path.join(spec["init_dir"], "flax"),
        "--max_seq_length": length,
        "--per_device_train_batch_size": rows // jax.device_count(),
        "--learning_rate": LEARNING_RATE,
        "--warmup_steps": warmup_steps_for(steps),
        "--weight_decay": WEIGHT_DECAY,
        "--adam_beta1": BETAS[0],
        "--adam_beta2": BETAS[1],
        "--adam_epsilon": EPS,
        "--max_steps": steps,
        "--dtype": dtype,
    }
    return [str(x) for kv in flags.items() for x in kv] + (["--fsdp", mode.fsdp] if mode.fsdp else []) + ["--do_train"]


def train(spec, batches):
    mode = MODES[spec["mode"]]
    mlm = load_script("flax/run_mlm_flax.py")
    mlm.release_compiler_memory()
    steps, rows, length = batches["input_ids"].shape
    model_args, _, args = mlm.parse_args(script_flags(spec, mode, rows, length, steps))
    config = mlm.transformers.AutoConfig.from_pretrained(model_args.model_name_or_path)
    n = jax.device_count()
    plan = mlm.TrainingPlan(mlm.make_mesh(args.fsdp), n, n, 0, rows, rows, total_steps=steps)
    model, state, schedule = mlm.build_train_state(model_args, args, config, plan)
    if mode.model_dtype != "float32":  # upstream's --dtype: the model computes in bf16 (its weights stay f32)
        model = mlm.MODEL_CLASS.from_config(config, dtype=getattr(jnp, mode.model_dtype), _do_init=False)
    bf16 = model_args.dtype == "bfloat16"
    step = mlm.make_train_step(model, schedule, bf16, args.seed, state)

    def place(batch):
        if "masked_positions" not in batch:  # the head at every position: the script's gather, of all of them
            batch = {**batch, "masked_positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))}
        return mlm.global_batch(batch, plan, micro_batches=1)

    executed = mlm.matmul_flops(step.trace(state, place(step_batch(batches, 0, mode.head))).jaxpr.jaxpr)

    def run(batch):
        nonlocal state
        state, metrics = step(state, place(batch))
        total, count = metrics["sums"]["loss"]
        return float(total) / max(float(count), 1.0)

    times, losses = timed_loop(run, batches, mode.head)
    extra = {}
    if spec["profile_steps"]:
        extra["profile"] = profiled(run, batches, spec["profile_steps"], mode.head, jax_trace)
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    return dict(
        times=times,
        losses=losses,
        num_params=int(sum(x.size for x in jax.tree.leaves(state.params))),
        executed_flops=executed,
        executed_by="the step's matrix products as traced (run_mlm_flax.py's matmul_flops)",
        devices=n,
        versions={"jax": jax.__version__, "flax": __import__("flax").__version__, **backend_version(device)},
        # XLA:GPU computes an f32 product in TF32 at jax's default precision
        products="bf16" if mode.precision == "bf16" else "tf32" if gpu else "fp32",
        device_peak_mb=(device.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**20 or None,
        **extra,
    )


def backend_version(device):
    """{"CUDA (jax)": ...} on a GPU: the version XLA's GPU client reports."""
    return {"CUDA (jax)": device.client.platform_version} if device.platform == "gpu" else {}


@contextlib.contextmanager
def jax_trace(kernels):
    """jax.profiler.trace, its kernels added to `kernels` on exit: the GPU's streams' (CUPTI), or on a CPU the XLA ops
    of its client threads. Yields the list the lines read go into."""
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


def matmul_call(precision, a, b):
    """A call of one n x n product: bf16 x bf16 -> f32, the product flax_bf16 computes (XLA:CPU's bf16 -> bf16
    product is slower than f32), or f32."""
    dtype = jnp.float32 if precision == "fp32" else jnp.bfloat16
    x, y = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    return lambda: f(x, y).block_until_ready()


if __name__ == "__main__":
    worker_main(train, matmul_call)
