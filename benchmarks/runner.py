"""The process runner: every measurement in a process of its own (fresh peak RSS, one framework imported), the
modes run --repeats times in interleaved rounds, the matrix-product peaks, the initial weights and the inference
benchmark (flax/run_bert_flax.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.measure import RESULT
from benchmarks.modes import MODES
from benchmarks.workload import ROOT, fail, gpu_peaks

HIDDEN = {"flax": ("USE_TF", "USE_TORCH"), "tensorflow": ("USE_TORCH", "USE_FLAX")}  # else torch's: TF and Flax


def run_worker(module, spec, work_dir, python=sys.executable, env=None, timeout=3600):
    """`python -m benchmarks.MODULE SPEC` from the repository's root: its result dict, or {"error": the last line
    of its output, "log_tail": the lines before}. A training worker's transformers sees its framework only."""
    path = Path(work_dir) / f"spec-{spec.get('mode', spec['kind'])}-{spec.get('framework', '')}.json"
    path.write_text(json.dumps(spec))
    full_env = {k: v for k, v in os.environ.items() if k not in ("USE_TF", "USE_TORCH", "USE_FLAX")}
    if module.startswith("worker_"):  # keep transformers from importing the other frameworks (time, peak RSS)
        framework = {"worker_flax": "flax", "worker_tf": "tensorflow"}.get(module)
        full_env.update({name: "0" for name in HIDDEN.get(framework, ("USE_TF", "USE_FLAX"))})
    full_env.update({"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    try:
        proc = subprocess.run(
            [python, "-m", f"benchmarks.{module}", str(path)],
            cwd=ROOT,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    lines = [line for line in (proc.stderr + proc.stdout).strip().splitlines() if line.strip()]
    return {"error": lines[-1][:300] if lines else f"exit {proc.returncode}", "log_tail": "\n".join(lines[-30:])}


MATMUL_WORKERS = {"torch": "worker_torch", "jax": "worker_flax", "tensorflow": "worker_tf"}


def measure_matmul(args, frameworks, native_bf16, work, bar):
    """The matrix-product GFLOP/s of every framework and the peak per precision, and on a GPU the published peaks
    (what MFU is taken against there): the report's "matmul"."""
    n = 1024 if args.quick else 8192 if args.gpu else 4096
    matmul = {}
    for fw in frameworks:
        bar.set_postfix_str(f"matmul {fw}")
        # without bf16 instructions, a bf16 product is no peak (PyTorch's 4096^2 one takes many minutes): fp32 only
        precisions = ["fp32", "bf16"] if native_bf16 else ["fp32"]
        spec = {"kind": "matmul", "framework": fw, "n": n, "reps": 5 if args.quick else 7, "precisions": precisions}
        res = run_worker(MATMUL_WORKERS[fw], spec, work)
        matmul[fw] = {k: v for k, v in res.items() if k.startswith(("fp32", "bf16", "error"))}
        bar.update(1)
    measured = [v for v in matmul.values() if "fp32" in v]
    if not measured:
        errors = "; ".join(f"{fw}: {v.get('error')}" for fw, v in matmul.items())
        fail(f"no framework could time a matrix product: {errors}")
    peaks = {p: max(v[p] for v in measured) for p in ("fp32", "bf16") if all(p in v for v in measured)}
    return {"n": n, "frameworks": matmul, "peak": peaks, "published": gpu_peaks(args.gpu)}


def make_initial_weights(config_dir, init_dir, frameworks, work, bar):
    """The initial weights every mode starts from, in each framework's format, in init_dir: drawn and converted on
    the host's CPU (XLA:GPU compiles a model's initialisation slowly)."""
    bar.set_postfix_str("initial weights")
    spec = {"kind": "init", "config_dir": str(config_dir), "init_dir": str(init_dir), "frameworks": frameworks}
    res = run_worker("weights", spec, work, env={"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    if "error" in res:
        fail(f"creating the initial weights failed: {res['error']}")
    bar.update(1)


def rounds(modes, repeats):
    """The order the modes run in: interleaved rounds (A B C A B C), so that drift hits all alike."""
    return [[r, name] for r in range(repeats) for name in modes]


def train_mode(args, name, spec, work):
    """One run of a mode in its worker: its result, or why it was skipped."""
    if name in args.skipped:
        return {"skipped": args.skipped[name]}
    if MODES[name].framework == "pytorch/xla":
        if not os.path.exists(args.xla_python):
            return {"skipped": f"no PyTorch/XLA environment at {args.xla_python} (bash run.sh setup-xla)"}
        return run_worker("worker_torch", spec, work, python=args.xla_python, env={"PJRT_DEVICE": "CPU"})
    env, python = None, sys.executable
    if MODES[name].framework == "flax":
        devices = f" --xla_force_host_platform_device_count={args.flax_devices}" if MODES[name].fsdp else ""
        env = {"XLA_FLAGS": (args.xla_flags + devices).strip()}
    if MODES[name].stack == "current":
        if not os.path.exists(args.current_python):
            return {"skipped": f"no venv of today's releases at {args.current_python} (bash run.sh test-current)"}
        python = args.current_python
    return run_worker(MODES[name].worker, spec, work, python=python, env=env)


def train_modes(args, modes, config_dir, init_dir, batches_path, work, bar, after_each):
    """Every mode --repeats times, interleaved round-robin, each in its own worker: their results and versions.
    after_each(results, versions) is called as each run ends."""
    results, versions = {name: [] for name in modes}, {}
    for round_index, name in rounds(modes, args.repeats):
        bar.set_postfix_str(f"{name} ({round_index + 1}/{args.repeats})")
        spec = {
            "kind": "train",
            "mode": name,
            "config_dir": str(config_dir),
            "init_dir": str(init_dir),
            "batches": str(batches_path),
            "profile_steps": args.profile_steps,
            "work_dir": str(work / name),
        }
        result = train_mode(args, name, spec, work)
        versions.update(result.get("versions", {}))
        results[name].append(result)
        if "times" in result:
            step_ms = 1000 * np.median(result["times"][args.warmup_steps :])
            bar.write(f"{name}: median step {step_ms:,.1f} ms, loss {result['losses'][-1]:.4f}")
        else:
            bar.write(f"{name}: {result.get('skipped') or 'failed: ' + result['error']}")
        bar.update(1)
        after_each(results, versions)
    return results, versions


def run_inference(args, modes, native_bf16, work, bar):
    """flax/run_bert_flax.py in float32 and bfloat16 (skipped on a CPU without bf16 instructions unless a bf16 mode
    was named): the report's "inference"."""
    if args.quick:
        tiny = "hidden_size=128,num_hidden_layers=2,num_attention_heads=2,intermediate_size=512"
        setup = ["--batch_size", "8", "--seq_length", "64", "--num_warmup", "1", "--num_iterations", "3"]
        setup += ["--config_overrides", tiny]
    else:
        setup = ["--num_warmup", "2", "--num_iterations", "10"]
    inference = {"setup": "tiny BERT, batch 8 x 64, 3 calls" if args.quick else "bert-base, batch 32 x 128, 10 calls"}
    bf16_asked = native_bf16 or any(MODES[m].precision == "bf16" for m in modes if m not in args.skipped)
    for precision in ("float32", "bfloat16"):
        bar.set_postfix_str(f"inference {precision}")
        if precision == "bfloat16" and not bf16_asked:
            why = "this CPU has no bf16 instructions; name a bf16 mode in --modes to run it anyway"
            inference[precision] = {"skipped": why}
        else:
            path = work / f"bert-{precision}.json"
            command = [sys.executable, "flax/run_bert_flax.py", "--precision", precision, "--output_file", str(path)]
            proc = subprocess.run([*command, *setup], cwd=ROOT, capture_output=True, text=True)
            if proc.returncode == 0 and path.is_file():
                inference[precision] = json.loads(path.read_text())
            else:
                inference[precision] = {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
        bar.update(1)
    return inference
