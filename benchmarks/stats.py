"""A mode's row from its repeats, and ratios between modes round by round."""

import numpy as np

from benchmarks.modes import MODES


def peak_for(products, precision, peaks):
    """The peak a row is measured against: that of the precision its products ran in (no bf16 peak: bf16 runs in
    f32 there, so fp32's)."""
    return peaks.get(products or precision) or peaks.get(precision) or peaks["fp32"]


def summarize(name, results, flops, peaks, warmup_steps, size):
    """One mode's row from its repeats: the median over repeats of each repeat's median step, with the range; MFU
    from the model FLOPs every row shares (`flops`), HFU from the FLOPs the row's framework counted it execute."""
    mode = MODES[name]
    row = {"mode": name, "framework": mode.framework, "precision": mode.precision, "what": mode.how, "head": mode.head}
    failed = next((r for r in results if "error" in r or "skipped" in r), None)
    if failed is not None:
        return {**row, **failed}
    peak = peak_for(results[0].get("products"), mode.precision, peaks)
    by_repeat = [1000 * float(np.median(r["times"][warmup_steps:])) for r in results]
    timed = 1000 * np.concatenate([r["times"][warmup_steps:] for r in results])
    step_s = float(np.median(by_repeat)) / 1000
    executed = results[0].get("executed_flops")
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
        gflops=flops / step_s / 1e9,
        peak_gflops=peak,
        mfu=flops / step_s / 1e9 / peak,
        hfu=executed / step_s / 1e9 / peak if executed else None,
        final_loss=results[0]["losses"][-1],
    )
    return row


def per_round(a, b):
    """a's step time over b's, round by round over the rounds both ran: 'median [min-max]'."""
    ratios = [x / y for x, y in zip(a["step_ms_by_repeat"], b["step_ms_by_repeat"], strict=False)]
    return f"{np.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
