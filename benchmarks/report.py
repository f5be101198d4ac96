"""The step benchmark's report: results.json, results.md (the modes, the goals, the matrix-product peaks,
preprocessing, profiles, inference) and results.png; the same as partial.* while a run is under way."""

import json

import numpy as np

from benchmarks.measure import KERNEL_GROUPS
from benchmarks.stats import per_round
from benchmarks.workload import hardware

MEMORY = {"device_peak_mb": "peak device memory", "peak_rss_mb": "peak RSS"}


def write_outputs(out, report, stem="results"):
    """STEM.json, STEM.md (the tables) and STEM.png (the bar charts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    lines = modes_table(report) + other_tables(report)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot_modes(plt, out / f"{stem}.png", report)


def setting(report):
    """The lines under the title: the machine, the versions, the command and what the figures mean."""
    w = report["workload"]
    versions = ", ".join(f"{k} {v}" for k, v in sorted(report["versions"].items()))
    flags = f" Flax modes ran with XLA_FLAGS=`{report['xla_flags']}`." if report["xla_flags"] else ""
    timed = w["steps"] - w["warmup_steps"]
    return [
        f"{hardware(report['machine'])}; {report['date']}; {versions}.",
        f"Command: `{report['command']}`.{flags} {w['steps']} steps per mode, the first {w['warmup_steps']} untimed "
        f"(--warmup_steps: untimed steps; the learning rate warms up over {w['lr_warmup_steps']}); step time is the "
        f"median of the other {timed}.",
        "",
        f"Every row does the same work: the same weights, batches and loss (mean cross-entropy over the masked "
        f'tokens); rows whose head is "masked" compute the LM head at the masked positions only, as the loss needs, '
        f'and the reference rows ("all") at every position, as transformers\' models do. **Model FLOPs** a step, the '
        f"same for every row: {w['flops_per_step'] / 1e9:.1f} GFLOP (matrix products the loss needs: the encoder at "
        f"every token, the head at the {w['masked_tokens']:.1f} masked tokens of a step on average; x 3 for the "
        "backward); GFLOP/s and MFU are taken from it. **Executed** FLOPs are what the framework counted the row's "
        "step run (its matrix products, the head wherever it runs, the gathered head's empty slots, recomputation): "
        "HFU. " + peaks_sentence(report),
        "",
        f"Every mode ran {w['repeats']} time{'s' * (w['repeats'] != 1)}, interleaved (A B C A B C ...); step (ms) is "
        "the "
        "median over the repeats, with their range, then the quartiles of all timed steps [25 %-75 %]. Peak device "
        "memory: JAX's peak_bytes_in_use, torch's max_memory_allocated (GPU only).",
    ]


def modes_table(report):
    """results.md's title, the run's setting and the table of the modes: its lines."""
    w = report["workload"]
    title = f"# MLM training benchmark: RoBERTa {w['size']} ({w['num_params'] / 1e6:.2f} M parameters), batch "
    lines = [title + f"{w['batch_size']} x {w['seq_len']} tokens", ""]
    lines += [f"**Partial: {report['partial']}.**", ""] if "partial" in report else []
    lines += setting(report) + [""]
    lines += [
        "| mode | precision | how | head | first step (s) | step (ms), median (min-max) [quartiles] | tokens/s "
        "| model GFLOP/s | MFU | executed GFLOP a step | HFU | peak RSS (MB) | peak device memory (MB) "
        "| loss after last step |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["modes"]:
        if "step_ms" not in r:
            why = "skipped: " + r["skipped"] if "skipped" in r else "failed: " + r["error"]
            lines.append(f"| {r['mode']} | {r['precision']} | {r['what']} | {r['head']} | {why} |" + " |" * 9)
            continue
        products = f" ({r['products']} products)" if r.get("products", r["precision"]) != r["precision"] else ""
        device = f"{r['device_peak_mb']:,.0f}" if r.get("device_peak_mb") else "-"
        executed = f"{r['executed_flops'] / 1e9:,.1f}" if r.get("executed_flops") else "not counted"
        step = f"{r['step_ms']:,.1f} ({r['step_ms_range'][0]:,.1f}-{r['step_ms_range'][1]:,.1f}) "
        step += f"[{r['step_ms_quartiles'][0]:,.1f}-{r['step_ms_quartiles'][1]:,.1f}]"
        lines.append(
            f"| {r['mode']} | {r['precision']}{products} | {r['what']} | {r['head']} | {r['first_step_s']:.2f} | "
            f"{step} | {r['tokens_per_s']:,.0f} | {r['gflops']:.1f} | {utilization(r['mfu'])} | {executed} | "
            f"{utilization(r['hfu'])} | {r['peak_rss_mb']:,.0f} | {device} | {r['final_loss']:.4f} |"
        )
    return lines


def utilization(fraction):
    """A share of the peak; above 1 the measured peak was no peak, which the cell says rather than hide it."""
    if fraction is None:
        return "-"
    return f"{100 * fraction:.1f} %" + (" (above the measured peak: the probe fell short)" if fraction > 1 else "")


def peaks_sentence(report):
    """What MFU is measured against: the GPU's published peaks, or the matrix-product peak measured in this run."""
    published = report["matmul"].get("published")
    if published:
        peaks = ", ".join(f"{k} {v / 1000:.1f} TFLOP/s" for k, v in published.items())
        return f"MFU and HFU against the GPU's published dense peak for the precision of the row's products: {peaks}."
    peak, spread = report["matmul"]["peak"], []
    for precision, best in peak.items():  # the rounds of the framework that gave the peak
        frameworks = report["matmul"]["frameworks"].values()
        rounds = next(v.get(f"{precision}_rounds", [best]) for v in frameworks if v.get(precision) == best)
        spread.append(f"{precision} {best:.0f} GFLOP/s (its rounds' bests {min(rounds):.0f}-{best:.0f})")
    missing = "" if "bf16" in peak else "; bf16 not measured (no bf16 instructions: bf16 rows against the fp32 peak)"
    return (
        f"MFU and HFU against the matrix-product peak measured in this run ({report['matmul']['n']}², the best "
        f"framework; rounds of timed products until the two best agree within 10 %): {', '.join(spread)}{missing}."
    )


def other_tables(report):
    """results.md after the modes: the goals, the matrix-multiply peaks, preprocessing and inference; its lines."""
    lines = ["", "## Goals", "", *(f"- {goal}" for goal in report["goals"])]
    lines += ["", "## Matrix multiply (GFLOP/s, best of its rounds)", "", "| framework | fp32 | bf16 |"]
    lines += ["| --- | ---: | ---: |"]
    for fw, v in report["matmul"]["frameworks"].items():
        if "fp32" not in v:
            lines.append(f"| {fw} | failed: {v.get('error')} | |")
            continue
        bf16 = f"{v['bf16']:.0f}" if "bf16" in v else "not measured"
        lines.append(f"| {fw} | {v['fp32']:.0f} | {bf16} |")
    p = report["preprocessing"]
    lines += ["", f"## Preprocessing ({p['lines']:,} PTB lines, {p['tokens']:,} tokens)", ""]
    lines += ["| stage | seconds | tokens/s |", "| --- | ---: | ---: |"]
    lines.append(f"| tokenize | {p['tokenize_s']:.2f} | {p['tokenize_tokens_per_s']:,.0f} |")
    lines += [f"| group: {name} | {g['seconds']:.2f} | {g['tokens_per_s']:,.0f} |" for name, g in p["group"].items()]
    lines += profile_table(report["modes"])
    inference = report.get("inference") or {}
    if inference:
        lines += ["", f"## Inference: flax/run_bert_flax.py ({inference.get('setup', '')})", ""]
        lines += ["| precision | median call (s) | examples/s |", "| --- | ---: | ---: |"]
        for precision in ("float32", "bfloat16"):
            r = inference.get(precision, {})
            if "median_s" in r:
                lines.append(f"| {precision} | {r['median_s']:.3f} | {r['examples_per_second']:.1f} |")
            else:
                why = "skipped: " + r["skipped"] if "skipped" in r else f"failed: {r.get('error')}"
                lines.append(f"| {precision} | {why} | |")
    return lines


def profile_parts(profile):
    """A profiled step's parts, ms: the host's share (wall minus the device's busy time), then the kernel groups."""
    return {"host (wall - busy)": profile["wall_ms"] - profile["busy_ms"], **profile["groups_ms"]}


def profile_table(rows):
    """results.md's profile of the modes run with --profile_steps: where a step's time goes; its lines."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return []
    lines = [
        "",
        "## Where a profiled step's time goes (ms a step; --profile_steps more steps, after the timed ones)",
        "",
        "| mode | read | step wall | device busy | kernels a step | " + " | ".join(KERNEL_GROUPS) + " | other "
        "| top kernels |",
        "| --- | --- | ---: | ---: | ---: |" + " ---: |" * (len(KERNEL_GROUPS) + 1) + " --- |",
    ]
    for r in profiled:
        p = r["profile"]
        if "error" in p:
            lines.append(f"| {r['mode']} | failed: {p['error']} |" + " |" * (len(KERNEL_GROUPS) + 5))
            continue
        top = "; ".join(f"{name[:60]} {ms:.2f}" for name, ms, _ in p["top"][:3])
        groups = " | ".join(f"{ms:,.2f}" for ms in p["groups_ms"].values())
        lines.append(
            f"| {r['mode']} | {p['source']} | {p['wall_ms']:,.2f} | {p['busy_ms']:,.2f} | "
            f"{p['kernels_per_step']:,.0f} | {groups} | {top} |"
        )
    return lines


def plot_modes(plt, path, report):
    """results.png: tokens/s and MFU of the modes that ran, with their range over the repeats."""
    ok = [r for r in report["modes"] if "step_ms" in r]
    w = report["workload"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["mode"] for r in ok]
    palette = {"flax": "tab:blue", "tensorflow": "tab:green"}
    colors = [palette.get(r["framework"], "tab:orange") for r in ok]
    tokens = w["batch_size"] * w["seq_len"] * 1000
    # The range over the repeats; a range of zero (one repeat, or equal medians) may round a few ulps below zero.
    low = [r["tokens_per_s"] - tokens / r["step_ms_range"][1] for r in ok]
    high = [tokens / r["step_ms_range"][0] - r["tokens_per_s"] for r in ok]
    spread = np.maximum(np.array([low, high]).reshape(2, len(ok)), 0.0)
    axes[0].bar(names, [r["tokens_per_s"] for r in ok], yerr=spread, capsize=3, color=colors)
    axes[0].set_ylabel(f"training tokens/s (median, min-max of {w['repeats']})")
    scale = np.array([[100 * r["mfu"] / r["tokens_per_s"] for r in ok]])
    axes[1].bar(names, [100 * r["mfu"] for r in ok], yerr=spread * scale, capsize=3, color=colors)
    axes[1].set_ylabel("MFU, % of matmul peak (same precision)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_ha("right")
    fig.suptitle(f"RoBERTa {w['size']} MLM, batch {w['batch_size']} x {w['seq_len']}, {hardware(report['machine'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def goals(rows, peaks, machine):
    """The goals' lines: the ratios that answer the runtime question, each with its goal."""
    ok = {r["mode"]: r for r in rows if "step_ms" in r}
    gpu = machine.get("gpu")
    ran = f"the {len(ok)} modes that ran ({', '.join(ok) or 'none'})"
    out = [
        f"These ratios hold for this GPU ({gpu['name']}, driver {gpu['driver']}) and {ran}"
        if gpu
        else f"These ratios hold for this CPU class ({machine['cpu']}, bf16: {machine['bf16']}) and {ran}; CPUs with "
        "other bf16 support give other ratios."
    ]
    memory = "device_peak_mb" if gpu else "peak_rss_mb"
    ours, upstream = ok.get("flax_bf16"), ok.get("flax_model_bf16")
    if ours and upstream:
        out.append(
            f"Our --dtype bfloat16 (flax_bf16) vs upstream's meaning, the model's dtype (flax_model_bf16): step "
            f"{per_round(ours, upstream)}, {MEMORY[memory]} {ours[memory]:,.0f} / {upstream[memory]:,.0f} MB "
            "(goal: no slower, no larger: <= 1.0x both)"
        )
    same_work = {name: r for name, r in ok.items() if r["head"] == "masked"}  # the reference rows compare nothing
    flax = [r for r in same_work.values() if r["framework"] == "flax"]
    others = [r for r in same_work.values() if r["framework"] != "flax"]
    if flax and others:
        out += flax_goals(min(flax, key=lambda r: r["step_ms"]), others, peaks, gpu, memory)
    reference = ok.get("torch") or ok.get("flax")
    if reference:
        worst = max(ok.values(), key=lambda r: abs(r["final_loss"] - reference["final_loss"]))
        gap = abs(worst["final_loss"] - reference["final_loss"])
        out.append(
            f"Same work: loss after the last step differs from {reference['mode']}'s ({reference['final_loss']:.4f}) "
            f"by at most {gap:.4f} ({worst['mode']})"
        )
    out.append("MFU: " + ", ".join(f"{r['mode']} {100 * r['mfu']:.1f} %" for r in ok.values()))
    return out


def flax_goals(flax_best, others, peaks, gpu, memory):
    """Flax's fastest mode against the other frameworks' at the same work: speed, utilization, where its time goes
    (with --profile_steps) and memory."""
    fastest = min(others, key=lambda r: r["step_ms"])
    each = ", ".join(f"{r['mode']} {per_round(r, flax_best)}" for r in others)
    out = [
        f"Flax's fastest mode ({flax_best['mode']}, {flax_best['step_ms']:.1f} ms) vs the fastest other mode "
        f"({fastest['mode']}, {fastest['step_ms']:.1f} ms), the same work: {per_round(fastest, flax_best)} as fast, "
        "per round, median [min-max] (goal >= 1.0x)" + (f"; each other mode: {each}" if len(others) > 1 else "")
    ]
    peak_name = "bf16" if "bf16" in peaks else "fp32"
    peak = f"{peaks[peak_name] / 1000:.1f} TFLOP/s" if gpu else f"{peaks[peak_name]:.0f} GFLOP/s"
    where = f"{'published' if gpu else 'matmul'} peak ({peak})"
    out.append(
        f"Flax ({flax_best['mode']}) model FLOPs vs the {peak_name} {where}: "
        f"{100 * flax_best['gflops'] / peaks[peak_name]:.1f} % (goal >= {50 if gpu else 60} %)"
    )
    profiles = [r.get("profile", {}) for r in (flax_best, fastest)]
    if flax_best["step_ms"] > fastest["step_ms"] and all("busy_ms" in p for p in profiles):
        parts = [profile_parts(p) for p in profiles]
        worst = max(parts[0], key=lambda k: parts[0][k] - parts[1][k])
        lost = parts[0][worst] - parts[1][worst]
        verdict = (
            f"the most Flax loses: {worst}, {lost:.2f} ms"
            if lost > 0
            else "Flax's profiled step loses in no part (the profilers' overheads differ: compare the timed steps)"
        )
        out.append(
            f"Where Flax's time goes, per profiled step ({flax_best['mode']} vs {fastest['mode']}, ms): "
            + ", ".join(f"{k} {parts[0][k]:.2f} vs {parts[1][k]:.2f}" for k in parts[0])
            + f"; {verdict}"
        )
    torch_modes = [r for r in others if r["framework"].startswith("pytorch")]
    if torch_modes:
        torch_fastest = min(torch_modes, key=lambda r: r["step_ms"])
        out.append(
            f"Flax {MEMORY[memory]} vs PyTorch's fastest mode ({torch_fastest['mode']}): {flax_best[memory]:,.0f} / "
            f"{torch_fastest[memory]:,.0f} MB = {flax_best[memory] / torch_fastest[memory]:.2f}x (goal <= 1.0x)"
        )
    return out
