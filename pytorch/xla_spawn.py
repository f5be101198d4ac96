#!/usr/bin/env python
# Reproduction of Hugging Face's examples/pytorch/xla_spawn.py (Apache-2.0 upstream), for torch_xla 2.9.
"""Launch a training script on PyTorch/XLA, one process per device, like `torch.distributed.launch`:

    python pytorch/xla_spawn.py --num_cores 8 pytorch/run_mlm.py --output_dir ... (run_mlm.py's own flags)

The training script must define `_mp_fn(index)`; it gets `--tpu_num_cores N` appended to its arguments.
torch_xla 2.9 spawns either one process or one per device (all of them), so `--num_cores` is 1 or the
number of devices. On XLA:CPU (`PJRT_DEVICE=CPU`, or no TPU found) only `--num_cores 1` works:
torch_xla has no collectives across several CPU devices (pytorch/xla#5005, #9089), so several cores
without a TPU fail here at once instead of in a rendezvous that aborts after a timeout. For data
parallel training on CPU, use `torchrun --nproc_per_node N pytorch/run_mlm.py ...` instead.
torch_xla needs its own environment (torch 2.9.0): `bash run.sh setup-xla`, then `.venv-xla/bin/python`.
"""

import importlib
import os
import sys
from argparse import REMAINDER, ArgumentParser
from pathlib import Path


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def parse_args():
    parser = ArgumentParser(
        description="PyTorch/XLA distributed training launch helper: spawns one training "
        "process per XLA device (TPU cores; XLA:CPU with --num_cores 1)."
    )
    parser.add_argument(
        "--num_cores",
        type=int,
        default=1,
        help="Number of XLA devices to use: 1, or all of the host's (8 on a TPU v3-8).",
    )
    parser.add_argument(
        "training_script",
        type=str,
        help="The full path to the training script to be launched in "
        "parallel, followed by all the arguments for the training script.",
    )
    parser.add_argument("training_script_args", nargs=REMAINDER)
    return parser.parse_args()


def device_type():
    """The PJRT device torch_xla will use: PJRT_DEVICE, else TPU when TPU chips are attached, else CPU
    (torch_xla's own default), without starting the XLA runtime (spawn must come first)."""
    from torch_xla._internal import tpu

    if os.environ.get("PJRT_DEVICE"):
        return os.environ["PJRT_DEVICE"].split("_")[0].upper()
    return "TPU" if tpu.num_available_chips() > 0 else "CPU"


def check_num_cores(num_cores):
    from torch_xla._internal import tpu

    if num_cores < 1:
        fail(f"--num_cores must be a positive integer, got {num_cores}")
    if num_cores == 1:
        return
    kind = device_type()
    if kind == "CPU":
        fail(
            f"--num_cores {num_cores} needs a TPU (or GPUs with PJRT_DEVICE=CUDA), and this machine has none: "
            "PyTorch/XLA "
            "cannot run collectives across several XLA:CPU devices (pytorch/xla#5005). Use --num_cores 1, or "
            f"`torchrun --nproc_per_node {num_cores} pytorch/run_mlm.py ...` for data parallel training on CPU"
        )
    if kind == "TPU":
        available = tpu.num_available_devices()
        if num_cores != available:
            fail(
                f"--num_cores {num_cores}: torch_xla spawns one process per TPU device, and this host has "
                f"{available}; use --num_cores 1 or --num_cores {available}"
            )
    if kind in ("CUDA", "GPU"):
        os.environ.setdefault("GPU_NUM_DEVICES", str(num_cores))


def main():
    args = parse_args()
    try:
        import torch_xla.distributed.xla_multiprocessing as xmp
    except ImportError:
        fail(
            f"torch_xla is not installed for {sys.executable}; install it with `bash run.sh setup-xla` and run "
            "this launcher with .venv-xla/bin/python"
        )
    check_num_cores(args.num_cores)

    script_fpath = Path(args.training_script)
    if not script_fpath.is_file():
        fail(f"training script {args.training_script} does not exist")
    # Import the training script as a module (its folder on sys.path, which the spawned processes
    # inherit, so they can unpickle `_mp_fn`).
    sys.path.append(str(script_fpath.parent.resolve()))
    mod = importlib.import_module(script_fpath.stem)
    if not hasattr(mod, "_mp_fn"):
        fail(f"{args.training_script} defines no `_mp_fn(index)` to run in each process")

    # Patch sys.argv for the training script.
    sys.argv = [args.training_script] + args.training_script_args + ["--tpu_num_cores", str(args.num_cores)]
    xmp.spawn(mod._mp_fn, args=(), nprocs=1 if args.num_cores == 1 else None)


if __name__ == "__main__":
    main()
