"""flax/run_clm_flax.py end to end on a slice of the real default corpus, its loss, and its bad-input errors."""

import json
import math
import re
import types

import numpy as np
import pytest
from conftest import (
    RELOAD_RTOL,
    TWO_DEVICES_OPTIMISED,
    bad_input,
    check_names_itself,
    check_ok,
    load_script,
    logged_losses,
    renamed_copy,
    run,
    script_args,
)

SCRIPT = "flax/run_clm_flax.py"
clm = load_script(SCRIPT, "run_clm_flax")


def clm_args(model_dir, corpus, output_dir, *extra, script=SCRIPT):
    return script_args(script, "gpt2", model_dir, corpus, output_dir, "--block_size", "64", *extra)


@pytest.fixture(scope="module")
def trained(gpt2_dir, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("clm")
    result = check_ok(
        run(
            clm_args(
                gpt2_dir,
                corpus,
                out,
                "--do_train",
                "--do_eval",
                "--per_device_train_batch_size",
                "8",
                "--learning_rate",
                "3e-3",
                "--warmup_steps",
                "10",
                "--num_train_epochs",
                "1",
                "--logging_steps",
                "10",
                "--overwrite_output_dir",
                script=renamed_copy(SCRIPT, tmp_path_factory.mktemp("copy")),
            ),
            env=TWO_DEVICES_OPTIMISED,
        )
    )
    return out, result


def test_tokenizer_for_gpt2_adds_no_special_tokens(gpt2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gpt2_dir)
    assert type(tokenizer).__name__ == "GPT2TokenizerFast" and tokenizer.model_max_length == 1024
    ids = tokenizer("the market fell\n")["input_ids"]
    assert set(ids).isdisjoint(tokenizer.all_special_ids)
    assert tokenizer.decode(ids) == "the market fell\n"


def test_trains_on_two_devices_loss_falls_and_metrics_written(trained, corpus):
    out, result = trained
    log = result.stdout + result.stderr
    assert "2 devices" in log
    check_names_itself(result.args[1], log, out)
    losses = logged_losses(log)
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses
    metrics = json.loads((out / "eval_results.json").read_text())
    assert metrics["eval_loss"] < math.log(1000) - 1.0  # well below a uniform guess over the vocabulary
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-6)
    assert 0.05 < metrics["eval_accuracy"] < 1.0
    # Every validation block is evaluated: block_size - 1 predictions per full block.
    assert metrics["eval_predicted_tokens"] >= 63 * (metrics["eval_samples"] - 1)
    assert list(out.glob("runs/*/events.out.tfevents.*"))


def test_checkpoint_reloads_to_identical_eval(trained, gpt2_dir, corpus, tmp_path):
    out, _ = trained
    args = clm_args(gpt2_dir, corpus, tmp_path / "reloaded", "--do_eval", "--model_name_or_path", str(out))
    args[args.index("--config_name") + 1] = str(out)
    check_ok(run(args))  # one device, other batching
    first = json.loads((out / "eval_results.json").read_text())
    again = json.loads((tmp_path / "reloaded" / "eval_results.json").read_text())
    assert again["eval_predicted_tokens"] == first["eval_predicted_tokens"]
    assert again["eval_loss"] == pytest.approx(first["eval_loss"], rel=RELOAD_RTOL)


def test_padding_is_masked_out_of_the_loss():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 11)).astype("f4")
    ids = rng.integers(0, 11, size=(2, 6)).astype("i4")
    full = np.ones_like(ids)

    def sums(logits, ids, mask):  # the objective's loss_sums on a model that returns `logits`
        model = lambda **_: {"logits": logits, "hidden_states": (None,)}  # noqa: E731
        model.config = types.SimpleNamespace(vocab_size=logits.shape[-1])
        out = clm.loss_sums(
            model,
            {"model": None},
            {"input_ids": ids, "attention_mask": mask},
            None,
            False,
            False,
        )
        return [float(x) for x in (out["loss"][0], out["accuracy"][0], out["loss"][1])]

    loss, acc, count = sums(logits, ids, full)
    assert count == 10
    # The same rows with three padding positions appended (any logits, any ids): nothing changes.
    pad_logits = np.concatenate([logits, rng.normal(size=(2, 3, 11)).astype("f4")], axis=1)
    pad_ids = np.concatenate([ids, rng.integers(0, 11, size=(2, 3)).astype("i4")], axis=1)
    pad_mask = np.concatenate([full, np.zeros((2, 3), "i4")], axis=1)
    padded = sums(pad_logits, pad_ids, pad_mask)
    assert padded == pytest.approx([loss, acc, count], rel=1e-6)  # the same sums with zeros added: rounding only
    # And the loss is the mean next-token cross-entropy over real positions.
    logp = logits[:, :-1] - np.log(np.exp(logits[:, :-1]).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, ids[:, 1:, None], -1).sum()
    assert loss == pytest.approx(float(expected), rel=1e-5)  # float32 log-softmax in two libraries: about 1e-7


def test_model_outputs_gives_the_final_hidden_state_the_head_reads():
    """model_outputs' hidden state is the head's input: through apply_head (capture_head's kernel and bias) it gives
    the model's own logits, for GPT-2 (its last hidden state, after ln_f) and for T5 (the decoder's, at the
    decoder's length; T5 scales it by d_model ** -0.5 before a tied head, so an untied one is taken here)."""
    import transformers

    ids = np.random.default_rng(0).integers(0, 100, size=(2, 12)).astype("i4")
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "decoder_input_ids": ids[:, :5]}
    for model in (
        transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)),
        transformers.FlaxT5ForConditionalGeneration(
            transformers.T5Config(
                d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, vocab_size=100, tie_word_embeddings=False
            )
        ),
    ):
        head = {}
        logits, hidden, _ = clm.model_outputs(model, model.params, batch, False, [clm.capture_head(head, 100)])
        assert hidden.shape == (*logits.shape[:2], 32) and head["logits"] is logits
        # the same product of the same float32 operands, lowered as one dot either way: equal to float32 rounding
        np.testing.assert_allclose(clm.apply_head(head, hidden, False), logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bf16", [False, True])
def test_large_logits_are_computed_a_chunk_at_a_time(bf16, monkeypatch):
    """Above 16 * HEAD_CHUNK logits, the head and the loss go a chunk of positions at a time: the same sums and
    gradient as from whole logits, no [rows, tokens, vocabulary] array left in the compiled step, and no more products
    than with whole logits (a chunk's gradient is computed with its logits, never by computing them again). The FLOPs
    the scripts report count every chunk; XLA's cost analysis counts a loop's body once."""
    import jax
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=500, n_positions=64)
    model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    ids = np.random.default_rng(0).integers(0, 500, size=(3, 40)).astype("i4")
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}

    def sums(params):
        return clm.loss_sums(model, {"model": params}, batch, None, False, bf16)

    results = []
    for chunk in (2**26, 3000):  # whole logits; 2 positions of the 3 rows a chunk (the last chunk padded)
        monkeypatch.setattr(clm, "HEAD_CHUNK", chunk)
        step = jax.jit(
            jax.value_and_grad(lambda params: sums(params)["loss"][0])
        )  # the loss is needed, as in training
        traced = step.trace(model.params)
        compiled = traced.lower().compile()
        hlo, flops = compiled.as_text(), [clm.matmul_flops(traced.jaxpr.jaxpr, loops) for loops in (True, False)]
        products = len(re.findall(r"\bdot\(", hlo))
        results.append(
            (jax.tree.map(float, sums(model.params)), step(model.params)[1], "[3,40,500]" in hlo, products, flops)
        )
    (whole, whole_grad, whole_logits, whole_products, whole_flops), (chunked, chunked_grad, chunked_logits, *rest) = (
        results
    )
    products, (flops, once) = rest
    assert whole_logits and not chunked_logits and products == whole_products
    # 20 chunks of 2 positions, 40 as whole: three products of [3, 40, 32] x [32, 500] each, and the model's
    assert flops == whole_flops[0] == whole_flops[1] > once and flops - once == 19 * 3 * 2 * 3 * 2 * 32 * 500
    assert chunked["loss"][1] == whole["loss"][1] == 2 * 39 + 8
    # float32 sums of the same terms (bf16 products accumulated in f32 with --dtype bfloat16) in another order:
    # rounding only, about 1e-7 of each term
    assert chunked["loss"][0] == pytest.approx(whole["loss"][0], rel=1e-5)
    assert chunked["accuracy"][0] == whole["accuracy"][0]
    for a, b in zip(jax.tree.leaves(whole_grad), jax.tree.leaves(chunked_grad)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * float(np.abs(a).max()))


def test_bad_input(gpt2_dir, corpus, tmp_path):
    bad = bad_input(
        lambda out, *extra: clm_args(gpt2_dir, corpus, out, "--do_train", *extra), "run_clm_flax.py", tmp_path / "out"
    )

    assert "does not exist" in bad(train_file=tmp_path / "missing.txt")
    short = tmp_path / "short"
    check_ok(
        run(
            [
                "tokenizers/create_config.py",
                "--model_type",
                "gpt2",
                "--tokenizer_name",
                str(gpt2_dir),
                "--config_overrides",
                "n_embd=64,n_layer=2,n_head=2,n_positions=32",
                "--output_dir",
                str(short),
            ]
        )
    )
    assert "--block_size 64 is longer than the model's 32 positions" in bad("--config_name", str(short))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert "--overwrite_output_dir" in bad(output_dir=busy)
    assert "Flax gpt2 model cannot recompute" in bad("--gradient_checkpointing")
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    assert "--dataset_name" in bad("--dataset_name", "wikitext", env=offline)
    assert not (tmp_path / "out").exists()
