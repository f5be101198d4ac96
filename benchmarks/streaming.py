#!/usr/bin/env python
"""Time to the first training step, peak memory and throughput of flax/run_mlm_flax.py with and without --streaming,
at the main job's settings (its model and tokenizer: run `bash run.sh main` first), on PTB's train split and on that
split repeated to --size_mb. Each run in its own process, one after the other.

  python benchmarks/streaming.py --size_mb 1024                        # streamed: the 5 MB split and a 1 GB file
  python benchmarks/streaming.py --size_mb 0 --max_steps 750 --in_memory   # the main job streamed and not: tokens/s
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def repeated_corpus(source, size_mb, path):
    """`source` written again and again into `path` until it holds size_mb MiB (kept for the next run)."""
    if not path.exists() or path.stat().st_size < size_mb * 2**20:
        text = source.read_bytes()
        with open(path, "wb") as f:
            for _ in range(-(-size_mb * 2**20 // len(text))):
                f.write(text)
    return path


def timed_run(train_file, streaming, args, output_dir):
    """One training run: seconds from start to the first logged step, peak resident MB and train tokens/s."""
    model = ROOT / "out" / "main" / "model"
    command = [sys.executable, str(ROOT / "flax" / "run_mlm_flax.py"), "--output_dir", str(output_dir)]
    command += ["--overwrite_output_dir", "--model_type", "roberta", "--config_name", str(model), "--tokenizer_name"]
    command += [str(model), "--train_file", str(train_file), "--max_seq_length", "64", "--per_device_train_batch_size"]
    command += ["64", "--learning_rate", "2e-3", "--warmup_steps", "100", "--weight_decay", "0.01", "--max_steps"]
    command += [str(args.max_steps), "--logging_steps", "1", "--save_steps", str(args.max_steps), "--do_train"]
    command += ["--report_to", "none"] + (["--streaming"] if streaming else [])
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size_mb", type=int, default=1024, help="The large file's size (0: none).")
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--in_memory", action="store_true", help="Also run each file without --streaming.")
    parser.add_argument("--output_dir", default=str(ROOT / "out" / "bench-streaming"))
    args = parser.parse_args(argv)
    out, ptb = Path(args.output_dir), ROOT / "data" / "ptb" / "train.txt"
    if not (ROOT / "out" / "main" / "model" / "config.json").is_file() or not ptb.is_file():
        sys.exit("streaming.py: error: needs the main job's data and model: run `bash run.sh main` first")
    out.mkdir(parents=True, exist_ok=True)
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
