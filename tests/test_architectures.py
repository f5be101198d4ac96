"""Every architecture that FlaxAutoModelForMaskedLM / FlaxAutoModelForCausalLM map on the pinned transformers trains
in run_mlm_flax.py and run_clm_flax.py: two steps through the script's own functions, a finite loss and gradient, and
for causal LM a model that does not see the tokens it predicts. One tiny model per architecture, all in this
process."""

import math

import numpy as np
import pytest
import transformers
from conftest import load_script

MAPPINGS = {
    "flax/run_mlm_flax.py": transformers.FLAX_MODEL_FOR_MASKED_LM_MAPPING,
    "flax/run_clm_flax.py": transformers.FLAX_MODEL_FOR_CAUSAL_LM_MAPPING,
}
# The causal-LM mapping also holds encoders (bert, big_bird, electra, roberta, roberta-prelayernorm, xlm-roberta)
# whose Flax models attend in both directions unless their config says is_decoder=True: run_clm_flax.py sets it.
SEQ_LEN = 32
SPARSE_LEN = 128  # BigBird's block-sparse attention below, with blocks of 16 tokens and one random block
# Tiny sizes, each set on the configs that have the attribute (directly or through their attribute_map).
TINY = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,  # grouped-query attention, where the model has it
    intermediate_size=64,
    max_position_embeddings=64,
    embedding_size=16,  # ALBERT, ELECTRA, RoFormer
    hidden_dim=64,  # DistilBERT's feed-forward
    head_dim=16,  # Gemma, Llama
    rotary_dim=8,  # GPT-J
    word_embed_proj_dim=32,  # OPT
    ffn_dim=64,  # OPT, XGLM
    encoder_layers=1,  # BART, mBART
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    attention_types=[[["global"], 1]],  # GPT-Neo: an attention kind per layer
    # BigBird's default, block-sparse attention, takes only rows of a multiple of block_size (64) tokens, and in
    # training an `indices_rng` besides the dropout rng.
    attention_type="original_full",
)
# Each architecture compiles its own train step, which then runs in milliseconds: XLA's optimizations would take most
# of this file's time. They are off here, and on CPU so are XLA's fusion emitters, which halve the compile time again.
CPU_COMPILE_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def cases():
    return [
        pytest.param(path, model_type, id=f"{path.split('/')[-1][:-3]}-{model_type}")
        for path, mapping in MAPPINGS.items()
        for model_type in dict.fromkeys(config.model_type for config in mapping)  # gpt2 is mapped twice
    ]


@pytest.fixture(scope="module", autouse=True)
def quick_compiles():
    import jax

    saved = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", saved)


def quick_compile(function, *args):
    """The jitted `function` compiled for `args` (with CPU_COMPILE_OPTIONS on CPU)."""
    import jax

    return function.lower(*args).compile(CPU_COMPILE_OPTIONS if jax.default_backend() == "cpu" else None)


@pytest.fixture(scope="module")
def scripts():
    return {path: load_script(path, "architectures_" + path.split("/")[-1][:-3]) for path in MAPPINGS}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def train_rows(scripts, tokenizer, corpus):
    """Each script's training rows of SEQ_LEN tokens: PTB text through its own preprocessing."""
    import datasets

    lines = (corpus / "train_slice.txt").read_text().splitlines()[:200]
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": lines})})
    return {
        (path, length): script.preprocess(raw, script.DataTrainingArguments(), tokenizer, length)["train"]
        for path, script in scripts.items()
        for length in (SEQ_LEN, SPARSE_LEN)
    }


def tiny_config(model_type, tokenizer):
    """The type's default config with TINY's sizes and the tokenizer's vocabulary and special token ids."""
    config = transformers.CONFIG_MAPPING[model_type]()
    values = {"vocab_size": len(tokenizer), "decoder_start_token_id": tokenizer.eos_token_id, **TINY}
    values.update({f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("pad", "bos", "eos")})
    for name, value in values.items():
        if name in (*config.to_dict(), *config.attribute_map):
            setattr(config, name, value)
    return config


def script_args(script, train_file, output_dir, length=SEQ_LEN, **model_args):
    """The script's three argument groups, for two training steps on rows of `length` tokens."""
    data_args = script.DataTrainingArguments(train_file=str(train_file), **{script.LENGTH_FLAG: length})
    training_args = script.TrainingArguments(
        output_dir=str(output_dir),
        do_train=True,
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to="none",
    )
    return script.ModelArguments(**model_args), data_args, training_args


def train_two_steps(script, model_args, data_args, training_args, rows):
    """main()'s and train()'s own calls, from the checks of the arguments to two train steps, without files or logs.
    Returns the model, its trained parameters, the last batch and each step's metrics."""
    import jax

    script.validate_args(model_args, data_args, training_args)
    config, tokenizer = script.load_config_and_tokenizer(model_args)
    length = script.resolve_max_seq_length(data_args, config, tokenizer)
    assert length == getattr(data_args, script.LENGTH_FLAG)
    script.fit_attention(config, length)
    plan = script.plan_training(training_args, {"train": rows}, length)
    collator = script.build_collator(data_args, config, tokenizer, length, {"train": rows})
    model, state, schedule = script.build_train_state(model_args, training_args, config, plan)
    # Orbax restores no weakly typed array; a fresh state has none either, or a resumed run compiles another program
    assert not [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(state) if x.weak_type]
    train_step = script.make_train_step(model, schedule, bf16=False, seed=training_args.seed, state=state)
    initial = jax.device_get(state.params)  # on the host: a step may take over the state's buffers
    metrics, compiled = [], None
    for ids in script.epoch_batches(plan.num_train_examples, plan.train_batch_size, training_args.seed, 0)[:2]:
        ids = np.sort(ids)
        batch = script.collate_batch(collator, rows[ids], (training_args.seed, 0), ids, len(ids))
        device_rows = script.global_batch(batch, plan, training_args.gradient_accumulation_steps)
        compiled = compiled or quick_compile(train_step, state, device_rows)
        state, step_metrics = compiled(state, device_rows)
        step_metrics = {**script.objective_means(step_metrics.pop("sums")), **step_metrics}
        metrics.append({name: float(value) for name, value in step_metrics.items()})
    assert int(state.step) == 2
    # The steps moved the weights: every leaf the loss reaches. Not reached: BART's and mBART's final_logits_bias, a
    # buffer that transformers' Flax BART adds under jax.lax.stop_gradient (PyTorch's registers it as a buffer), and
    # in a causal LM the cross-attention of a decoder that has no encoder to attend to (BART's).
    unmoved = [
        jax.tree_util.keystr(key)
        for (key, before), after in zip(
            jax.tree_util.tree_leaves_with_path(initial), jax.tree_util.tree_leaves(state.params), strict=True
        )
        if np.array_equal(before, np.asarray(after))
    ]
    unreached = [
        key
        for key in unmoved
        if key != "['model']['final_logits_bias']"
        and not (script.OBJECTIVE == "causal-LM" and "['encoder_attn" in key)
    ]
    assert not unreached, f"{config.model_type}: two steps left {unreached} as they were"
    return model, state.params["model"], batch, metrics


def assert_causal(script, model, params, batch, model_type):
    """The logits at each position must not depend on the tokens after it, which the loss scores them on."""
    import jax

    half = SEQ_LEN // 2
    later_changed = dict(batch, input_ids=batch["input_ids"].copy())
    later_changed["input_ids"][:, half:] = (batch["input_ids"][:, half:] + 1) % model.config.vocab_size
    logits = quick_compile(jax.jit(lambda p, b: script.model_logits(model, p, b, bf16=False)), params, batch)
    gap = np.abs(np.asarray(logits(params, batch)) - np.asarray(logits(params, later_changed)))[:, :half].max()
    assert gap < 1e-6, (
        f"{model_type}: the logits change by {gap:.1e} with the tokens after them (is_decoder="
        f"{model.config.is_decoder}): a causal LM that sees what it predicts"
    )


@pytest.mark.parametrize("path, model_type", cases())
def test_every_mapped_architecture_trains(
    path, model_type, scripts, tokenizer, train_rows, tiny_model_dir, corpus, tmp_path
):
    script = scripts[path]
    tiny_config(model_type, tokenizer).save_pretrained(tmp_path / "model")
    files = dict(train_file=corpus / "train_slice.txt", output_dir=tmp_path / "out")
    from_config = dict(config_name=str(tmp_path / "model"), tokenizer_name=str(tiny_model_dir))
    model, params, batch, metrics = train_two_steps(
        script, *script_args(script, **files, model_type=model_type, **from_config), train_rows[path, SEQ_LEN]
    )
    for step in metrics:
        assert math.isfinite(step["loss"]) and step["loss"] > 0, metrics
        assert math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0, metrics
    if script.OBJECTIVE == "causal-LM":
        assert_causal(script, model, params, batch, model_type)


@pytest.mark.parametrize("path", MAPPINGS)
def test_bigbird_block_sparse_attention(path, scripts, tokenizer, train_rows, tiny_model_dir, corpus, tmp_path):
    """BigBird's default attention, block-sparse, trains (drawing its random blocks from an rng of its own) on rows of
    a multiple of block_size tokens, more than (5 + 2 * num_random_blocks) blocks; shorter rows attend in full, as in
    PyTorch's BigBird, and so does the causal LM (block-sparse attention is not causal); a length that is not a
    multiple is refused in one line, and so is --line_by_line without --pad_to_max_length."""
    script = scripts[path]
    config = tiny_config("big_bird", tokenizer)
    config.update(dict(attention_type="block_sparse", block_size=16, num_random_blocks=1, max_position_embeddings=256))
    config.save_pretrained(tmp_path / "model")
    files = dict(train_file=corpus / "train_slice.txt", output_dir=tmp_path / "out", length=SPARSE_LEN)
    from_config = dict(config_name=str(tmp_path / "model"), tokenizer_name=str(tiny_model_dir))
    model_args, data_args, training_args = script_args(script, **files, model_type="big_bird", **from_config)
    model, params, batch, metrics = train_two_steps(
        script, model_args, data_args, training_args, train_rows[path, SPARSE_LEN]
    )
    assert all(math.isfinite(step["loss"]) and step["grad_norm"] > 0 for step in metrics), metrics
    if script.OBJECTIVE == "causal-LM":
        assert model.config.attention_type == "original_full"
        return assert_causal(script, model, params, batch, "big_bird")
    assert model.config.attention_type == "block_sparse"
    data_args.line_by_line = True
    with pytest.raises(SystemExit, match="--line_by_line with block-sparse attention .* needs --pad_to_max_length"):
        script.resolve_max_seq_length(data_args, config, tokenizer)
    script.fit_attention(config, 112)
    assert config.attention_type == "original_full"
    config.attention_type = "block_sparse"
    with pytest.raises(SystemExit, match=f"--{script.LENGTH_FLAG} 120 is not a multiple of 16.*pass 112 or 128"):
        script.fit_attention(config, 120)


@pytest.mark.parametrize("model_type", ["roberta", "roberta-prelayernorm", "xlm-roberta", "bert", "bart"])
def test_the_default_length_fits_the_models_positions(model_type, scripts, tokenizer, monkeypatch, caplog):
    """RoBERTa's kind numbers positions from pad_token_id + 1: 64 position embeddings with pad 1 hold 62 tokens, the
    default length under a tokenizer of 1,024, and one more is refused in one line, by the value typed (BERT and BART:
    64). A length above the tokenizer's, within the positions, is cut to it, with a warning."""
    config = tiny_config(model_type, tokenizer)
    monkeypatch.setattr(tokenizer, "model_max_length", 1024)
    fits = 64 - (tokenizer.pad_token_id + 1 if "roberta" in model_type else 0)
    bart = model_type == "bart" and load_script("flax/run_bart_dlm_flax.py", "architectures_run_bart_dlm_flax")
    for script in [bart] if bart else scripts.values():
        data_args = script.DataTrainingArguments()
        assert script.resolve_max_seq_length(data_args, config, tokenizer) == fits
        for length in (fits + 1, 2000):  # named as typed, not as the tokenizer's cut of it (1024)
            setattr(data_args, script.LENGTH_FLAG, length)
            with pytest.raises(
                SystemExit, match=f"--{script.LENGTH_FLAG} {length} is longer than the model's {fits} "
            ):
                script.resolve_max_seq_length(data_args, config, tokenizer)
        monkeypatch.setattr(tokenizer, "model_max_length", fits - 2)
        setattr(data_args, script.LENGTH_FLAG, fits)
        assert script.resolve_max_seq_length(data_args, config, tokenizer) == fits - 2
        assert (
            f"--{script.LENGTH_FLAG} {fits} is larger than the tokenizer's maximum ({fits - 2}); using" in caplog.text
        )
        monkeypatch.setattr(tokenizer, "model_max_length", 1024)
