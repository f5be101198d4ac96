"""flax/run_bert_flax.py: timed inference that blocks on results, for both precisions."""

import json

import pytest

from conftest import check_ok, error_line, run

TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_reports_throughput(precision, tmp_path):
    out = tmp_path / "r.json"
    result = check_ok(run(["flax/run_bert_flax.py", "--precision", precision, "--config_overrides", TINY,
                           "--batch_size", "4", "--seq_length", "16", "--num_warmup", "2", "--num_iterations", "5",
                           "--output_file", str(out)]))
    r = json.loads(out.read_text())
    assert r["precision"] == precision and r["num_iterations"] == 5
    assert 0 < r["min_s"] <= r["median_s"] < r["warmup_s"] + 1.0
    assert r["examples_per_second"] == pytest.approx(4 / r["median_s"])
    assert r["tokens_per_second"] == pytest.approx(64 / r["median_s"])
    assert f"{precision}: median" in result.stdout


def test_bad_input():
    assert "--seq_length" in error_line(run(["flax/run_bert_flax.py", "--seq_length", "0"]), "run_bert_flax.py")
    assert "positions" in error_line(run(["flax/run_bert_flax.py", "--seq_length", "1024", "--config_overrides", TINY]),
                                     "run_bert_flax.py")
