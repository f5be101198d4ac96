"""--end_to_end: the training scripts themselves, run as a user would (flax/run_mlm_flax.py in fp32 and --dtype
bfloat16, pytorch/run_mlm.py eager and --bf16, pytorch/xla_spawn.py --num_cores 1, tensorflow/run_mlm.py in fp32 and
--bfloat16 after prepare_tfrecord_shards.py, whose time counts in TensorFlow's wall time) on the same text, tokenizer,
initial weights, sequence length, global batch, schedule and steps, each evaluating on the same held-out blocks every
--eval_steps: wall time of the whole command (the original README's table), training time, tokens/s, final eval loss
and accuracy (the scripts' own eval_results.json), peak RSS, the time each first reaches a target eval loss, and the
eval-loss curves by step and by wall-clock second (curves.png)."""

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.modes import E2E_MODES, LEARNING_RATE, WEIGHT_DECAY, warmup_steps_for
from benchmarks.runner import make_initial_weights
from benchmarks.workload import ROOT, machine_info, prepare_files


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
    framework, script = E2E_MODES[name].framework, list(E2E_MODES[name].command)
    common = {
        "--learning_rate": files["learning_rate"],
        "--warmup_steps": warmup_steps_for(args.steps),
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
        # The Trainer clips gradients at norm 1.0 by default; the Flax and TF scripts do not clip, so neither does it
        # here.
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
    framework, precision = E2E_MODES[name].framework, E2E_MODES[name].precision
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
    make_initial_weights(
        config_dir, files["init"], sorted({E2E_MODES[m].framework for m in args.modes_e2e}), work, bar
    )
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
    """results.json, results.md (end_to_end_table) and curves.png (the eval loss by step and by second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "results.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (out / "results.md").write_text("\n".join(end_to_end_table(report)) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in (r for r in report["end_to_end"]["modes"] if "eval_loss" in r):
        steps, losses, seconds = zip(*r["curve"], strict=True) if r["curve"] else ((), (), ())
        axes[0].plot(steps, losses, marker="o", label=r["mode"])
        axes[1].plot(seconds, losses, marker="o", label=r["mode"])
    for ax, xlabel in zip(axes, ("step", "seconds since launch"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss")
        ax.legend()
    fig.suptitle(f"RoBERTa {report['workload']['size']} MLM end to end, {report['machine']['cpu']}")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)


def end_to_end_table(report):
    """results.md's lines: the original README's table shape (a row per task, a column per mode), then a row a mode."""
    e2e, w, machine = report["end_to_end"], report["workload"], report["machine"]
    rows = e2e["modes"]
    warmup = warmup_steps_for(w["steps"])
    cell = {
        r["mode"]: minutes(r["wall_s"]) if "wall_s" in r else "skipped" if "skipped" in r else "failed" for r in rows
    }
    lines = [
        f"# MLM end to end: the real scripts, RoBERTa {w['size']} ({w['num_params'] / 1e6:.2f} M parameters)",
        "",
        f"{machine['cpu']} (bf16: {machine['bf16']}), {machine['cores']} cores; {report['date']}. "
        f"Command: `{report['command']}`. {w['steps']} steps of {w['batch_size']} x {w['seq_len']} tokens, learning "
        f"rate {w['learning_rate']} after {warmup} warm-up step{'s' * (warmup != 1)} with linear decay, no gradient "
        "clipping, the same initial weights, tokenizer, text and held-out blocks; evaluation every "
        f"{w['eval_steps']} steps. Wall time of each whole command:",
        "",
        "| task | " + " | ".join(cell) + " |",
        "| --- |" + " ---: |" * len(cell),
        "| MLM | " + " | ".join(cell.values()) + " |",
        "",
        "| mode | wall time | training (s) | tokens/s | eval loss | eval accuracy | time to target (s) "
        "| peak RSS (MB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "eval_loss" not in r:
            why = "skipped: " + r["skipped"] if "skipped" in r else "failed: " + r["error"]
            lines.append(f"| {r['mode']} | {why} |" + " |" * 6)
            continue
        reached = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "not reached"
        lines.append(
            f"| {r['mode']} | {minutes(r['wall_s'])} | {r['train_s']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{r['eval_loss']:.4f} | {100 * r['eval_accuracy']:.2f} % | {reached} | {r['peak_rss_mb']:,.0f} |"
        )
    if e2e["target_loss"] is None:
        lines += ["", "No mode finished."]
    else:
        given = " (given)" if report["target_given"] else " (the worst final eval loss)"
        lines += ["", f"Target eval loss: {e2e['target_loss']:.4f}{given}"]
    if e2e["parity_gap"]:
        gap, step = e2e["parity_gap"]
        lines.append(
            f"Largest gap between the eval-loss curves at a common step: {gap:.4f} (step {step}); each script masks "
            "with its own random draws, so the curves agree to that noise, not bitwise."
        )
    return lines


def run_end_to_end(args, out, work, size, command):
    from tqdm import tqdm

    started = time.perf_counter()
    bar = tqdm(total=2 + len(args.modes_e2e), desc="end to end", unit="task")
    bar.set_postfix_str("corpus, tokenizer, config")
    _, _, config_dir = prepare_files(work, args.size, size)
    bar.update(1)
    e2e = end_to_end(args, work, size, config_dir, bar)
    bar.close()
    config = json.loads((config_dir / "config.json").read_text())
    report = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": machine_info(args.gpu),
        "command": command,
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
