"""flax/run_bert_flax.py: timed inference that blocks on results, for both precisions."""

import json

import pytest
from conftest import check_ok, refusal, run

TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_reports_throughput(precision, tmp_path):
    out = tmp_path / "r.json"
    result = check_ok(
        run(
            [
                "flax/run_bert_flax.py",
                "--precision",
                precision,
                "--config_overrides",
                TINY,
                "--batch_size",
                "4",
                "--seq_length",
                "16",
                "--num_warmup",
                "2",
                "--num_iterations",
                "5",
                "--output_file",
                str(out),
            ],
            env={"LM_CPU_BF16": "0"},
        )
    )
    r = json.loads(out.read_text())
    assert r["precision"] == precision and r["num_iterations"] == 5
    assert 0 < r["min_s"] <= r["median_s"] < r["warmup_s"] + 1.0
    assert r["examples_per_second"] == pytest.approx(4 / r["median_s"])
    assert r["tokens_per_second"] == pytest.approx(64 / r["median_s"])
    assert f"{precision}: median" in result.stdout
    # on a CPU without bf16 instructions, bfloat16 warns once and runs
    assert result.stderr.count("--precision bfloat16: this CPU") == (precision == "bfloat16")
    assert "deprecated and will be removed in Transformers v5" not in result.stderr + result.stdout


def test_bad_input():
    assert "--seq_length" in refusal(["flax/run_bert_flax.py", "--seq_length", "0"])
    assert "positions" in refusal(["flax/run_bert_flax.py", "--seq_length", "1024", "--config_overrides", TINY])


def test_bfloat16_outputs_close_to_float32():
    """The bf16 path (bf16 weights and activations, dense layers as bf16 x bf16 -> f32 products) gives the
    float32 model's hidden states within bf16's precision: relative error (Frobenius) below 2 %."""
    import numpy as np
    from conftest import load_script

    bert = load_script("flax/run_bert_flax.py", "run_bert_flax")
    outputs = {}
    for precision in ("float32", "bfloat16"):
        args = bert.BenchmarkArguments(precision=precision, config_overrides=TINY, seed=0)
        model, params, config = bert.build_model(args)
        ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(4, 16)).astype(np.int32)
        outputs[precision] = np.asarray(bert.make_forward(model, precision)(params, ids), dtype=np.float32)
    exact, bf16 = outputs["float32"], outputs["bfloat16"]
    assert np.isfinite(bf16).all()
    assert np.linalg.norm(bf16 - exact) / np.linalg.norm(exact) < 0.02
