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
    import jax
    import transformers

    flax_name, auto_name, overrides = TINY[model_type]
    create_config = load_script("tokenizers/create_config.py", "create_config")
    config = create_config.build_config(model_type, vocab_size=300, config_overrides=overrides)
    flax_model = getattr(transformers, flax_name)(config, _do_init=False)
    # Initialised as one compiled program (op by op, BART's init took 7 s); moved away from their initial values, so
    # a weight left at PyTorch's init would show.
    params = jax.jit(flax_model.init_weights, static_argnums=1)(jax.random.PRNGKey(1), (1, 1))
    params = jax.tree_util.tree_map(lambda x: x + 0.01, params)
    flax_dir, pt_dir = tmp_path / "flax", tmp_path / "pt"
    flax_model.save_pretrained(flax_dir, params=params)
    result = check_ok(run(["flax/export_to_pytorch.py", "--model_dir", str(flax_dir), "--output_dir", str(pt_dir)]))
    assert "max |difference| of the logits" in result.stdout
    assert "not writable" not in result.stderr, result.stderr[-2000:]
    assert (pt_dir / "model.safetensors").exists()

    pt_model = getattr(transformers, auto_name).from_pretrained(pt_dir).eval()
    assert all(p.device.type == "cpu" for p in pt_model.parameters())
    rng = np.random.default_rng(0)
    inputs = {"input_ids": rng.integers(5, 300, size=(2, 12)).astype("i4")}
    if config.is_encoder_decoder:
        inputs["decoder_input_ids"] = rng.integers(5, 300, size=(2, 7)).astype("i4")
    expected = np.asarray(jax.jit(lambda params, inputs: flax_model(**inputs, params=params).logits)(params, inputs))
    with torch.no_grad():
        got = pt_model(**{k: torch.from_numpy(v.astype("int64")) for k, v in inputs.items()}).logits.numpy()
    assert got.shape == expected.shape
    # Two frameworks' float32 kernels: each logit a sum of 64-128 products a layer in another order, about 1e-6 of
    # logits of order 1.
    assert np.abs(got - expected).max() < 1e-4


def test_export_bad_input(tmp_path, tiny_model_dir):
    import jax
    import transformers

    def export(model_dir):
        return run(["flax/export_to_pytorch.py", "--model_dir", str(model_dir), "--output_dir", str(tmp_path / "x")])

    assert "flax_model.msgpack" in error_line(export(tiny_model_dir), "export_to_pytorch.py")
    # A model without its head, labelled as the model with one: weights missing, one line, nothing written.
    config = transformers.RobertaConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    headless = transformers.FlaxRobertaModel(config, _do_init=False)
    params = jax.jit(headless.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, 1))
    headless.save_pretrained(tmp_path / "headless", params=params)
    labelled = tmp_path / "headless" / "config.json"
    base = labelled.read_text()
    labelled.write_text(base.replace('"RobertaModel"', '"RobertaForMaskedLM"'))
    line = error_line(export(tmp_path / "headless"), "export_to_pytorch.py")
    assert "lacks weights of FlaxRobertaForMaskedLM" in line and "lm_head" in line
    assert not (tmp_path / "x").exists()
    # Labelled as what it is, the base model exports, checked by its last hidden states.
    labelled.write_text(base)
    assert "max |difference| of the last hidden state" in check_ok(export(tmp_path / "headless")).stdout
    assert type(transformers.AutoModel.from_pretrained(tmp_path / "x")).__name__ == "RobertaModel"


def test_flax_scripts_start_from_pytorch_weights(gpt2_dir, tiny_model_dir, corpus, tmp_path):
    """A model folder holding only PyTorch weights (pytorch_model.bin or model.safetensors, whole or sharded), as most
    published models are stored: the Flax scripts convert it, to the same parameters from every format, and the loss
    equals the PyTorch model's own on the same batch; MLM and CLM train from it. A folder with no weights is one line
    naming the files looked for."""
    import jax
    import transformers

    script = load_script("flax/run_clm_flax.py", "from_pytorch_run_clm_flax")
    config = transformers.AutoConfig.from_pretrained(gpt2_dir)
    torch.manual_seed(0)
    pt_model = transformers.GPT2LMHeadModel(config).eval()
    formats = {"bin": dict(safe_serialization=False), "safetensors": {}}
    formats["sharded"] = dict(safe_serialization=False, max_shard_size="200KB")
    formats["sharded_safetensors"] = dict(max_shard_size="200KB")  # transformers' Flax loader refuses these
    for name, kwargs in formats.items():
        pt_model.save_pretrained(tmp_path / name, **kwargs)
        transformers.AutoTokenizer.from_pretrained(gpt2_dir).save_pretrained(tmp_path / name)
    assert len(list((tmp_path / "sharded").glob("pytorch_model-*.bin"))) > 1
    assert len(list((tmp_path / "sharded_safetensors").glob("model-*.safetensors"))) > 1
    ids = np.random.default_rng(0).integers(5, config.vocab_size, size=(2, 24)).astype(np.int32)
    with torch.no_grad():
        expected = float(pt_model(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long()).loss)
    training_args = script.TrainingArguments(output_dir=str(tmp_path / "out"))
    converted = []
    for name in formats:
        model_args = script.ModelArguments(model_name_or_path=str(tmp_path / name))
        model, params = script.build_model(
            model_args, training_args, script.load_config_and_tokenizer(model_args)[0], False
        )
        converted.append([np.asarray(x) for x in jax.tree_util.tree_leaves(params)])
        sums = script.loss_sums(
            model, {"model": params}, {"input_ids": ids, "attention_mask": np.ones_like(ids)}, None, False, False
        )
        # Two frameworks' float32 kernels: logits agree to about 1e-6 (above), so the mean cross-entropy too.
        assert float(sums["loss"][0] / sums["loss"][1]) == pytest.approx(expected, rel=1e-5), name
    assert all(all((a == b).all() for a, b in zip(converted[0], other, strict=True)) for other in converted[1:])
    config.save_pretrained(tmp_path / "none")
    with pytest.raises(
        SystemExit, match=r"holds no weights file \(looked for flax_model.msgpack, .*model.safetensors"
    ):
        script.build_model(
            script.ModelArguments(model_name_or_path=str(tmp_path / "none")), training_args, config, False
        )

    roberta = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    transformers.RobertaForMaskedLM(roberta).save_pretrained(tmp_path / "roberta", safe_serialization=False)
    for script_path, folder in (
        ("flax/run_mlm_flax.py", tmp_path / "roberta"),
        ("flax/run_clm_flax.py", tmp_path / "safetensors"),
    ):
        tokenizer = tiny_model_dir if folder.name == "roberta" else gpt2_dir
        length = "--max_seq_length" if "mlm" in script_path else "--block_size"
        args = [
            script_path,
            "--output_dir",
            str(tmp_path / f"trained-{folder.name}"),
            "--model_name_or_path",
            str(folder),
        ]
        args += ["--tokenizer_name", str(tokenizer), "--train_file", str(corpus / "train_slice.txt"), length, "32"]
        result = check_ok(run([*args, "--do_train", "--max_steps", "2", "--report_to", "none"]))
        assert "has no Flax weights: converting its PyTorch weights" in result.stderr
        assert (tmp_path / f"trained-{folder.name}" / "flax_model.msgpack").is_file()
