#!/usr/bin/env python
"""Time to the first training step, peak memory and throughput of flax/run_mlm_flax.py with and without --streaming,
at the main job's settings (its model and tokenizer: run `bash run.sh main` first), on PTB's train split and on that
split repeated to --size_mb. Each run in its own process, one after the other.

  python benchmarks/streaming.py --size_mb 1024                        # streamed: the 5 MB split and a 1 GB file
  python benchmarks/streaming.py --size_mb 0 --max_steps 750 --in_memory   # the main job streamed and not: tokens/s
  python benchmarks/streaming.py --soak_minutes 60      # an hour streamed: RSS at every log line, SIGTERM, a resume
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def repeated_corpus(source, size_mb, path):
    """`source` written again and again into `path` until it holds size_mb MiB (kept for the next run)."""
    if not path.exists() or path.stat().st_size < size_mb * 2**20:
        text = source.read_bytes()
        with open(path, "wb") as f:
            for _ in range(-(-size_mb * 2**20 // len(text))):
                f.write(text)
    return path


def command_for(train_file, streaming, max_steps, logging_steps, save_steps, output_dir):
    """flax/run_mlm_flax.py at the main job's settings, without evaluation."""
    model = ROOT / "out" / "main" / "model"
    command = [sys.executable, str(ROOT / "flax" / "run_mlm_flax.py"), "--output_dir", str(output_dir)]
    command += ["--overwrite_output_dir", "--model_type", "roberta", "--config_name", str(model), "--tokenizer_name"]
    command += [str(model), "--train_file", str(train_file), "--max_seq_length", "64", "--per_device_train_batch_size"]
    command += ["64", "--learning_rate", "2e-3", "--warmup_steps", "100", "--weight_decay", "0.01", "--max_steps"]
    command += [str(max_steps), "--logging_steps", str(logging_steps), "--save_steps", str(save_steps), "--do_train"]
    return command + ["--report_to", "none"] + (["--streaming"] if streaming else [])


def timed_run(train_file, streaming, args, output_dir):
    """One training run: seconds from start to the first logged step, peak resident MB and train tokens/s."""
    command = command_for(train_file, streaming, args.max_steps, 1, args.max_steps, output_dir)
    started, first_step = time.perf_counter(), None
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:
        log.append(line)
        if first_step is None and f"Step 1/{args.max_steps}" in line:
            first_step = time.perf_counter() - started
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"streaming.py: error: the run on {train_file} failed:\n{''.join(log[-20:])}")
    results = json.loads((output_dir / "train_results.json").read_text())
    return {"first_step_s": first_step, "peak_rss_mb": usage.ru_maxrss / 1024, **results}


def resident_mb(pid):
    """The process's resident set now, in MiB (Linux's /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def logged_run(command, stop_after_s, stop_after_lines=None):
    """Run `command`, reading its resident MB at every "Step N/" line; SIGTERM it after stop_after_s seconds or
    stop_after_lines such lines. Returns (exit code, samples of (minutes, step, MB, tokens/s), the log)."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples, log, stopped = [], [], False
    for line in proc.stdout:
        log.append(line)
        if line.lstrip().startswith("Step ") and "/" in line.split()[1]:
            minutes = (time.perf_counter() - started) / 60
            speed = [f for f in line.split("|") if "tokens/s" in f]
            rate = float(speed[0].split()[0].replace(",", "")) if speed else float("nan")
            samples.append((minutes, int(line.split()[1].split("/")[0]), resident_mb(proc.pid), rate))
        due = time.perf_counter() - started >= stop_after_s
        if not stopped and (due or (stop_after_lines and len(samples) >= stop_after_lines)):
            proc.send_signal(signal.SIGTERM)
            stopped = True
    return proc.wait(), samples, log


def soak(args, out):
    """An hour (--soak_minutes) streamed at the main job's settings with a checkpoint every --save_steps, SIGTERM
    at the end, then a resume stopped after two log lines. Prints RSS's least-squares slope after warm-up and by
    quarter, throughput in the first and last quarter, and where the resume started; writes every sample to JSON."""
    command = command_for(ROOT / "data" / "ptb" / "train.txt", True, 10**6, 50, args.save_steps, out / "soak")
    code, samples, log = logged_run(command, args.soak_minutes * 60)
    if code != 128 + signal.SIGTERM or not samples:
        sys.exit(f"streaming.py: error: the soak ended with exit {code}:\n{''.join(log[-20:])}")
    saved = max(int(path.name.split("-")[1]) for path in (out / "soak").glob("checkpoint-*"))
    resumed = [a for a in command if a != "--overwrite_output_dir"] + ["--resume_from_checkpoint"]
    code, again, log = logged_run(resumed, float("inf"), stop_after_lines=2)
    start = next((line.split("Resuming at step ")[1].split()[0] for line in log if "Resuming at step" in line), None)
    if code != 128 + signal.SIGTERM or start is None:
        sys.exit(f"streaming.py: error: the resume ended with exit {code}:\n{''.join(log[-20:])}")
    minutes, steps, rss, rate = (np.array(column) for column in zip(*samples))
    warm = minutes >= args.warmup_minutes
    slope = np.polyfit(minutes[warm], rss[warm], 1)[0]
    quarters = np.minimum((4 * (minutes - minutes[0]) / (minutes[-1] - minutes[0])).astype(int), 3)
    by_quarter = [np.polyfit(minutes[quarters == q], rss[quarters == q], 1)[0] for q in range(4)]
    report = {
        "minutes": float(minutes[-1]),
        "last_step_logged": int(steps[-1]),
        "last_checkpoint": saved,
        "resumed_at_step": int(start),
        "resume_first_logged": again[0][1:] if again else None,
        "rss_mb_first": float(rss[0]),
        "rss_mb_at_warmup": float(rss[warm][0]),
        "rss_mb_last": float(rss[-1]),
        "rss_mb_max": float(rss.max()),
        "slope_mb_per_min_after_warmup": float(slope),
        "slope_mb_per_min_by_quarter": [float(b) for b in by_quarter],
        "tokens_per_s_first_quarter": float(np.nanmean(rate[quarters == 0])),
        "tokens_per_s_last_quarter": float(np.nanmean(rate[quarters == 3])),
        "samples": samples,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    print("".join(log[-3:]) + json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size_mb", type=int, default=1024, help="The large file's size (0: none).")
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--in_memory", action="store_true", help="Also run each file without --streaming.")
    parser.add_argument("--output_dir", default=str(ROOT / "out" / "bench-streaming"))
    parser.add_argument("--soak_minutes", type=float, default=0, help="Instead: a soak this long (see soak()).")
    parser.add_argument("--save_steps", type=int, default=1000, help="The soak's checkpoint interval.")
    parser.add_argument("--warmup_minutes", type=float, default=5, help="The soak's RSS slope starts here.")
    args = parser.parse_args(argv)
    out, ptb = Path(args.output_dir), ROOT / "data" / "ptb" / "train.txt"
    if not (ROOT / "out" / "main" / "model" / "config.json").is_file() or not ptb.is_file():
        sys.exit("streaming.py: error: needs the main job's data and model: run `bash run.sh main` first")
    out.mkdir(parents=True, exist_ok=True)
    if args.soak_minutes:
        return soak(args, out)
    files = [ptb] + ([repeated_corpus(ptb, args.size_mb, out / f"ptb_{args.size_mb}mb.txt")] if args.size_mb else [])
    rows = []
    for train_file in files:
        for streaming in (True, False) if args.in_memory else (True,):
            row = timed_run(train_file, streaming, args, out / "run")
            rows.append(
                {
                    "file": f"{train_file.name} ({train_file.stat().st_size / 2**20:,.0f} MB)",
                    "streaming": streaming,
                    **row,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.max_steps} steps at the main job's settings\n")
    print(
        "| train file | --streaming | first step after (s) | peak RSS (MB) | train tokens/s |\n|---|---|---|---|---|"
    )
    for row in rows:
        cells = (row["file"], row["streaming"], f"{row['first_step_s']:.1f}", f"{row['peak_rss_mb']:,.0f}")
        print("| " + " | ".join(map(str, cells)) + f" | {row['train_tokens_per_second']:,.0f} |")


if __name__ == "__main__":
    main()
