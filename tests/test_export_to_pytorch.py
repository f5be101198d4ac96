"""flax/export_to_pytorch.py: a Flax checkpoint becomes a PyTorch model with the same logits."""

import numpy as np
import pytest
import torch
from conftest import check_ok, error_line, load_script, run

TINY = {
    "roberta": (
        "FlaxRobertaForMaskedLM",
        "AutoModelForMaskedLM",
        "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64",
    ),
    "gpt2": ("FlaxGPT2LMHeadModel", "AutoModelForCausalLM", "n_embd=32,n_layer=2,n_head=2,n_positions=64"),
    "t5": (
        "FlaxT5ForConditionalGeneration",
        "AutoModelForSeq2SeqLM",
        "d_model=32,d_kv=16,d_ff=64,num_layers=2,num_decoder_layers=2,num_heads=2",
    ),
    "bart": (
        "FlaxBartForConditionalGeneration",
        "AutoModelForSeq2SeqLM",
        "d_model=32,encoder_layers=2,decoder_layers=2,encoder_attention_heads=2,decoder_attention_heads=2,"
        "encoder_ffn_dim=64,decoder_ffn_dim=64,max_position_embeddings=64",
    ),
}


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_pytorch_logits_equal_flax_logits(model_type, tmp_path):
    import transformers

    flax_name, auto_name, overrides = TINY[model_type]
    create_config = load_script("tokenizers/create_config.py", "create_config")
    config = create_config.build_config(model_type, vocab_size=300, config_overrides=overrides)
    flax_model = getattr(transformers, flax_name)(config, seed=1)
    # Move the weights away from their initial values, so a weight left at PyTorch's init would show.
    flax_model.params = transformers.modeling_flax_utils.jax.tree_util.tree_map(lambda x: x + 0.01, flax_model.params)
    flax_dir, pt_dir = tmp_path / "flax", tmp_path / "pt"
    flax_model.save_pretrained(flax_dir)
    result = check_ok(run(["flax/export_to_pytorch.py", "--model_dir", str(flax_dir), "--output_dir", str(pt_dir)]))
    assert "max |logit difference|" in result.stdout
    assert (pt_dir / "model.safetensors").exists()

    pt_model = getattr(transformers, auto_name).from_pretrained(pt_dir).eval()
    assert all(p.device.type == "cpu" for p in pt_model.parameters())
    rng = np.random.default_rng(0)
    inputs = {"input_ids": rng.integers(5, 300, size=(2, 12)).astype("i4")}
    if config.is_encoder_decoder:
        inputs["decoder_input_ids"] = rng.integers(5, 300, size=(2, 7)).astype("i4")
    expected = np.asarray(flax_model(**inputs).logits)
    with torch.no_grad():
        got = pt_model(**{k: torch.from_numpy(v.astype("int64")) for k, v in inputs.items()}).logits.numpy()
    assert got.shape == expected.shape
    # Two frameworks' float32 kernels: each logit a sum of 64-128 products a layer in another order, about 1e-6 of
    # logits of order 1.
    assert np.abs(got - expected).max() < 1e-4


def test_export_bad_input(tmp_path, tiny_model_dir):
    assert "flax_model.msgpack" in error_line(
        run(["flax/export_to_pytorch.py", "--model_dir", str(tiny_model_dir), "--output_dir", str(tmp_path / "x")]),
        "export_to_pytorch.py",
    )
