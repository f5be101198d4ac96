"""--dtype bfloat16 in the four Flax training scripts and run_bert_flax.py: every dense product is a
bf16 x bf16 -> f32 product, forward and backward; gradients and training match float32 within bf16's
precision; checkpoints hold float32 weights. (Speed is measured in benchmarks/, never here.)"""

import contextlib
import json
import re

import numpy as np
import pytest
from conftest import FLAX_TRAINING_SCRIPTS, RELOAD_RTOL, check_ok, flax_args, load_script, logged_losses, run

TRAINING_SCRIPTS = FLAX_TRAINING_SCRIPTS
# Largest relative gap allowed between a bf16 and an f32 run's per-step training losses, from the same
# weights and batches over 8 steps: bf16 rounds the products' inputs to 8 significant bits (relative error
# up to 2^-9); measured: up to 0.12 % (T5), 0.002 % (RoBERTa).
LOSS_RTOL = 3e-3


def dot_products(lowered_text):
    """(has batch dimensions, operand element types, result element type) of every dot_general in
    lowered StableHLO."""
    found = []
    for line in lowered_text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        types = re.search(r":\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)", line)
        element = [re.search(r"x?([a-z]+[0-9]+)>$", t).group(1) for t in types.groups()]
        found.append(("batching_dims" in line, tuple(element[:2]), element[2]))
    return found


def compiled_dense_products(compiled_text):
    """(operand element types, left operand's contracting axis is its last) of every dot_general without
    batch dimensions in XLA's compiled HLO, after its own rewrites (operand widening, transpose folding)."""
    types = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = ([a-z0-9]+\[[0-9,]*\])", compiled_text, re.M))
    found = []
    for a, b, lhs in re.findall(
        r" dot\(%(\S+), %(\S+)\), lhs_contracting_dims=\{(\d+)\}, rhs_contracting_dims=\{\d+\}(?!, \w*batch)",
        compiled_text,
    ):
        rank = types[a].count(",") + 1
        found.append(((types[a].split("[")[0], types[b].split("[")[0]), int(lhs) == rank - 1))
    return found


@pytest.mark.parametrize("path", [*TRAINING_SCRIPTS, "flax/run_bert_flax.py"])
@pytest.mark.parametrize("transposes_pay", [False, True])
def test_rerouted_dense_gradients_match_f32_and_every_product_is_bf16(path, transposes_pay, monkeypatch):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    script = load_script(path, "bf16_" + path.split("/")[-1][:-3])
    monkeypatch.setattr(script, "transposes_pay", lambda *_: transposes_pay)  # both ways of the kernel gradient
    layer = nn.Dense(48)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 32))
    params = layer.init(jax.random.PRNGKey(1), x)

    def loss(params, x, bf16):
        with nn.intercept_methods(script.bf16_dense) if bf16 else contextlib.nullcontext():
            return jnp.sum(jnp.sin(layer.apply(params, x)))

    grad = jax.grad(loss, argnums=(0, 1))
    lowered = jax.jit(grad, static_argnums=2).lower(params, x, True)
    compiled = lowered.compile()
    exact = jax.tree_util.tree_leaves(grad(params, x, False))
    bf16 = jax.tree_util.tree_leaves(compiled(params, x))
    for a, b in zip(exact, bf16, strict=True):
        assert a.dtype == b.dtype == jnp.float32
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 1e-2  # bf16 rounding, accumulated in f32
    products = dot_products(lowered.as_text())
    assert len(products) == 3  # forward, and the two gradient products
    assert all(p == (False, ("bf16", "bf16"), "f32") for p in products), products
    # ... and with written-out transposes XLA:CPU keeps all three so: bf16 operands, in the form its bf16
    # kernel takes; without, it widens the kernel gradient's operands to f32.
    widened = [] if transposes_pay else [(("f32", "f32"), False)]
    expected = [(("bf16", "bf16"), True)] * (3 - len(widened)) + widened
    assert sorted(compiled_dense_products(compiled.as_text())) == sorted(expected)


def model_loss_fn(path, model_dir, transposes_pay=None):
    """A tiny model from model_dir and a function (params, bf16) -> loss through the script's own logits path
    (transposes_pay, if given, overrides the script's choice of kernel-gradient product)."""
    import jax.numpy as jnp
    import transformers

    script = load_script(path, "bf16_model_" + path.split("/")[-1][:-3])
    if transposes_pay is not None:
        script.transposes_pay = lambda *_: transposes_pay
    config = transformers.AutoConfig.from_pretrained(model_dir)
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 900, size=(2, 32)), dtype=jnp.int32)
    if path.endswith("run_mlm_flax.py"):
        model = transformers.FlaxAutoModelForMaskedLM.from_config(config)
        labels = np.where(np.arange(32) % 5 == 0, np.asarray(ids), -100)
        batch = script.gather_masked({"input_ids": ids, "labels": labels}, 0.15)
        return model.params, lambda params, bf16: script.masked_lm_logits(
            model, params, {k: v for k, v in batch.items() if k != "labels"}, bf16
        ).sum()
    if path.endswith("run_clm_flax.py"):
        model, batch = transformers.FlaxAutoModelForCausalLM.from_config(config), {"input_ids": ids}
    else:
        model = transformers.FlaxAutoModelForSeq2SeqLM.from_config(config)
        batch = {"input_ids": ids, "decoder_input_ids": ids[:, :8]}
    return model.params, lambda params, bf16: script.model_logits(model, params, batch, bf16).sum()


@pytest.mark.parametrize("path", TRAINING_SCRIPTS)
def test_whole_model_dense_products_are_bf16(path, request):
    """In the gradient of a whole model, every product without batch dimensions (the dense layers, GPT-2's
    Conv1D, the tied LM head, and their gradients) is bf16 x bf16 -> f32, and with written-out transposes
    XLA:CPU runs every one of them in bf16, tied heads included; only the attention products, which have
    batch dimensions, stay f32."""
    import jax

    params, loss = model_loss_fn(path, request.getfixturevalue(TRAINING_SCRIPTS[path][1]), transposes_pay=True)
    lowered = jax.jit(jax.grad(loss), static_argnums=1).lower(params, True)
    products = dot_products(lowered.as_text())
    dense = [p for p in products if not p[0]]
    assert len(dense) >= 3 * 8, products
    assert all(p[1:] == (("bf16", "bf16"), "f32") for p in dense), products
    compiled = lowered.compile()
    assert set(compiled_dense_products(compiled.as_text())) == {(("bf16", "bf16"), True)}
    jax.block_until_ready(compiled(params))  # XLA:CPU runs every one of them
    assert all(p[1] == ("f32", "f32") for p in products if p[0])
    assert all(
        p[1] == ("f32", "f32")
        for p in dot_products(jax.jit(jax.grad(loss), static_argnums=1).lower(params, False).as_text())
    )


def test_the_output_layer_at_masked_positions_gives_the_full_head_loss(tiny_model_dir):
    """run_mlm_flax.py scores the LM head only at the masked positions: same loss and gradients as the
    head on every position."""
    import jax
    import jax.numpy as jnp
    import transformers

    mlm = load_script("flax/run_mlm_flax.py", "bf16_gather_run_mlm_flax")
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    model = transformers.FlaxAutoModelForMaskedLM.from_config(config, _do_init=False)
    params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, 1))  # compiled, not op by op
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 900, size=(4, 64)).astype(np.int32)
    labels = np.where(rng.random((4, 64)) < 0.15, ids, -100)
    labels[1, :40] = ids[1, :40]  # one row far above the expected count: K must grow to hold it
    batch = mlm.gather_masked({"input_ids": ids, "labels": labels}, 0.15)
    k = batch["labels"].shape[1]
    assert k == 64 and (batch["labels"] != -100).sum() == (labels != -100).sum()  # above the bound: a power of two
    assert (np.take_along_axis(labels, batch["masked_positions"], axis=1) == batch["labels"]).all()

    def gathered(params):
        logits = mlm.masked_lm_logits(
            model, params, {"input_ids": ids, "masked_positions": batch["masked_positions"]}, False
        )
        assert logits.shape == (4, k, config.vocab_size)
        loss, _, count = mlm.token_sums(logits, batch["labels"], batch["labels"] != -100)
        return loss / count

    def full(params):
        loss, _, count = mlm.token_sums(
            model(ids, params=params).logits, jnp.asarray(labels), jnp.asarray(labels) != -100
        )
        return loss / count

    (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(f))(params) for f in (gathered, full))
    # The same products at k gathered rows or at every position: float32 sums of the same terms in other orders and
    # shapes, about 2**-24 x sqrt(64) of values of order 1 (loss 7, gradients below 1).
    assert float(a) == pytest.approx(float(b), abs=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


@pytest.mark.parametrize("path", TRAINING_SCRIPTS)
def test_bf16_training_follows_f32_and_saves_f32_weights(path, corpus, tmp_path, request):
    def args(out, dtype, *extra):
        return flax_args(path, request, corpus, out, "--dtype", dtype, *extra)

    steps = [
        "--do_train",
        "--do_eval",
        "--per_device_train_batch_size",
        "8",
        "--max_steps",
        "8",
        "--logging_steps",
        "1",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "2",
    ]
    losses = {}
    for dtype in ("float32", "bfloat16"):
        result = check_ok(run(args(tmp_path / dtype, dtype, *steps)))
        losses[dtype] = logged_losses(result.stdout + result.stderr)
    assert len(losses["bfloat16"]) == len(losses["float32"]) == 8
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=LOSS_RTOL)
    assert losses["bfloat16"][-1] < losses["bfloat16"][0]
    # ... and the flag took effect: a run that ignored it would run float32's program on the same weights and
    # batches, and give float32's losses bit for bit (XLA:CPU is deterministic on one machine: checked, train_loss
    # equal to the last bit); bf16's products move them. Measured, the mean of the 8 unrounded losses (train_loss):
    # by 2e-5 of 6.8 (RoBERTa), 8e-5 (GPT-2), 1e-5 (BART), 1e-3 of 22 (T5).
    train_loss = {
        dtype: json.loads((tmp_path / dtype / "train_results.json").read_text())["train_loss"] for dtype in losses
    }
    assert train_loss["bfloat16"] != train_loss["float32"], train_loss

    import jax
    from flax.serialization import msgpack_restore

    weights = msgpack_restore((tmp_path / "bfloat16" / "flax_model.msgpack").read_bytes())
    assert {str(w.dtype) for w in jax.tree_util.tree_leaves(weights)} == {"float32"}
    if path != "flax/run_mlm_flax.py":  # the reload is the same machinery in the four scripts (test_layout.py)
        return
    # The checkpoint, reloaded with from_pretrained, evaluates exactly as the run that saved it.
    reloaded = args(tmp_path / "reloaded", "bfloat16", "--do_eval", "--model_name_or_path", str(tmp_path / "bfloat16"))
    check_ok(run(reloaded))
    trained, again = (json.loads((tmp_path / d / "eval_results.json").read_text()) for d in ("bfloat16", "reloaded"))
    assert again["eval_loss"] == pytest.approx(trained["eval_loss"], rel=RELOAD_RTOL)
