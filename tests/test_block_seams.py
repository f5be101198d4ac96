"""What a block's author reaches without reading the machinery: every final state of the model by name
(model_outputs' ModelStates, an encoder's too; masked_lm_logits' hidden states at the masked positions), and a loss
term's weight from a flag (a field <term>_weight, read by loss_weights and recorded in checkpoints)."""

import re

import numpy as np
import pytest
from conftest import check_ok, flax_args, load_script, renamed_copy, run

CLM = "flax/run_clm_flax.py"
FIELD = '    keep_linebreaks: bool = arg(True, "Whether to keep line breaks when using TXT files or not.")\n'


def test_a_weight_from_a_flag_scales_the_gradient_and_a_resume_with_another_warns(request, corpus, tmp_path):
    """A CLM copy with --loss_weight: weight 4 logs four times weight 1's gradient norm at the same first step (a
    power of two: exact in float32, then each rounded to the 3 decimals logged), trained_loss four times the loss;
    resumed with weight 2 it warns."""
    copy = renamed_copy(CLM, tmp_path)
    source = open(copy).read()
    assert source.count(FIELD) == 1
    open(copy, "w").write(source.replace(FIELD, FIELD + '    loss_weight: float = arg(1.0, "The loss\'s weight.")\n'))
    args = ["--do_train", "--max_steps", "2", "--logging_steps", "1", "--save_steps", "2", "--report_to", "none"]
    norms, logs = {}, {}
    for weight in ("1", "4"):
        out = tmp_path / f"w{weight}"
        result = check_ok(run([copy, *flax_args(CLM, request, corpus, out, *args, "--loss_weight", weight)[1:]]))
        logs[weight] = result.stdout + result.stderr
        norms[weight] = [float(x) for x in re.findall(r"grad norm ([0-9.]+)", logs[weight])]
    assert abs(norms["4"][0] - 4 * norms["1"][0]) <= 5 * 0.0005, norms
    assert "trained_loss" not in logs["1"] and "trained_loss" in logs["4"]
    loss, trained = re.search(
        r"Step 1/2 \(epoch [0-9.]+\) \| loss ([0-9.]+) \| .*trained_loss ([0-9.]+)", logs["4"]
    ).groups()
    assert abs(float(trained) - 4 * float(loss)) <= 5 * 0.00005, (loss, trained)  # each logged to 4 decimals
    out = tmp_path / "w4"
    again = [copy, *flax_args(CLM, request, corpus, out, *args, "--loss_weight", "2")[1:], "--max_steps", "3"]
    resumed = run([*again, "--resume_from_checkpoint"])
    check_ok(resumed)
    assert (
        "written with other objective settings; going on with this run's: --loss_weight 4.0 -> 2.0" in resumed.stderr
    )


@pytest.mark.parametrize(
    "path,fixture", [("flax/run_bart_dlm_flax.py", "bart_dir"), ("flax/run_t5_mlm_flax.py", "t5_dir")]
)
def test_model_outputs_names_the_encoders_states_too(path, fixture, request):
    """An encoder-decoder's ModelStates: the logits and the decoder's last states at the target's length, and the
    encoder's at the source's: those of the model's own encode(), the same operations in the same order."""
    from transformers import AutoConfig

    script = load_script(path, "states_" + path.split("/")[1][:-3])
    if hasattr(script, "clip_with_a_max_for_t5"):
        script.clip_with_a_max_for_t5()  # transformers' Flax T5 on today's jax, as the script's build_model does
    config = AutoConfig.from_pretrained(request.getfixturevalue(fixture))
    model = script.MODEL_CLASS.from_config(config, seed=0)
    ids = np.arange(16).reshape(2, 8) % 50 + 5
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "decoder_input_ids": ids[:, :6]}
    states = script.model_outputs(model, model.params, batch, False)
    width = config.d_model
    assert states.logits.shape == (2, 6, config.vocab_size) and states.hidden.shape == (2, 6, width)
    encoded = model.encode(input_ids=ids, attention_mask=np.ones_like(ids), params=model.params).last_hidden_state
    assert states.encoder_hidden.shape == (2, 8, width)
    np.testing.assert_allclose(states.encoder_hidden, encoded, rtol=1e-6, atol=1e-6)


def test_masked_lm_logits_gives_the_hidden_states_the_head_reads(tiny_model_dir):
    """masked_lm_logits(hidden=True): the final hidden states at the masked positions, the rows of the model's own
    at those positions, beside the logits there."""
    from transformers import AutoConfig

    mlm = load_script("flax/run_mlm_flax.py", "states_run_mlm_flax")
    model = mlm.MODEL_CLASS.from_config(AutoConfig.from_pretrained(tiny_model_dir), seed=0)
    ids = np.arange(16).reshape(2, 8) % 50 + 5
    positions = np.array([[1, 3], [0, 5]])
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    logits, hidden = mlm.masked_lm_logits(model, model.params, {**batch, "masked_positions": positions}, False, True)
    full = mlm.model_outputs(model, model.params, batch, False)
    rows = np.arange(2)[:, None]
    assert hidden.shape == (2, 2, model.config.hidden_size) and logits.shape == (2, 2, model.config.vocab_size)
    np.testing.assert_allclose(hidden, full.hidden[rows, positions], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logits, full.logits[rows, positions], rtol=1e-5, atol=1e-5)


def test_the_helpers_take_what_a_block_varies(monkeypatch):
    """shifted_token_sums scores the positions a block names (default: every real one); evaluation tells
    collate_batch so by an argument, not by its seed's length; CLM's collator is an object as the others'."""
    import types

    clm = load_script("flax/run_clm_flax.py", "seams_run_clm_flax")
    logits = np.random.default_rng(0).normal(size=(2, 6, 11)).astype(np.float32)
    batch = {"input_ids": np.arange(12).reshape(2, 6) % 11, "attention_mask": np.array([[1] * 6, [1] * 4 + [0] * 2])}
    everything = clm.shifted_token_sums({"logits": logits}, batch, False, 1)
    assert [float(x) for x in everything] == [
        float(x) for x in clm.shifted_token_sums({"logits": logits}, batch, False, 1, scored=np.ones((2, 6), np.int32))
    ]
    scored = np.zeros((2, 6), np.int32)
    scored[:, 2] = 1  # the tokens at position 2: predicted from position 1, in both rows
    loss, _, count = clm.shifted_token_sums({"logits": logits}, batch, False, 1, scored=scored)
    expected = clm.token_sums(logits[:, 1:2], batch["input_ids"][:, 2:3], np.ones((2, 1), np.int32))[0]
    assert int(count) == 2 and float(loss) == float(expected) and int(everything[2]) == 5 + 3

    calls = []
    monkeypatch.setattr(clm, "collate_batch", lambda *args, train=True: calls.append((args[2], train)) or {})
    monkeypatch.setattr(clm, "global_batch", lambda batch, plan: batch)
    plan = types.SimpleNamespace(eval_batch_size=2, process_index=1)  # not process 0: no progress bar
    run = types.SimpleNamespace(plan=plan, dataset={"validation": np.arange(3)}, args=types.SimpleNamespace(seed=5))
    run.__dict__.update(collator=None, eval_step=lambda params, batch, index: {"loss": (1.0, 2.0)}, writer=None)
    run.weights = None
    clm.evaluate(None, run, 0)
    assert calls == [((5,), False), ((5,), False)]
    assert clm.build_collator(None, None, types.SimpleNamespace(pad_token_id=7), 8, {}).pad_token_id == 7


@pytest.mark.parametrize("bf16", [False, True])
def test_one_handle_on_the_output_layer_in_all_four(bf16, tiny_model_dir, bart_dir):
    """capture_head and apply_head, in the shared text of the four scripts, reach the output layer of each one's
    models: RoBERTa's (at the masked positions, its bias added apart), GPT-2's, a tied T5's (its nn.Embed's attend,
    computed in bf16 products with --dtype bfloat16 like every dense layer) and BART's; apply_head gives the
    recorded layer's logits again, from its recorded inputs."""
    import jax
    import transformers
    from test_bf16 import dot_products

    names = ("mlm", "clm", "t5_mlm", "bart_dlm")
    scripts = {name: load_script(f"flax/run_{name}_flax.py", f"head_run_{name}_flax") for name in names}
    scripts["t5_mlm"].clip_with_a_max_for_t5()  # transformers' Flax T5 on today's jax, as build_model does
    ids = np.arange(16).reshape(2, 8) % 50 + 5
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    tied_t5 = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, vocab_size=100)
    models = {
        "mlm": (transformers.AutoConfig.from_pretrained(tiny_model_dir), batch),
        "clm": (transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100), batch),
        "t5_mlm": (tied_t5, {**batch, "decoder_input_ids": ids[:, :5]}),
        "bart_dlm": (transformers.AutoConfig.from_pretrained(bart_dir), {**batch, "decoder_input_ids": ids[:, :5]}),
    }
    assert tied_t5.tie_word_embeddings
    for name, (config, inputs) in models.items():
        script, head = scripts[name], {}
        model = script.MODEL_CLASS.from_config(config, seed=0)
        if name == "mlm":
            positions = np.array([[1, 3], [0, 5]])
            logits = script.masked_lm_logits(
                model, model.params, {**inputs, "masked_positions": positions}, bf16, head=head
            )
            assert head["inputs"].shape == (2, 2, config.hidden_size) and logits.shape == (2, 2, config.vocab_size)
            expected = head["logits"] + model.params["lm_head"]["bias"]  # RoBERTa adds its own bias after the layer
        else:
            logits = script.model_logits(
                model, model.params, inputs, bf16, [script.capture_head(head, config.vocab_size)]
            )
            expected = head["logits"]
            assert name == "bart_dlm" or head["logits"] is logits  # BART adds final_logits_bias (zeros, new)
        np.testing.assert_allclose(logits, expected, rtol=1e-6, atol=1e-6)
        # apply_head: the same operands in the same product, lowered alone: equal to float32 rounding
        np.testing.assert_allclose(script.apply_head(head, head["inputs"], bf16), head["logits"], rtol=1e-5, atol=1e-5)
    model = scripts["t5_mlm"].MODEL_CLASS.from_config(tied_t5, seed=0)
    lowered = jax.jit(lambda p: scripts["t5_mlm"].model_logits(model, p, models["t5_mlm"][1], bf16)).lower(
        model.params
    )
    dense = [p for p in dot_products(lowered.as_text()) if not p[0]]
    assert dense and all(p[1] == (("bf16", "bf16") if bf16 else ("f32", "f32")) for p in dense), dense
