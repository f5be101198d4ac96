"""benchmarks/run_benchmark.py --end_to_end: the real scripts under the harness. Its own file, so that the suite's
workers (pytest-xdist, one file each) run it beside the quick benchmark, not after it."""

import json
import os

import pytest
from conftest import BENCHMARK_BATCH, ROOT, benchmark_work, check_ok, run

pytestmark = pytest.mark.usefixtures("optimised_xla")

XLA_PYTHON = os.environ.get("XLA_PYTHON", os.path.join(ROOT, ".venv-xla", "bin", "python"))


def test_end_to_end_runs_the_real_scripts(corpus, tmp_path, tmp_path_factory):
    """--end_to_end --quick: the original README's table shape (a row | MLM with a column per framework), the curves,
    and eval losses that are the scripts' own eval_results.json. A bf16 mode named in --modes runs on a CPU without
    bf16 instructions, after one warning."""
    benchmark_work(tmp_path, corpus, tmp_path_factory)
    expected = ["flax_bf16", "torch", "torch_xla", "tf"]  # one mode per framework keeps CI short
    result = check_ok(
        run(
            [
                "benchmarks/run_benchmark.py",
                "--end_to_end",
                "--quick",
                "--modes",
                ",".join(expected),
                *BENCHMARK_BATCH,
                "--output_dir",
                str(tmp_path),
            ],
            env={"XLA_PYTHON": XLA_PYTHON, "LM_CPU_BF16": "0"},
            timeout=1800,  # beside another test worker on 2 cores: 3-5 minutes
        )
    )
    assert result.stderr.count("warning: flax_bf16: this CPU") == 1
    table = (tmp_path / "results.md").read_text()
    report = json.loads((tmp_path / "results.json").read_text())
    rows = {r["mode"]: r for r in report["end_to_end"]["modes"]}
    assert list(rows) == expected and "| task | " + " | ".join(expected) + " |" in table
    assert next(line for line in table.splitlines() if line.startswith("| MLM |")).count("|") == len(expected) + 2
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ran = [name for name in expected if "eval_loss" in rows[name]]
    assert set(expected) - set(ran) <= (
        {"torch_xla"} if not (os.path.exists(XLA_PYTHON) or os.environ.get("CI")) else set()
    ), rows
    for name in ran:
        own = json.loads((tmp_path / "work" / "e2e" / name / "eval_results.json").read_text())
        assert rows[name]["eval_loss"] == own["eval_loss"] and rows[name]["eval_accuracy"] == own["eval_accuracy"]
        assert [p[0] for p in rows[name]["curve"]] == [5, 10, 15, 20] and rows[name]["curve"][-1][1] == pytest.approx(
            own["eval_loss"],
            abs=1e-4,  # the curve is read from TensorBoard, which stores float32 (5e-7 at 7)
        )
    worst = max(rows[name]["eval_loss"] for name in ran)
    assert report["end_to_end"]["target_loss"] == worst and all(
        rows[name]["time_to_target_s"] is not None for name in ran
    )
    # The same initial weights and schedule: after 20 steps every framework is within mask noise of the others.
    assert report["end_to_end"]["parity_gap"][0] < 0.1
    assert "prepare_tfrecord_shards.py" in rows["tf"]["command"] and "--max_grad_norm 0" in rows["torch"]["command"]
