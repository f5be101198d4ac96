#!/usr/bin/env python
"""Compile a Flax training script's train step (--do_train) and eval step (--do_eval) for a TPU slice or GPUs on this
machine, without them: the same model, --dtype, --fsdp, accumulation and batch shapes as the script's run, through its
own functions; no data read, nothing written. It prints, per device, the memory XLA plans against the chip's HBM, the
FLOPs of the step's matrix products and XLA's time estimate (TPU only), and exits 1 when a step does not fit. Beside
the scripts as MaxText's train_compile.py is beside its train.py; any of the four, or a renamed copy of one:

  TPU_LIBRARY_PATH=.libtpu/libtpu/libtpu.so python flax/train_compile.py flax/run_mlm_flax.py --topology v3-8 -- \\
      --output_dir unused --config_name out/model --tokenizer_name out/model --max_seq_length 128 --do_train

Slices (libtpu: bash run.sh setup-tpu): v2-8, v3-8, v4-8 or GENERATION:CHIPS, such as v3:4x4, v4:2x2x2, v5p:2x2x1,
v5e:2x4, v6e:2x2, tpu7x:2x2x1 (Ironwood: two devices a chip). A v4 or v5p chip is one device (megacore), as it
runs there: the batch per device is per chip.
GPUs (jax's CUDA plugin: bash run.sh setup-gpu, then PYTHONPATH=.libgpu): h100 or a100, h100:8 for eight on one host.
"""

import argparse
import contextlib
import importlib.metadata
import importlib.util
import logging
import math
import os
import re
import sys
import time
from dataclasses import replace

# The supported range, from requirements.txt's pins (Python 3.11) to requirements-current.txt's (Python 3.12+): a
# package missing or outside it is one line here, before an import fails deep inside transformers or jax.
STACK = {
    "jax": "0.9.2",
    "jaxlib": "0.9.2",
    "flax": "0.12.6",
    "optax": "0.2.8",
    "orbax-checkpoint": "0.12.8",
    "transformers": "4.57.6",
    "datasets": "5.0.1",
    "tokenizers": "0.22.2",
    "safetensors": "0.4",
    "tqdm": "4.0",
}


def check_stack(script, stack):
    """Exit with one line where this Python lacks a package of `stack` ({name: the oldest supported version}), has
    one older, or has transformers 5 or later (no Flax models); each line ends in the install command."""
    versions = {}
    for name in stack:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    current = sys.version_info >= (3, 12)  # jax 0.11 and later need Python 3.12
    if missing := [name for name in stack if name not in versions]:
        sys.exit(
            f"{script}: error: {', '.join(missing)} not installed for {sys.executable}: "
            + (
                "pip install -r requirements-current.txt"
                if current
                else "bash run.sh setup, then source .venv/bin/activate"
            )
        )
    jax = "jax==0.12.1 jaxlib==0.12.1 flax==0.12.12" if current else "jax==0.9.2 jaxlib==0.9.2 flax==0.12.6"
    for name, oldest in stack.items():
        if tuple(int(part) for part in re.findall(r"\d+", versions[name])[:3]) < tuple(map(int, oldest.split("."))):
            sys.exit(
                f"{script}: error: {name} {versions[name]} is older than the {oldest} this script needs: pip install "
                + (jax if name in ("jax", "jaxlib", "flax") else f"'{name}>={oldest}'")
            )
    if int(versions["transformers"].split(".")[0]) >= 5:
        sys.exit(
            f"{script}: error: transformers {versions['transformers']} has no Flax models (5.0 removed them); "
            "this script needs 4.57, the last release with them: pip install 'transformers==4.57.6'"
        )


check_stack(os.path.basename(__file__), STACK)

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

logger = logging.getLogger("train_compile")

# HBM per chip in GiB, as Google Cloud's TPU pages publish it (cloud.google.com/tpu/docs: v2, v3, v4, v5e, v5p, v6e,
# 7x), by the device_kind libtpu reports; a chip's devices (two v2, v3 or 7x cores) share it.
TPU_HBM_GIB = {
    "TPU v2": 16,
    "TPU v3": 32,
    "TPU v4": 32,
    "TPU v5 lite": 16,
    "TPU v5": 95,
    "TPU v6 lite": 32,
    "TPU7x": 192,
}
# The GPUs XLA's GPU compiler is given as targets, from NVIDIA's data sheets (SMs, FP32 lanes an SM, boost clock GHz,
# memory GiB, bandwidth TB/s, L2 MiB) and the CUDA C++ Programming Guide's table of compute capabilities (shared
# memory KiB an SM, the capability).
GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", 132, 128, 1.98, 80, 3.35, 50, 228, 9, 0),
    "a100": ("NVIDIA A100-SXM4-80GB", 108, 64, 1.41, 80, 2.039, 40, 164, 8, 0),
}
TRAINING_FUNCTIONS = ("make_train_step", "build_train_state", "collate_batch")
# The TPU generations libtpu names (0.0.37 and 0.0.50 alike), as the first part of a slice's name.
TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v5litepod", "v6e", "tpu7x")
SLICES = (
    "name a slice as v2-8, v3-8, v4-8 or GENERATION:CHIPS, such as v3:4x4, v4:2x2x2, v5p:2x2x1, v6e:2x2, tpu7x:2x2x1"
)


def fail(message):
    """One line on stderr naming what is wrong and what to do, and a non-zero exit."""
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def topology_devices(name):
    """The devices of the TPU slice `name` (from libtpu: TPU_LIBRARY_PATH, or the libtpu package) or of `name`'s GPUs
    (GPU[:COUNT], from jax's CUDA plugin), one device's memory in bytes, and their description: no TPU or GPU needed.
    On v4 and v5p, asked for chip_config_name "megacore", libtpu gives a chip's two cores as one device,
    as they run."""
    os.environ["LM_CPU_BF16"] = "0"  # this CPU's bf16 choices (transposes_pay) stay out of the program
    jax.config.update("jax_platforms", "cpu")  # the chip is a target to compile for, not a backend to look for
    gpu, _, count = name.lower().partition(":")
    if gpu in GPUS:
        return gpu_devices(gpu, count or "1")
    generation = re.fullmatch(r"([a-z0-9]+)(-\d+|:\d+(x\d+)*)", name)  # checked before libtpu is looked for
    if not (generation and generation[1] in TPU_GENERATIONS):
        fail(f"--topology {name} is neither a TPU slice nor a GPU this tool knows; {SLICES}, or GPUs as h100[:COUNT]")
    if not (os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu")):
        # the libtpu of jax's [tpu] extra: the compiler this jax was released with
        libtpu = next(r.split(";")[0] for r in importlib.metadata.requires("jax") if r.startswith("libtpu"))
        fail(
            f"--topology needs libtpu, the TPU compiler (no TPU needed): pip install '{libtpu}', or bash run.sh "
            "setup-tpu and TPU_LIBRARY_PATH=.libtpu/libtpu/libtpu.so (.libtpu-current on requirements-current.txt)"
        )
    quiet = dict(TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE="v3-8", TPU_WORKER_HOSTNAMES="localhost")
    quiet["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # no TPU is opened: compiling in several processes at once is safe
    quiet["TPU_LOG_DIR"] = "disabled"  # not libtpu's files in /tmp/tpu_logs (up to 3 MB a compile); stderr as ever
    for variable, value in quiet.items():  # no cloud metadata to ask, none needed to compile
        os.environ.setdefault(variable, value)
    megacore = {"chip_config_name": "megacore"} if name.startswith(("v4", "v5p")) else {}
    try:
        devices = topologies.get_topology_desc(platform="tpu", topology_name=name, **megacore).devices
    except Exception as e:  # noqa: BLE001 (libtpu raises XlaRuntimeError)
        fail(f"--topology {name}: {str(e).splitlines()[0].split(' and does not match')[0]}; {SLICES}")
    kind, chips = devices[0].device_kind, len({tuple(d.coords) for d in devices})
    hbm, one = TPU_HBM_GIB.get(kind, 0) * chips / len(devices), ", megacore: one device a chip" * bool(megacore)
    return devices, hbm * 2**30, f"{len(devices)} x {kind} ({chips} chips{one}, {hbm:.1f} GiB of HBM a device)"


def gpu_devices(gpu, count):
    """`count` GPUs of one host, compile-only, from a target description written from GPUS' figures."""
    plugins = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    if not (importlib.util.find_spec("jax_plugins") and any(map(importlib.util.find_spec, plugins))):
        fail(
            f"--topology {gpu} needs jax's CUDA plugin (no GPU or CUDA needed): pip install jax-cuda12-plugin=="
            f"{jax.__version__} jax-cuda12-pjrt=={jax.__version__}, or bash run.sh setup-gpu and PYTHONPATH=.libgpu"
        )
    if not count.isdigit() or int(count) < 1:
        fail(f"--topology {gpu}:{count}: name GPUs as {gpu} or {gpu}:COUNT, such as {gpu}:8")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA libraries: nothing runs
    kind, sms, lanes, ghz, gib, bandwidth, l2, shared, major, minor = GPUS[gpu]
    info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=48 * 1024)
    info.update(shared_memory_per_core=shared * 1024, shared_memory_per_block_optin=(shared - 1) * 1024)
    info.update(threads_per_core_limit=2048, core_count=sms, fpus_per_core=lanes, block_dim_limit_x=2**31 - 1)
    info.update(block_dim_limit_y=65535, block_dim_limit_z=65535, memory_bandwidth=int(bandwidth * 1e12))
    info.update(l2_cache_size=l2 * 2**20, clock_rate_ghz=ghz, device_memory_size=gib * 2**30)
    info.update(registers_per_core_limit=65536, registers_per_block_limit=65536)
    target = " ".join(f"{k}: {v}" for k, v in info.items())
    target = f"gpu_device_info {{ {target} cuda_compute_capability {{ major: {major} minor: {minor} }} }} "
    target += f'platform_name: "CUDA" device_description_str: "{kind}"'
    topology = topologies.get_topology_desc(platform="cuda", target_config=target, topology=f"1x1x{count}")
    return topology.devices, gib * 2**30, f"{count} x {kind} ({gib:.1f} GiB of HBM a device)"


def check_script(path):
    """A missing file or one that is not a Flax training script, refused by its text before anything is loaded."""
    if not os.path.isfile(path):
        fail(f"{path} does not exist: name a Flax training script, such as flax/run_mlm_flax.py")
    with open(path, errors="replace") as f:
        source = f.read()
    if not all(f"def {name}(" in source for name in TRAINING_FUNCTIONS):
        fail(f"{path} is not a Flax training script: it has no {', '.join(TRAINING_FUNCTIONS)}")


def load_script(path):
    """A Flax training script imported by its path, under a name of its own
    (flax/ shares its name with the package)."""
    spec = importlib.util.spec_from_file_location("compiled_" + os.path.basename(path)[:-3], path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def compile_steps(script, flags, topology, target):
    """The train step (--do_train) and eval step (--do_eval) the script's run with `flags` would execute, compiled for
    `target` (topology_devices' of `topology`) and reported (compile_report). Reads the config and tokenizer and
    tokenizes a few lines of its own: no data."""
    (model_args, data_args, args), (devices, hbm, what) = script.parse_args(flags), target
    script.setup_logging(args.log_level)
    if not (args.do_train or args.do_eval):
        fail("nothing to compile: pass --do_train and/or --do_eval")
    script.validate_objective(data_args)
    config, tokenizer = script.load_config_and_tokenizer(model_args, args.gradient_checkpointing)
    length = script.resolve_max_seq_length(data_args, config, tokenizer)
    script.fit_attention(config, length)
    n, micro = len(devices), args.gradient_accumulation_steps
    train_rows, eval_rows = n * args.per_device_train_batch_size * micro, n * args.per_device_eval_batch_size
    rows = synthetic_rows(script, data_args, tokenizer, length, max(train_rows, eval_rows))["train"]
    mesh = script.make_mesh(args.fsdp, devices)
    plan = script.TrainingPlan(mesh, n, n, 0, train_rows, eval_rows, total_steps=max(args.max_steps, 1))
    collator = script.build_collator(data_args, config, tokenizer, length, rows)
    model, state, schedule = script.build_train_state(model_args, args, config, plan, abstract=True)
    sharded = lambda batch, *spec: {  # noqa: E731
        k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))
        for k, x in batch.items()
    }
    bf16, seed, steps, split = model_args.dtype == "bfloat16", args.seed, {}, ("replica", "fsdp")
    if args.do_train:  # [micro-batches, rows, ...], as global_batch shapes it
        batch = script.collate_batch(collator, rows[:train_rows], (seed, 0), np.arange(train_rows), train_rows)
        batch = sharded({k: x.reshape(micro, -1, *x.shape[1:]) for k, x in batch.items()}, None, split)
        steps["train"] = (script.make_train_step(model, schedule, bf16, seed, state), (state, batch))
    if args.do_eval:
        batch = script.collate_batch(collator, rows[:eval_rows], (seed,), np.arange(eval_rows), eval_rows, train=False)
        index = jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, PartitionSpec()))
        steps["eval"] = (script.make_eval_step(model, bf16, seed), (state.params, sharded(batch, split), index))
    per_device = [f"train {args.per_device_train_batch_size}" + f" x {micro} micro-batches" * (micro > 1)]
    per_device = per_device * args.do_train + [f"eval {args.per_device_eval_batch_size}"] * args.do_eval
    logger.info(
        f"Compiling for {topology}: {what}, --{script.LENGTH_FLAG} {length}, --dtype {model_args.dtype}"
        f"{', --fsdp ' + args.fsdp if args.fsdp else ''}; rows a device: {', '.join(per_device)}"
    )
    held = jax.tree.leaves(state if args.do_train else state.params)
    state_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in held)
    if hbm and state_bytes > hbm:
        fail(
            f"the {'train state' if args.do_train else 'model'} alone is {state_bytes / 2**30:.2f} GiB a device, more "
            f"than its {hbm / 2**30:.1f} GiB of HBM: use --fsdp full_shard, more devices or a smaller model"
        )
    too_big = [
        line for name, (step, inputs) in steps.items() for line in compile_report(script, name, step, inputs, hbm)
    ]
    base = script.transformers.FlaxPreTrainedModel.enable_gradient_checkpointing  # not every model overrides it
    remat = type(model).enable_gradient_checkpointing is not base and not args.gradient_checkpointing
    more = ["--fsdp full_shard"] * (not args.fsdp) + ["--gradient_checkpointing"] * remat
    if too_big:  # the remedies this run does not use yet and its model allows
        fail("; ".join(too_big) + ": lower the batch, or add " + ", ".join(["--gradient_accumulation_steps", *more]))


def synthetic_rows(script, data_args, tokenizer, length, count):
    """At least `count` rows made by the script's preprocess from lines of plain words, each line longer than a row:
    the shapes a run's batches have, without reading its data."""
    words = "the quick brown fox jumps over the lazy dog .".split()
    line = " ".join(words * (2 * length // len(words) + 1))
    datasets = script.datasets
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [line] * count})})
    logging.disable(logging.WARNING)  # such lines are cut or packed on purpose
    datasets.disable_progress_bars()
    try:
        return script.preprocess(
            raw, replace(data_args, preprocessing_num_workers=None, streaming=False), tokenizer, length
        )
    finally:
        logging.disable(logging.NOTSET)
        datasets.enable_progress_bars()


def compile_report(script, name, step, inputs, hbm):
    """Compile one step and log, per device, its memory, the FLOPs of its matrix products (the script's matmul_flops)
    and XLA's time estimate; returns [] or the line that says by how much it does not fit."""
    started = time.perf_counter()
    logger.info(f"Compiling the {name} step (minutes at roberta-base's size; nothing prints until it ends) ...")
    try:
        traced = step.trace(*inputs)
        compiled = traced.lower().compile()
    except Exception as e:  # noqa: BLE001 (JaxRuntimeError)
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        used = re.search(r"[Uu]sed ([0-9.]+[KMGT]?) of ([0-9.]+[KMGT]?) hbm.*?by ([0-9.]+[KMGT]?)", str(e), re.S)
        what = f"needs {used[1]} of a device's {used[2]} HBM, {used[3]} more" if used else str(e).splitlines()[0][:200]
        return [f"the {name} step does not fit: XLA:TPU {what}"]
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # None from the GPU compiler
    state = memory.argument_size_in_bytes
    total = state + memory.temp_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    devices = jax.tree.leaves(inputs)[0].sharding.mesh.size
    flops, once = (script.matmul_flops(traced.jaxpr.jaxpr, loops) / devices for loops in (True, False))
    seconds = cost.get("optimal_seconds", 0) * flops / max(once, 1)  # XLA counts a loop's body once: scaled
    tokens = math.prod(inputs[1]["input_ids"].shape)
    size = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"  # noqa: E731
    share = f"of {size(hbm)} ({100 * total / hbm:.1f} %)" if hbm else "(this chip's HBM is not in TPU_HBM_GIB)"
    estimate = (  # libtpu gives tiny programs a negative optimal_seconds on some chips (v5e); the GPU compiler none
        f"XLA's estimate {1e3 * seconds:,.2f} ms a step, {tokens / seconds:,.0f} tokens/s over the slice"
        if seconds > 0
        else f"no time estimate from XLA (optimal_seconds {cost.get('optimal_seconds')})"
        if cost
        else "no time estimate from XLA for this target"
    )
    logger.info(
        f"{name} step, per device: arguments {size(state)}, temporaries {size(memory.temp_size_in_bytes)}, total "
        f"{size(total)} {share}; {flops / 1e9:,.1f} GFLOP of matrix products; {estimate} "
        f"(compiled in {time.perf_counter() - started:.0f} s)"
    )
    if hbm and total > hbm:  # XLA:TPU refuses such a program itself (above); XLA's GPU compiler does not
        return [
            f"the {name} step does not fit: it needs {size(total)} of a device's {size(hbm)}, {size(total - hbm)} more"
        ]
    return []


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = fail
    parser.add_argument("script", help="a Flax training script, such as flax/run_mlm_flax.py")
    parser.add_argument("--topology", required=True, help="a TPU slice (v3-8, v4:2x2x2) or GPUs (h100, h100:8)")
    parser.usage = "%(prog)s SCRIPT --topology SLICE -- FLAGS (the script's own)"
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    check_script(args.script)
    target = topology_devices(args.topology)  # a wrong name or a missing compiler: refused before the script loads
    compile_steps(load_script(args.script), argv[cut + 1 :], args.topology, target)


if __name__ == "__main__":
    main()
