"""What every worker shares, importing no framework: the worker's protocol (a spec file in, one JSON line out), the
timed loop, the matrix-product peak and the profile's summary. A worker is `python -m benchmarks.worker_NAME SPEC`."""

import hashlib
import json
import re
import resource
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.workload import BATCH_KEYS

RESULT = "BENCHMARK_RESULT "
# A profiled step's kernels by group, from their names (on a CPU: XLA's ops, torch's aten ops); the first that matches.
KERNEL_GROUPS = {
    "matrix products": r"gemm|xmma|nvjet|cutlass|cublas|matmul|dot|ynn|aten::(add|b)?mm\b",
    "attention": r"flash|fmha|attention|sdpa",  # fused attention only: a softmax may be the loss's
    "copies": r"memcpy|memset|copy",
}


def worker_main(train, matmul_call):
    """A worker process: read the spec named on the command line, run its kind ("train": train(spec, batches);
    "matmul": the peak of matmul_call), print the result as one line."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec["kind"] == "matmul":
        result = matmul_peak(matmul_call, spec)
    else:
        with np.load(spec["batches"]) as data:
            batches = {k: data[k] for k in data.files}
        start = time.perf_counter()
        result = train(spec, batches)
        result["wall_s"] = time.perf_counter() - start
        result["data_sha256"] = data_digest(batches)
        result["batch_shape"] = list(batches["input_ids"].shape[1:])
        result["config"] = json.loads(Path(spec["config_dir"], "config.json").read_text())
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(RESULT + json.dumps(result))


def data_digest(batches):
    digest = hashlib.sha256()
    for key in BATCH_KEYS:
        digest.update(np.ascontiguousarray(batches[key]).tobytes())
    return digest.hexdigest()[:16]


def step_batch(batches, i, head):
    """Step i's batch as a mode feeds it: input_ids, attention_mask and the targets where its head runs, `labels`
    [rows, K] at `masked_positions` [rows, K] (head "masked"), or every position's `labels` [rows, length] ("all")."""
    batch = {k: batches[k][i] for k in ("input_ids", "attention_mask")}
    if head == "all":
        return {**batch, "labels": batches["labels"][i]}
    return {**batch, "labels": batches["masked_labels"][i], "masked_positions": batches["masked_positions"][i]}


def timed_loop(step_fn, batches, head):
    """Every batch through step_fn, which must return the loss as a Python float (so it waits for the device):
    the per-step wall times and losses."""
    times, losses = [], []
    for i in range(batches["input_ids"].shape[0]):
        batch = step_batch(batches, i, head)
        start = time.perf_counter()
        losses.append(step_fn(batch))
        times.append(time.perf_counter() - start)
    return times, losses


def matmul_peak(call, spec):
    """GFLOP/s of an n x n matrix product in each of spec's precisions: the best of rounds of `reps` timed calls
    (interference from elsewhere on the machine only slows a call down), until the two best rounds agree within
    10 % (at most 6 rounds); with the rounds' bests, the spread."""
    n, reps = spec["n"], spec["reps"]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    out = {}
    for precision in spec["precisions"]:
        run = call(precision, a, b)
        run()
        rounds = []
        while len(rounds) < 2 or (sorted(rounds)[-2] < 0.9 * max(rounds) and len(rounds) < 6):
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            rounds.append(2 * n**3 / min(times) / 1e9)
        out[precision] = max(rounds)
        out[f"{precision}_rounds"] = rounds
    return out


def profile_summary(kernels, steps, wall_s, source):
    """Where a step's time goes, from `steps` profiled steps: their wall time, the device's busy time (kernels summed;
    the rest is the host's: launches, Python, waiting), the kernels a step, the busy time by KERNEL_GROUPS and the
    top kernels. kernels: {name: [microseconds, calls]} over all the steps."""
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


def profiled(run, batches, steps, head, trace):
    """`steps` more steps of `run` (the first batches again) under `trace` (a worker's profiler, a context manager
    that fills {kernel: [us, calls]} and yields the list of what it read): where their time goes
    (profile_summary), or {"error": why} (a profile is a diagnosis: its failure costs the row nothing)."""
    kernels = {}
    try:
        with trace(kernels) as read:
            start = time.perf_counter()
            for i in range(steps):
                run(step_batch(batches, i, head))
            wall = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 (the profiler's own failure, reported in the row)
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    if not kernels:
        return {"error": f"the profile held no kernels (read: {', '.join(read) or 'nothing'})"}
    return profile_summary(kernels, steps, wall, ", ".join(read))
