"""benchmarks/run_benchmark.py: the harness, not the speed (no timing assertions)."""

import ast
import json
import os
import sys

import pytest
from conftest import BENCHMARK_BATCH, ROOT, benchmark_work, check_ok, fake_devices, load_script, run

sys.path.insert(0, ROOT)  # the package benchmarks/, as run_benchmark.py and its workers see it
from benchmarks import measure, modes, report, runner, stats, workload  # noqa: E402

pytestmark = pytest.mark.usefixtures("optimised_xla")

XLA_PYTHON = os.environ.get("XLA_PYTHON", os.path.join(ROOT, ".venv-xla", "bin", "python"))


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/run_benchmark.py", "run_benchmark")


def test_model_flops_count_the_head_at_the_masked_tokens_only():
    """roberta-base, batch 8 x 128, 150 masked tokens. Per token, per layer: Q, K, V, output 4 x 2 x 768^2 =
    4,718,592; feed-forward 2 x 2 x 768 x 3072 = 9,437,184; scores and values 2 x 2 x 128 x 768 = 393,216; 12 layers:
    174,587,904, x 1,024 tokens = 178,778,013,696. LM head at the 150 masked tokens: (dense 2 x 768^2 = 1,179,648 +
    decoder 2 x 768 x 50,265 = 77,207,040) x 150 = 11,758,003,200. x 3 (forward + backward) = 571,608,050,688."""
    config = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "vocab_size": 50265}
    assert workload.model_flops_per_step(config, 8, 128, 150) == 571_608_050_688


def test_the_learning_rate_warms_up_over_a_tenth_of_the_steps():
    assert [modes.warmup_steps_for(n) for n in (5, 20, 300)] == [1, 2, 30]


def test_every_mode_is_a_named_record_and_computes_the_head_where_the_loss_needs_it():
    """The modes' head is the masked positions but for the labelled reference rows; each names its worker."""
    assert all(isinstance(m, modes.Mode) for m in modes.MODES.values())
    reference = [name for name, m in modes.MODES.items() if m.head == "all"]
    assert reference == ["flax_all_positions", "torch_all_positions", "tf_all_positions"]
    assert all(m.head == "masked" for name, m in modes.MODES.items() if name in modes.DEFAULT_MODES)
    assert {modes.MODES[m].worker for m in modes.MODES} == {"worker_flax", "worker_torch", "worker_tf"}


def test_each_worker_imports_only_its_framework_and_the_flax_one_writes_no_step():
    """One worker file a framework; the Flax rows take run_mlm_flax.py's build_train_state and make_train_step, so
    the worker computes no gradient and builds no optimizer of its own."""
    frameworks = {"worker_flax": {"jax", "flax"}, "worker_torch": {"torch"}, "worker_tf": {"tensorflow"}}
    for name, own in frameworks.items():
        tree = ast.parse(open(os.path.join(ROOT, "benchmarks", f"{name}.py")).read())
        imported = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        others = {"jax", "flax", "optax", "torch", "tensorflow"} - own
        assert not imported & others, (name, imported & others)
    source = open(os.path.join(ROOT, "benchmarks", "worker_flax.py")).read()
    assert "mlm.make_train_step(" in source and "mlm.build_train_state(" in source
    assert not any(word in source for word in ("value_and_grad", "jax.grad", "optax", "apply_gradients"))


def test_no_benchmark_file_is_over_400_lines():
    for name in os.listdir(os.path.join(ROOT, "benchmarks")):
        if name.endswith(".py"):
            lines = len(open(os.path.join(ROOT, "benchmarks", name)).read().splitlines())
            assert lines <= 400, f"benchmarks/{name}: {lines} lines"


def test_the_peak_is_timed_in_rounds_until_the_two_best_agree(monkeypatch):
    """A machine that slows a round down: rounds of timed products go on until the two best agree within 10 %
    (1.0 s, then 0.5 s: twice as fast, so one more round; 0.52 s agrees), and their bests are kept beside the peak."""
    clock = iter([0.0, 1.0, 0.0, 0.5, 0.0, 0.52, 0.0, 9.0])  # start and end of each timed call, one call a round
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(clock))
    peak = measure.matmul_peak(lambda precision, a, b: lambda: None, {"n": 10, "reps": 1, "precisions": ["fp32"]})
    assert peak["fp32_rounds"] == pytest.approx([2e-6, 4e-6, 2e-6 / 0.52]) and peak["fp32"] == pytest.approx(4e-6)


# /proc/cpuinfo's first block on the three kinds of CPU the project meets (flags cut to the ones that matter).
CPUINFO = {
    "AMX-BF16": ("Intel(R) Xeon(R) Platinum 8488C", "fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"),
    "AVX-512 BF16": ("AMD EPYC 9R14 96-Core Processor", "fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni"),
    "none, AVX2 only": ("AMD EPYC 7R13 Processor", "fpu sse2 avx avx2 fma"),
    "none": ("Some old CPU", "fpu sse2"),
}


@pytest.mark.parametrize("support", CPUINFO)
def test_cpu_bf16_reads_the_flags(support, tmp_path, monkeypatch):
    model, flags = CPUINFO[support]
    path = tmp_path / "cpuinfo"
    block = f"processor\t: {{}}\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    path.write_text(block.format(0) + "\n" + block.format(1).replace("amx_bf16", ""))
    monkeypatch.delenv("LM_CPU_BF16", raising=False)
    assert workload.cpu_bf16(str(path)) == (model, support)
    monkeypatch.setenv("LM_CPU_BF16", "1" if support.startswith("none") else "0")  # the override wins either way
    assert workload.cpu_bf16(str(path))[1] == (
        "native, LM_CPU_BF16=1" if support.startswith("none") else "none, LM_CPU_BF16=0"
    )


def test_cpu_bf16_elsewhere_and_a_bad_override(tmp_path, monkeypatch):
    monkeypatch.delenv("LM_CPU_BF16", raising=False)
    assert workload.cpu_bf16(str(tmp_path / "absent")) == ("unknown CPU", "unknown")
    monkeypatch.setenv("LM_CPU_BF16", "yes")
    with pytest.raises(SystemExit, match="LM_CPU_BF16 must be 1 .* or 0 .*, got 'yes'"):
        workload.cpu_bf16()


def test_bf16_modes_are_skipped_without_bf16_instructions_unless_named(monkeypatch, capsys):
    precisions = {m: modes.MODES[m].precision for m in modes.DEFAULT_MODES}
    monkeypatch.setenv("LM_CPU_BF16", "0")
    skipped = workload.slow_bf16(modes.DEFAULT_MODES, precisions, named=False)
    assert sorted(skipped) == ["flax_bf16", "tf_bf16", "torch_bf16"] and all(
        "name it in --modes" in r for r in skipped.values()
    )
    assert workload.slow_bf16(["torch", "torch_bf16"], precisions, named=True) == {}
    warning = capsys.readouterr().err.strip().splitlines()
    assert (
        len(warning) == 1
        and warning[0].startswith("warning: torch_bf16: this CPU")
        and "no bf16 instructions" in warning[0]
    )
    monkeypatch.setenv("LM_CPU_BF16", "1")
    assert workload.slow_bf16(modes.DEFAULT_MODES, precisions, named=False) == {}


@pytest.fixture(scope="module")
def quick(corpus, tmp_path_factory):
    """Every default mode once, on a CPU taken to have no bf16 instructions: the bf16 modes' rows say why they were
    skipped (and the run stays short on every machine). Repeats are tested without running anything (below)."""
    out = tmp_path_factory.mktemp("bench")
    benchmark_work(out, corpus, tmp_path_factory)
    result = check_ok(
        run(
            ["benchmarks/run_benchmark.py", "--quick", "--repeats", "1", *BENCHMARK_BATCH, "--output_dir", str(out)],
            env={"XLA_PYTHON": XLA_PYTHON, "LM_CPU_BF16": "0"},
            timeout=1800,  # beside another test worker on 2 cores: 3-4 minutes
        )
    )
    return out, json.loads((out / "results.json").read_text()), result


def test_quick_writes_table_json_and_plot(quick):
    out, report, _ = quick
    table = (out / "results.md").read_text()
    assert table.startswith("# MLM training benchmark: RoBERTa tiny") and "| mode | precision |" in table
    assert (
        report["machine"]["bf16"] == "none, LM_CPU_BF16=0" and "(bf16: none, LM_CPU_BF16=0)" in table.splitlines()[2]
    )
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["mode"] for r in report["modes"]] == modes.DEFAULT_MODES
    for row in report["modes"]:
        assert f"| {row['mode']} |" in table
    assert any(
        line.startswith("Flax's fastest mode") and "per round, median [min-max]" in line for line in report["goals"]
    )
    assert (
        report["goals"][0].startswith("These ratios hold for this CPU class")
        and "bf16: none, LM_CPU_BF16=0" in report["goals"][0]
    )
    assert any("model FLOPs vs the fp32 matmul peak" in line for line in report["goals"])
    # One definition of model FLOPs for every row (the head at the masked tokens); no utilization above the peak.
    ran = [r for r in report["modes"] if "step_ms" in r]
    w = report["workload"]
    assert w["flops_per_step"] == workload.model_flops_per_step(w["config"], 16, 32, w["masked_tokens"])
    assert 0 < w["masked_tokens"] < 0.2 * 16 * 32 and "**Model FLOPs** a step, the same for every row" in table
    for row in ran:
        # the model FLOPs credited a step (a rate times a time: no timing compared), and HFU over MFU: the FLOPs
        # the framework counted it execute over the model FLOPs
        assert row["head"] == "masked" and row["gflops"] * row["step_ms"] == pytest.approx(w["flops_per_step"] / 1e6)
        if row["hfu"] is not None:
            assert row["hfu"] / row["mfu"] == pytest.approx(row["executed_flops"] / w["flops_per_step"]), row["mode"]
    assert report["matmul"]["peak"]["fp32"] > 0 and "bf16" not in report["matmul"]["peak"]  # no bf16 product timed
    groups = report["preprocessing"]["group"]
    assert set(groups) == {"group_texts (linear)", "sum(lists, []) (upstream)"}
    assert (
        "median_s" in report["inference"]["float32"]
        and "no bf16 instructions" in report["inference"]["bfloat16"]["skipped"]
    )
    assert "| bfloat16 | skipped: this CPU has no bf16 instructions" in table


def test_every_installed_framework_ran(quick):
    out, report, _ = quick
    rows = {r["mode"]: r for r in report["modes"]}
    for mode in ("flax", "torch", "torch_compile", "tf", "tf_xla"):
        assert "step_ms" in rows[mode], rows[mode].get("error") or rows[mode].get("log_tail")
        assert 0 < rows[mode]["mfu"] and rows[mode]["peak_rss_mb"] > 0
    for mode in ("flax_bf16", "torch_bf16", "tf_bf16"):
        assert (
            "no bf16 instructions" in rows[mode]["skipped"]
            and f"| {mode} | bf16 |" in (out / "results.md").read_text()
        )
    if os.path.exists(XLA_PYTHON) or os.environ.get("CI"):
        assert "step_ms" in rows["torch_xla"], rows["torch_xla"]
    else:
        assert "setup-xla" in rows["torch_xla"]["skipped"]


def test_every_framework_did_the_same_work(quick):
    """What each framework itself computed shows the same work: the parameters it counts in its model, its loss at
    every step (same starting weights, same batches: agreeing to numerical noise), and the matrix products it counted
    itself executing (Flax: the script's step as traced; PyTorch: its flop counter; TensorFlow: its registered FLOPs
    of the step's graph). (The batches' digest, shape and config each worker reports are read from the one file every
    worker reads: they cannot differ.)"""
    out, report, _ = quick
    ran = [r for r in report["modes"] if "step_ms" in r]
    assert {"flax", "torch", "torch_compile", "tf", "tf_xla"} <= {r["mode"] for r in ran}
    first = ran[0]
    for row in ran[1:]:
        assert row["num_params"] == first["num_params"]
        assert len(row["losses"]) == len(first["losses"]) == report["workload"]["steps"]
        # Same initial weights and batch in other kernels: float32 sums in other orders (about 1e-6 of a loss of 7).
        assert row["losses"][0] == pytest.approx(first["losses"][0], abs=2e-3)
        # After the Adam steps too: a weight whose gradient is within rounding of zero may step the other way, which
        # changes the loss by that near-zero gradient times the step.
        assert row["final_loss"] == pytest.approx(first["final_loss"], abs=1e-2)
    assert first["losses"][-1] < first["losses"][0]
    # Each framework's own count against the products of the step by hand: TensorFlow's graph, with XLA or without,
    # to the FLOP; PyTorch's counter lacks the attention's products (it has no formula for the CPU's fused kernel,
    # aten._scaled_dot_product_flash_attention_for_cpu); the script's step (Flax) also runs the head's dense (h x h)
    # at the other positions (capture_head gathers at the decoder) and multiplies the attention weights by
    # transformers' head mask of ones (an einsum over nothing contracted: 2 FLOPs an element), forward and backward.
    rows, size = {r["mode"]: r for r in ran}, sizes(out, report["workload"])
    assert rows["tf"]["executed_flops"] == rows["tf_xla"]["executed_flops"] == step_flops(size)
    assert rows["torch"]["executed_flops"] == step_flops(size) - step_flops(size, attention_only=True)
    head_mask = size["layers"] * 2 * 2 * size["rows"] * size["heads"] * size["length"] ** 2
    extra = head_flops(out, report["workload"], decoder=False) + head_mask
    assert rows["flax"]["executed_flops"] == step_flops(size) + extra


def sizes(out, workload):
    """The batches' (rows a step, length L, masked slots K a row) and the model's sizes."""
    import numpy as np

    with np.load(next((out / "work").glob("batches-*.npz"))) as batches:
        _, rows, length, slots = *batches["input_ids"].shape, batches["masked_positions"].shape[-1]
    c = workload["config"]
    assert (rows, length) == (16, 32) and 0 < slots < length
    names = ("hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    h, v, i, layers, heads = (c[name] for name in names)
    return dict(rows=rows, length=length, slots=slots, h=h, v=v, i=i, layers=layers, heads=heads)


def step_flops(size, head="masked", attention_only=False):
    """The matrix products of one step by hand, 2 FLOPs a multiply-add, x 3 (forward, and backward to inputs and
    weights): a layer's Q, K, V and output (h x h), feed-forward (h x I, I x h) and attention (the scores and their
    weighted sum, L x h a position each), at every position; the head's dense (h x h) and decoder (h x V) at the K
    masked slots a row (or, head="all", every position)."""
    rows, length, h = size["rows"], size["length"], size["h"]
    attention = size["layers"] * rows * length * 2 * 2 * length * h
    if attention_only:
        return 3 * attention
    layers = size["layers"] * rows * length * (4 * 2 * h * h + 2 * 2 * h * size["i"]) + attention
    positions = length if head == "all" else size["slots"]
    return 3 * (layers + rows * positions * (2 * h * h + 2 * h * size["v"]))


def head_flops(out, workload, dense=True, decoder=True):
    """The FLOPs the head at every position executes beyond the head at the masked slots, by hand: the dense (h x h,
    unless dense=False) and decoder (h x V, unless decoder=False) products, 2 FLOPs a multiply-add, x 3 (forward, and
    backward to inputs and weights), at rows x (L - K) more positions (K: the masked slots a row, the batches'
    masked_positions width)."""
    size = sizes(out, workload)
    h, positions = size["h"], size["rows"] * (size["length"] - size["slots"])
    return 3 * (2 * h * h * dense + 2 * h * size["v"] * decoder) * positions


@pytest.fixture(scope="module")
def gpu_modes(corpus, tmp_path_factory):
    """`--modes gpu`, the command benchmarks/gpu.sh runs on a GPU, here on the CPU with the tiny model."""
    out = tmp_path_factory.mktemp("bench-gpu")
    benchmark_work(out, corpus, tmp_path_factory)
    args = ["--modes", "gpu", "--quick", "--repeats", "1", "--steps", "3", "--warmup_steps", "1", "--no_inference"]
    args += ["--profile_steps", "2"]
    check_ok(run(["benchmarks/run_benchmark.py", *args, *BENCHMARK_BATCH, "--output_dir", str(out)], timeout=1800))
    return out, json.loads((out / "results.json").read_text())


def test_the_gpu_modes_run_here_on_the_same_work_and_bf16_takes_effect(gpu_modes):
    """Every GPU mode ran from the same weights on the same batches; no TensorFlow is needed (the GPU machines have
    none): no TF weights, no TF matrix product. Each bf16 mode's first loss differs from its framework's fp32 one
    (a mode that ignored bf16 would run fp32's program and give its loss bit for bit), yet by rounding only."""
    out, report = gpu_modes
    rows = {r["mode"]: r for r in report["modes"]}
    assert list(rows) == modes.GPU_MODES and all("step_ms" in r for r in rows.values()), rows
    assert len({(r["data_sha256"], r["num_params"]) for r in rows.values()}) == 1
    assert set(report["matmul"]["frameworks"]) == {"torch", "jax"} and report["matmul"]["published"] == {}
    assert sorted(p.name for p in (out / "work" / "init-tiny").iterdir()) == ["flax", "pytorch"]
    for mode, fp32 in (("flax_bf16", "flax"), ("flax_model_bf16", "flax"), ("torch_bf16", "torch")):
        first, reference = rows[mode]["losses"][0], rows[fp32]["losses"][0]
        # bf16 operands: 2**-9 relative each, summed over a loss of about 9 (the existing 2e-3 between frameworks)
        assert first != reference and first == pytest.approx(reference, abs=2e-3), mode
    assert rows["torch_compile_bf16"]["losses"][0] == pytest.approx(rows["torch"]["losses"][0], abs=2e-3)
    assert rows["flax"]["products"] == "fp32" and rows["flax_model_bf16"]["products"] == "bf16"
    # transformers' head at every position: the same loss, more products executed, the same model FLOPs credited
    # (a worker that ignored `head` would execute the same products): by hand, the head's dense (h x h) and decoder
    # (h x V) products, x 3 (forward and backward), at the positions that are not masked slots, rows x (L - K).
    reference, ours = rows["torch_all_positions"], rows["torch"]
    assert reference["head"] == "all" and reference["losses"] == pytest.approx(ours["losses"], abs=2e-3)
    assert reference["executed_flops"] - ours["executed_flops"] == head_flops(out, report["workload"])
    credited = [row["gflops"] * row["step_ms"] for row in (reference, ours)]  # a rate x a time: no timing compared
    assert credited == pytest.approx([report["workload"]["flops_per_step"] / 1e6] * 2)
    assert any(g.startswith("Our --dtype bfloat16 (flax_bf16) vs upstream's meaning") for g in report["goals"])


def test_the_flax_worker_runs_the_scripts_step_and_its_head_takes_effect(gpu_modes, tmp_path, monkeypatch):
    """benchmarks/worker_flax.py in this process, on 2 of gpu_modes' batches from its initial weights: it builds its
    step with run_mlm_flax.py's make_train_step (patched here, counted) once a run and calls that step once a batch;
    its head "all" gives the same losses as "masked" and executes the decoder's products at rows x (L - K) more
    positions, by hand (head_flops; run_mlm_flax.py's capture_head gathers the decoder's input only, so the head's
    dense h x h runs at every position in both)."""
    import numpy as np

    from benchmarks import worker_flax

    out, report = gpu_modes
    with np.load(next((out / "work").glob("batches-*.npz"))) as data:
        batches = {k: data[k][:2] for k in data.files}
    load, made, calls = worker_flax.load_script, [], []

    def counted_script(path):
        script = load(path)
        make = script.make_train_step

        def make_train_step(*args, **kwargs):
            step = make(*args, **kwargs)
            made.append(step)
            counted = lambda *a, **k: calls.append(1) or step(*a, **k)  # noqa: E731
            counted.trace = step.trace
            return counted

        script.make_train_step = make_train_step
        return script

    monkeypatch.setattr(worker_flax, "load_script", counted_script)
    results = {}
    for mode in ("flax", "flax_all_positions"):
        spec = {"mode": mode, "init_dir": str(out / "work" / "init-tiny"), "work_dir": str(tmp_path / mode)}
        results[mode] = worker_flax.train({**spec, "profile_steps": 0}, batches)
    assert len(made) == 2 and len(calls) == 4  # one step built a run, called once a batch
    masked, everywhere = results["flax"], results["flax_all_positions"]
    assert everywhere["losses"] == pytest.approx(masked["losses"], abs=1e-5)
    assert everywhere["executed_flops"] - masked["executed_flops"] == head_flops(out, report["workload"], dense=False)


def test_each_gpu_mode_profiles_where_its_step_goes(gpu_modes):
    """--profile_steps 2: each row's profile read its framework's profiler (here XLA:CPU's ops, torch's aten ops),
    found matrix products, and its groups add up to the busy time; the table is written, the partial one removed."""
    out, report = gpu_modes
    for row in report["modes"]:
        profile = row["profile"]
        assert profile["steps"] == 2 and profile["groups_ms"]["matrix products"] > 0, (row["mode"], profile)
        assert sum(profile["groups_ms"].values()) == pytest.approx(profile["busy_ms"]) and profile["wall_ms"] > 0
        assert ("PjRtCpuClient" if row["framework"] == "flax" else "aten ops") in profile["source"]
    assert "## Where a profiled step's time goes" in (out / "results.md").read_text()
    assert not list(out.glob("partial.*"))


def test_a_gpu_row_is_measured_against_the_published_peak_of_its_products():
    """On a GPU, MFU is taken against NVIDIA's published dense peak for the precision the products ran in (JAX's
    f32 products run in TF32 there), the table names it and the device's peak memory, and the goals speak of the
    GPU."""
    gpu = {"name": "NVIDIA H200", "driver": "580.159.04", "memory": "143771 MiB", "count": 1}
    peaks = workload.gpu_peaks(gpu)
    assert peaks == {"bf16": 989_400.0, "tf32": 494_700.0, "fp32": 66_900.0}
    assert workload.gpu_peaks({**gpu, "name": "NVIDIA H200 NVL"})["bf16"] == 835_500.0
    assert workload.gpu_peaks({**gpu, "name": "Tesla T4"}) == {} and workload.gpu_peaks(None) == {}
    worker = {"losses": [9.0, 8.0], "peak_rss_mb": 900.0, "device_peak_mb": 20_000.0, "times": [9.0, 0.1, 0.1]}
    size = {"batch_size": 128, "seq_len": 128}
    rows = [
        stats.summarize(mode, [{**worker, "products": products}], 49_470e9, peaks, 1, size)
        for mode, products in (("flax", "tf32"), ("torch", "fp32"), ("flax_bf16", "bf16"))
    ]
    assert [round(r["mfu"], 3) for r in rows] == [1.0, round(494.7 / 66.9, 3), 0.5]
    machine = {**workload.machine_info(gpu), "cpu": "Some CPU", "bf16": "none", "cores": 16}
    assert (
        workload.hardware(machine)
        == "NVIDIA H200 (driver 580.159.04, 143771 MiB); host: Some CPU (bf16: none), 16 cores"
    )
    run_report = {
        "machine": machine,
        "workload": {
            "size": "base",
            "num_params": 125e6,
            **size,
            "steps": 3,
            "warmup_steps": 1,
            "repeats": 1,
            "lr_warmup_steps": 1,
            "masked_tokens": 2500.0,
            "flops_per_step": 49_470e9,
        },
        "date": "today",
        "versions": {},
        "command": "c",
        "xla_flags": "",
        "modes": rows,
        "matmul": {"n": 8192, "peak": {"fp32": 1.0}, "published": peaks},
    }
    table = "\n".join(report.modes_table(run_report))
    assert "| flax | fp32 (tf32 products) |" in table and "| 20,000 | 8.0000 |" in table
    assert "(above the measured peak: the probe fell short)" in table  # torch's f32 products credited as fp32
    assert "published dense peak" in table and "bf16 989.4 TFLOP/s" in table
    goals = report.goals(rows, peaks, machine)
    assert goals[0].startswith("These ratios hold for this GPU (NVIDIA H200, driver 580.159.04)")
    assert any("model FLOPs vs the bf16 published peak (989.4 TFLOP/s): 50.0 % (goal >= 50 %)" in g for g in goals)
    assert any(g.startswith("Flax peak device memory vs PyTorch's fastest mode (torch)") for g in goals)


def test_a_profile_groups_a_gpus_kernels_and_says_where_flax_loses():
    """Kernels named as CUPTI names them (cuBLAS, flash attention, a copy, an XLA fusion) fall in their groups, per
    step; where Flax's fastest mode is slower, the goals compare its parts with the fastest mode's, the host's share
    (wall minus busy) included, and name the part Flax loses most in."""
    kernels = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": [6000.0, 90],
        "nvjet_tst_128x256_64x4_2x1_v_bz_TNT": [1500.0, 30],
        "flash_fwd_kernel": [900.0, 36],
        "Memcpy HtoD (Pageable -> Device)": [30.0, 3],
        "loop_add_fusion": [1200.0, 300],
    }
    ours = measure.profile_summary(kernels, 3, 0.015, "Stream #13")
    assert ours["groups_ms"] == pytest.approx({"matrix products": 2.5, "attention": 0.3, "copies": 0.01, "other": 0.4})
    assert ours["busy_ms"] == pytest.approx(3.21) and ours["wall_ms"] == pytest.approx(5.0)
    assert ours["kernels_per_step"] == 153 and ours["top"][0][:2] == [next(iter(kernels)), 2.0]
    theirs = measure.profile_summary({"ampere_bf16_s16816gemm": [7500.0, 60]}, 3, 0.009, "CUDA kernels")
    size, peaks = {"batch_size": 128, "seq_len": 128}, {"bf16": 1e6, "fp32": 1e5}
    worker = {"losses": [9.0, 8.0], "peak_rss_mb": 900.0, "device_peak_mb": 9e3, "products": "bf16"}
    rows = [
        stats.summarize("flax_bf16", [{**worker, "times": [9.0, 0.005], "profile": ours}], 1e12, peaks, 1, size),
        stats.summarize("torch_bf16", [{**worker, "times": [9.0, 0.003], "profile": theirs}], 1e12, peaks, 1, size),
    ]
    where = next(g for g in report.goals(rows, peaks, {"gpu": {"name": "H200", "driver": "1"}}) if "goes" in g)
    assert "host (wall - busy) 1.79 vs 0.50" in where and "matrix products 2.50 vs 2.50" in where
    assert where.endswith("the most Flax loses: host (wall - busy), 1.29 ms")
    table = "\n".join(report.profile_table(rows))
    assert "| flax_bf16 | Stream #13 | 5.00 | 3.21 | 153 | 2.50 | 0.30 | 0.01 | 0.40 | sm90_xmma" in table


def test_a_cut_run_leaves_its_finished_modes_in_partial_files_and_a_rerun_finishes(bench, tmp_path, monkeypatch):
    """Real workers at the tiny size, --repeats 2: a run cut short (a device call's time limit) in its fifth run
    leaves partial.{md,json,png} of the four that ended, through the real summary, goals and plot, with unequal
    repeat counts (flax twice, torch and the reference row once) and ranges of zero; the finished rerun writes
    results.* and removes them; TensorFlow's head at every position counts the step's products by hand."""
    real, runs, medians = runner.run_worker, [], {}

    def worker(module, spec, *args, **kwargs):
        if spec["kind"] == "train":
            runs.append(spec["mode"])
            if len(runs) == 5:
                raise KeyboardInterrupt  # the call's time limit, in torch's second run
        result = real(module, spec, *args, **kwargs)
        if spec["kind"] == "train":  # each run's median step after its 1 warm-up step, in ms, by hand
            times = sorted(result["times"][1:])
            medians.setdefault(spec["mode"], []).append(1000 * (times[0] + times[1]) / 2)
        return result

    monkeypatch.setattr(runner, "run_worker", worker)
    argv = ["--quick", "--modes", "flax,torch,tf_all_positions", "--repeats", "2", "--steps", "3", "--warmup_steps"]
    argv += ["1", "--no_inference", *BENCHMARK_BATCH, "--output_dir", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    partial = (tmp_path / "partial.md").read_text()
    assert "**Partial: 4 of 6 runs of the modes done.**" in partial and not (tmp_path / "results.md").exists()
    rows = {r["mode"]: r for r in json.loads((tmp_path / "partial.json").read_text())["modes"]}
    assert {name: r["repeats"] for name, r in rows.items()} == {"flax": 2, "torch": 1, "tf_all_positions": 1}
    # Each row holds its own runs (flax's two, in order), its step the median of their medians (of two: the mean),
    # its range theirs; torch's one run, a range of zero.
    for name, row in rows.items():
        assert row["step_ms_by_repeat"] == pytest.approx(medians[name], rel=1e-12), name
        assert row["step_ms"] == pytest.approx(sum(medians[name]) / len(medians[name]), rel=1e-12), name
        assert row["step_ms_range"] == pytest.approx([min(medians[name]), max(medians[name])], rel=1e-12), name
    assert (
        len(medians["flax"]) == 2 and rows["flax"]["times_by_repeat"][1][1:] != rows["flax"]["times_by_repeat"][0][1:]
    )
    assert "| tf_all_positions | fp32 | as tf, head at every position | all |" in partial
    assert any(line.startswith("- Flax's fastest mode (flax") for line in partial.splitlines())
    bench.main(argv)
    assert "| torch | fp32 |" in (tmp_path / "results.md").read_text() and not list(tmp_path.glob("partial.*"))
    rows = {r["mode"]: r for r in json.loads((tmp_path / "results.json").read_text())["modes"]}
    assert all(r["repeats"] == 2 for r in rows.values())
    assert rows["tf_all_positions"]["final_loss"] == pytest.approx(rows["flax"]["final_loss"], abs=1e-2)
    # TensorFlow's head at every position, by its own count: the step's products by hand with the head everywhere
    size = sizes(tmp_path, json.loads((tmp_path / "results.json").read_text())["workload"])
    assert rows["tf_all_positions"]["executed_flops"] == step_flops(size, head="all")


def test_three_repeats_cut_at_any_run_report_through_the_real_summary_goals_and_plot(bench, tmp_path):
    """--repeats 3 cut after every run of the schedule: each prefix (counts 3/2/2, 1/1/0, ...) is summarized,
    compared per round and written (markdown, JSON, plot), the finished one with three repeats a mode. Every round's
    median step differs (flax 100, 120, 140 ms; torch 130, 160, 190; tf_all_positions 200, 170, 140): at the cut
    3/2/2 the medians, ranges and per-round ratios are those computed by hand."""
    modes_run = ["flax", "torch", "tf_all_positions"]
    schedule = runner.rounds(modes_run, 3)
    size = {"batch_size": 16, "seq_len": 32}
    matmul = {"n": 4, "frameworks": {"jax": {"fp32": 100.0, "fp32_rounds": [99.0, 100.0]}}, "peak": {"fp32": 100.0}}
    args = bench.build_parser().parse_args(["--output_dir", str(tmp_path), "--repeats", "3", "--steps", "4"])
    args.gpu = None
    args.size = "tiny"
    args.warmup_steps = 1
    preprocessing = {"lines": 1, "tokens": 1, "tokenize_s": 1.0, "tokenize_tokens_per_s": 1.0, "group": {}}
    setting = bench.Setting(
        args=args,
        command="command",
        size=size,
        config={},
        masked_tokens=10.0,
        flops=10**9,
        matmul={**matmul, "published": {}},
        preprocessing=preprocessing,
        started=0.0,
    )
    results = {name: [] for name in modes_run}
    for cut, (round_index, name) in enumerate(schedule, 1):
        step = {"flax": 0.1 + 0.02 * round_index, "torch": 0.13 + 0.03 * round_index}.get(
            name, 0.2 - 0.03 * round_index
        )
        times = [1.0, step + 0.001, step, step - 0.001]  # a first step (not timed), then a median of `step`
        results[name].append({"times": times, "losses": [9.0, 8.5], "peak_rss_mb": 10.0, "num_params": 5})
        run_report = bench.build_report(setting, modes_run, results, {}, {})
        report.write_outputs(tmp_path, run_report, stem=f"cut{cut}")
        assert [r["repeats"] for r in run_report["modes"]] == [len(results[m]) for m in modes_run if results[m]]
        if cut == 7:  # 3/2/2
            rows = {r["mode"]: r for r in run_report["modes"]}
            expected = {"flax": [100, 120, 140], "torch": [130, 160], "tf_all_positions": [200, 170]}
            for name, by_repeat in expected.items():
                assert rows[name]["step_ms_by_repeat"] == pytest.approx(by_repeat), name
                assert rows[name]["step_ms_range"] == pytest.approx([min(by_repeat), max(by_repeat)]), name
            assert [rows[name]["step_ms"] for name in expected] == pytest.approx([120, 145, 185])
            # per round, torch's over flax's in rounds 1 and 2: 130/100 = 1.30, 160/120 = 1.33, median 1.32 (the
            # reference row, tf_all_positions, is no comparison: another head)
            line = next(goal for goal in run_report["goals"] if goal.startswith("Flax's fastest mode"))
            assert (
                "(flax, 120.0 ms) vs the fastest other mode (torch, 145.0 ms), the same work: 1.32x [1.30-1.33]"
                in line
            ), line
    assert all(r["repeats"] == 3 for r in run_report["modes"]) and (tmp_path / "cut9.png").is_file()
    assert [r["step_ms"] for r in run_report["modes"]] == pytest.approx([120, 160, 170])
    assert any("per round" in goal for goal in run_report["goals"])


def test_a_range_of_zero_plots(tmp_path):
    """One repeat (or equal medians): the range's lower error, a few ulps below zero in floats, plots as zero."""
    worker = {"losses": [9.0, 8.0], "peak_rss_mb": 100.0, "times": [1.0, 0.13]}
    size = {"batch_size": 16, "seq_len": 32}
    row = stats.summarize("flax", [worker], 1e9, {"fp32": 100.0}, 1, size)
    assert row["tokens_per_s"] - 16 * 32 * 1000 / row["step_ms_range"][1] < 0  # what the plot is given
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    machine = {"cpu": "c", "bf16": "b", "cores": 2}
    one = {"modes": [row], "workload": {**size, "size": "tiny", "repeats": 1}, "machine": machine}
    report.plot_modes(plt, tmp_path / "r.png", one)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_repeats_are_interleaved_with_their_spread():
    """--repeats 2: every mode runs twice, round-robin (A B C A B C), and its row gives the median over repeats of
    each repeat's median step, with the range, per-round ratios and the table's "median (min-max)"."""
    assert runner.rounds(["a", "b", "c"], 2) == [[0, "a"], [0, "b"], [0, "c"], [1, "a"], [1, "b"], [1, "c"]]
    size = {"batch_size": 8, "seq_len": 16}
    worker = {"losses": [9.0, 8.0], "peak_rss_mb": 100.0}
    slow = [{**worker, "times": [5.0, 0.2, 0.4, 0.3]}, {**worker, "times": [5.0, 0.5, 0.6, 0.7]}]
    fast = [{**worker, "times": [5.0, 0.1, 0.2, 0.3]}, {**worker, "times": [5.0, 0.3, 0.3, 0.3]}]
    rows = [
        stats.summarize(name, runs, 1e9, {"fp32": 100.0}, 1, size) for name, runs in (("tf", slow), ("flax", fast))
    ]
    # approx: Python float arithmetic on the numbers above
    assert rows[0]["repeats"] == 2 and rows[0]["step_ms_by_repeat"] == pytest.approx([300.0, 600.0])
    assert rows[0]["step_ms"] == pytest.approx(450.0) and rows[0]["step_ms_range"] == pytest.approx([300.0, 600.0])
    assert stats.per_round(rows[0], rows[1]) == "1.75x [1.50-2.00]"


def test_fsdp_memory_divides_the_state_by_the_devices():
    """benchmarks/fsdp_memory.py, roberta-large on 8 fake devices: replicated, every device holds the whole state
    (parameters and two AdamW moments: 355 M x 3 x 4 bytes); with --fsdp full_shard an eighth of it plus the arrays
    too small to split; hybrid_shard in one process is full_shard."""
    eight = fake_devices(8)
    rows = json.loads(check_ok(run(["benchmarks/fsdp_memory.py"], env=eight)).stdout.splitlines()[-1])
    whole = rows["none"]["total_mb"]
    assert rows["none"]["per_device_mb"] == whole and 355e6 * 12 < whole * 2**20 < 356e6 * 12
    assert whole / 8 < rows["full_shard"]["per_device_mb"] < whole / 8 * 1.01
    assert rows["hybrid_shard"] == rows["full_shard"]
