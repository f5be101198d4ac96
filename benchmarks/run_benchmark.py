#!/usr/bin/env python
"""One masked-LM workload in every framework, timed side by side: the runtime table of the original README (Flax vs
PyTorch vs PyTorch/XLA), on this machine, plus TensorFlow.

  python benchmarks/run_benchmark.py --quick --output_dir out/bench            # tiny model, a few minutes
  python benchmarks/run_benchmark.py --size base --output_dir out/bench-base   # roberta-base, batch 8 x 128
  python benchmarks/run_benchmark.py --end_to_end --size tiny --steps 300 --output_dir out/bench-e2e   # the scripts

Every mode runs --repeats times (3), interleaved round-robin so that the machine's drift hits every mode alike;
tables give the median with the range, and ratios between modes are taken round by round.

The same work everywhere: one tokenizer (8,192-token ByteLevelBPE on Penn Treebank), one RoBERTa config (dropout 0),
the same initial weights (PyTorch's init, converted for Flax and TF), the same pre-masked batches in the same order
(masked by flax/run_mlm_flax.py's collator), the same loss (mean cross-entropy over the masked tokens) with the LM head
computed at the masked positions only, and AdamW with the same warm-up, linear decay and weight decay. Each framework
at its best ordinary practice: the Flax rows run run_mlm_flax.py's own train state and step (build_train_state,
make_train_step, --fsdp's mesh); PyTorch's take SDPA attention, the Trainer's optimizer and schedule with fused AdamW;
TensorFlow's tensorflow/run_mlm.py's optimizer. Reference rows (*_all_positions) compute the head at every position,
as transformers' models do.

Per mode: first step (tracing and compilation included), median of the timed steps (each waits for its loss),
tokens/s, model FLOPs a step (one definition for every row: the products the loss needs) and MFU against the
matrix-product peak measured in this run, the FLOPs the framework counted the step execute (HFU), peak RSS and the loss
after the common number of steps. Also: tokenization and grouping throughput, and run_bert_flax.py fp32 vs bf16
inference. Writes OUTPUT_DIR/results.{md,json,png}, with the CPU model and its bf16 support; as each mode ends,
partial.{md,json,png} hold what has run (a run cut short leaves them; a finished one removes them). --profile_steps N
profiles N more steps of each Flax and PyTorch mode: where a step's time goes, by kernel group.

On a GPU (nvidia-smi lists one) the modes are GPU_MODES (`--modes gpu` names them anywhere); MFU is taken against
NVIDIA's published dense peak for the precision the row's products ran in. benchmarks/gpu.sh runs it on a GPU machine.
On a CPU without bf16 instructions the bf16 modes and the bf16 inference line are skipped, with the reason in their
rows, unless --modes names a bf16 mode. LM_CPU_BF16=1 or 0 overrides what the CPU's flags say.

The parts, one concern a file: modes.py (the modes, sizes and hyperparameters), workload.py (the data, the FLOPs, the
machine), worker_flax.py, worker_torch.py, worker_tf.py (one framework each) with measure.py (what they share) and
weights.py, runner.py (the processes), stats.py, report.py, end_to_end.py (--end_to_end).
"""

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: the repository's root, where the package benchmarks/ is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.end_to_end import run_end_to_end
from benchmarks.modes import (
    DEFAULT_MODES,
    E2E_MODES,
    GPU_MODES,
    LEARNING_RATE,
    MODES,
    SIZES,
    STACK_MODES,
    WEIGHT_DECAY,
    warmup_steps_for,
)
from benchmarks.report import goals, write_outputs
from benchmarks.runner import make_initial_weights, measure_matmul, rounds, run_inference, train_modes
from benchmarks.stats import summarize
from benchmarks.workload import (
    ROOT,
    cpu_bf16,
    fail,
    gpu_info,
    machine_info,
    model_flops_per_step,
    prepare_data,
    slow_bf16,
)


def build_parser():
    """The command line."""
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
        "--warmup_steps",
        type=int,
        default=None,
        help="Untimed first steps, not the learning rate's warm-up (which is 10 %% of --steps in every mode); "
        "default 2 quick, 3 otherwise.",
    )
    parser.add_argument("--batch_size", type=int, default=None, help="Override the preset's global batch.")
    parser.add_argument("--seq_len", type=int, default=None, help="Override the preset's sequence length.")
    parser.add_argument(
        "--modes",
        default=None,
        help=f"Comma-separated, from: {', '.join(MODES)} (with --end_to_end: {', '.join(E2E_MODES)}); or gpu (the "
        "GPU call's), or stacks (Flax's three on the pins and on today's releases). "
        "Default: all but flax_fsdp, and no bf16 mode on a CPU without bf16 instructions.",
    )
    parser.add_argument(
        "--end_to_end",
        action="store_true",
        help="Run the real training scripts instead (flax/run_mlm_flax.py, "
        "pytorch/run_mlm.py eager and --bf16, xla_spawn.py, tensorflow/run_mlm.py fp32 and --bfloat16): "
        "whole-command wall time, eval curves, time to a target.",
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
        "--current_python",
        default=str(ROOT / ".venv-current" / "bin" / "python"),
        help="Python of today's releases (requirements-current.txt) for the *_current Flax modes (--modes stacks).",
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
    return parser


# The counts a user may give: each at least 1 where given (None, not 0, stands for "not given": the preset's or
# --quick's default).
COUNTS = ("steps", "batch_size", "seq_len", "repeats", "eval_steps", "preprocess_lines", "flax_devices")


def check_counts(args):
    """Refuse a count below 1 as parsed, before anything runs: 0 would otherwise read as "not given"."""
    for flag in COUNTS:
        value = getattr(args, flag)
        if value is not None and value < 1:
            fail(f"--{flag} must be a positive integer, got {value}")


def resolve_args(args):
    """Fill in the defaults that depend on --quick and --end_to_end, check the flags, mark the bf16 modes to skip;
    return the modes to run and the model and batch size."""
    args.size = args.size or ("tiny" if args.quick else "base")
    if args.steps is None:
        args.steps = (20 if args.quick else 300) if args.end_to_end else (8 if args.quick else 20)
    if args.warmup_steps is None:
        args.warmup_steps = 2 if args.quick else 3
    if args.preprocess_lines is None:
        args.preprocess_lines = 5000 if args.quick else 10**9
    known = E2E_MODES if args.end_to_end else MODES
    defaults = list(E2E_MODES) if args.end_to_end else GPU_MODES if args.gpu else DEFAULT_MODES
    groups = {} if args.end_to_end else {"gpu": GPU_MODES, "stacks": STACK_MODES}  # names of several modes
    asked = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else defaults
    modes = list(dict.fromkeys(mode for name in asked for mode in groups.get(name, [name])))
    unknown = [m for m in modes if m not in known]
    if unknown:
        fail(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if not 0 <= args.warmup_steps < args.steps:
        fail(f"--warmup_steps must be in [0, --steps), got {args.warmup_steps} with --steps {args.steps}")
    if not 0 <= args.profile_steps <= args.steps or (args.profile_steps and args.end_to_end):
        fail(f"--profile_steps must be in [0, --steps] and without --end_to_end, got {args.profile_steps}")
    size = dict(SIZES[args.size])
    size.update({k: v for k, v in (("batch_size", args.batch_size), ("seq_len", args.seq_len)) if v is not None})
    if "flax_fsdp" in modes and size["batch_size"] % args.flax_devices:
        fail(f"--batch_size {size['batch_size']} is not divisible by --flax_devices {args.flax_devices}")
    named = args.modes is not None
    args.skipped = {} if args.gpu else slow_bf16(modes, {m: known[m].precision for m in modes}, named=named)
    return modes, size


@dataclass
class Setting:
    """What every report of a run shares, settled before the modes run."""

    args: argparse.Namespace
    command: str
    size: dict
    config: dict
    masked_tokens: float  # a step's masked tokens, on average over the steps
    flops: int  # model FLOPs a step (model_flops_per_step)
    matmul: dict
    preprocessing: dict
    started: float


def build_report(setting, modes, results, versions, inference):
    """Everything results.{md,json,png} (or partial.*) are made of, the goals included, from the runs so far."""
    import transformers

    args, size = setting.args, setting.size
    ran = [name for name in modes if results[name]]
    peaks = setting.matmul["published"] or setting.matmul["peak"]
    rows = [summarize(name, results[name], setting.flops, peaks, args.warmup_steps, size) for name in ran]
    report = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": setting.command,
        "machine": machine_info(args.gpu),
        "versions": {**versions, "transformers": transformers.__version__},
        "xla_flags": args.xla_flags,
        "schedule": rounds(ran, args.repeats),
        "workload": {
            "size": args.size,
            **size,
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "lr_warmup_steps": warmup_steps_for(args.steps),
            "repeats": args.repeats,
            "num_params": next((r["num_params"] for r in rows if "num_params" in r), 0),
            "masked_tokens": setting.masked_tokens,
            "flops_per_step": setting.flops,
            "learning_rate": LEARNING_RATE,
            "weight_decay": WEIGHT_DECAY,
            "config": setting.config,
        },
        "matmul": setting.matmul,
        "preprocessing": setting.preprocessing,
        "modes": rows,
        "inference": inference,
        "runtime_s": time.perf_counter() - setting.started,
    }
    report["goals"] = goals(rows, peaks, report["machine"])
    return report


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not args.output_dir:
        fail("--output_dir is required")
    check_counts(args)
    args.gpu = gpu_info()
    modes, size = resolve_args(args)
    out = Path(args.output_dir)
    work = Path(args.work_dir) if args.work_dir else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/run_benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.end_to_end:
        args.modes_e2e = modes
        args.eval_steps = args.eval_steps if args.eval_steps is not None else max(args.steps // 4, 1)
        return run_end_to_end(args, out, work, size, command)

    from tqdm import tqdm

    native_bf16 = bool(args.gpu) or not cpu_bf16()[1].startswith("none")
    # the matrix product in each framework the modes use (PyTorch/XLA's is not timed)
    used = {MODES[m].framework for m in modes}
    named = {"torch": "pytorch", "jax": "flax", "tensorflow": "tensorflow"}
    frameworks = [fw for fw, framework in named.items() if framework in used]
    total = 2 + len(frameworks) + 1 + len(modes) * args.repeats + (0 if args.no_inference else 2)
    bar = tqdm(total=total, desc="benchmark", unit="task")
    started = time.perf_counter()
    bar.set_postfix_str("corpus, tokenizer, config, preprocessing")
    config_dir, batches_path, preprocessing = prepare_data(work, args, size, bar)
    matmul = measure_matmul(args, frameworks, native_bf16, work, bar)
    init_dir = work / f"init-{args.size}"
    make_initial_weights(config_dir, init_dir, sorted(used), work, bar)
    config = json.loads((config_dir / "config.json").read_text())
    with np.load(batches_path) as batches:
        masked = float((batches["masked_labels"] != -100).sum() / batches["masked_labels"].shape[0])
    flops = model_flops_per_step(config, size["batch_size"], size["seq_len"], masked)
    setting = Setting(args, command, size, config, masked, flops, matmul, preprocessing, started)

    def write_partial(results, versions):  # what a run cut short (a device call's time limit) still leaves
        report = build_report(setting, modes, results, versions, {})
        report["partial"] = f"{sum(map(len, results.values()))} of {len(modes) * args.repeats} runs of the modes done"
        write_outputs(out, report, stem="partial")

    results, versions = train_modes(args, modes, config_dir, init_dir, batches_path, work, bar, write_partial)
    inference = {} if args.no_inference else run_inference(args, modes, native_bf16, work, bar)
    bar.close()
    report = build_report(setting, modes, results, versions, inference)
    write_outputs(out, report)
    for suffix in ("json", "md", "png"):
        (out / f"partial.{suffix}").unlink(missing_ok=True)
    print((out / "results.md").read_text())
    print(f"Wrote {out / 'results.md'}, results.json and results.png in {report['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
