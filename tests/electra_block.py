# === the objective: ELECTRA replaced-token detection ==============================================================
# A worked example of another objective: tests/test_objective_block.py pastes this block in place of
# run_mlm_flax.py's and changes nothing else. A small generator (a masked LM) fills the masked positions with its
# own samples; the discriminator learns which tokens were replaced (Clark et al., 2020). Both are trained together.

MODEL_CLASS = transformers.FlaxAutoModelForPreTraining  # the discriminator; the generator: a masked LM
MODEL_TYPES = ("electra",)
OBJECTIVE = "replaced-token detection"  # in messages
LENGTH_FLAG = "max_seq_length"  # the argument that sets the sequence length
SCORED_TOKENS = {"generator_loss": "masked_tokens", "discriminator_loss": "real_tokens"}  # counts, in the results
LOSS_TERMS = {"generator_loss": 1.0, "discriminator_loss": 50.0}  # the paper's weights
MIN_LENGTH = 1  # tokens a row needs: one to mask
GENERATOR_SIZE = 0.25  # the generator's hidden and intermediate sizes, as a fraction of the discriminator's


@dataclass
class DataTrainingArguments(DataArguments):
    max_seq_length: int | None = arg(None, "Tokens per row (default: the tokenizer's maximum).")
    mlm_probability: float = arg(0.15, "Ratio of tokens the generator fills in.")


def validate_objective(data_args):
    if not 0.0 < data_args.mlm_probability < 1.0:
        fail(f"--mlm_probability must be in (0, 1), got {data_args.mlm_probability}")


def fit_objective(config, tokenizer, source):
    if tokenizer.mask_token is None:
        fail(f"tokenizer {source!r} has no mask token, which the generator's input needs")


def resolve_max_seq_length(data_args, config, tokenizer):
    """The tokenizer's limit and the model's positions both bound the length (bound_length); 0 is refused, not taken
    for the default."""
    length = bound_length(data_args.max_seq_length, config, tokenizer)
    if length < MIN_LENGTH:
        fail(f"--max_seq_length must be at least {MIN_LENGTH}, got {length}")
    return length


def preprocess(raw_datasets, data_args, tokenizer, max_seq_length):
    """Tokenize every text and pack the token stream into blocks."""
    columns = list(raw_datasets["train" if "train" in raw_datasets else "validation"].features)
    kwargs = dict(num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache)
    tokenized = raw_datasets.map(
        lambda texts: tokenizer(texts, return_special_tokens_mask=True),
        input_columns=[text_column(raw_datasets, data_args)],
        batched=True,
        remove_columns=columns,
        **kwargs,
    )
    return tokenized.map(group_texts, batched=True, fn_kwargs={"block_size": max_seq_length}, **kwargs)


def build_collator(data_args, config, tokenizer, max_seq_length, dataset):
    return tokenizer, data_args.mlm_probability, max_seq_length


def resume_checks(collator):
    return {}


def collate_batch(collator, examples, seed, row_ids, num_rows, train=True):
    """Rows padded to the sequence length; mlm_probability of each row's real tokens, drawn from (seed, row), become
    the mask token, and their ids the labels (-100 elsewhere)."""
    tokenizer, probability, length = collator
    ids = np.full((num_rows, length), tokenizer.pad_token_id, np.int32)
    special = np.ones_like(ids)
    for row, (tokens, specials) in enumerate(zip(examples["input_ids"], examples["special_tokens_mask"])):
        ids[row, : len(tokens)], special[row, : len(tokens)] = tokens, specials
    draws = np.ones((num_rows, length))
    draws[: len(row_ids)] = [np.random.default_rng([*seed, int(i)]).random(length) for i in row_ids]
    masked = (draws < probability) & (special == 0)
    return {
        "input_ids": np.where(masked, tokenizer.mask_token_id, ids),
        "attention_mask": (ids != tokenizer.pad_token_id).astype(np.int32),
        "labels": np.where(masked, ids, -100),
    }


def build_model(model_args, training_args, config, abstract):
    """(generator, discriminator) and their parameters under those names: the discriminator from
    --model_name_or_path, the generator from its generator/ folder, or both new from the config."""
    small = {name: int(getattr(config, name) * GENERATOR_SIZE) for name in ("hidden_size", "intermediate_size")}
    generator_config = transformers.ElectraConfig(**{**config.to_dict(), **small})
    path = model_args.model_name_or_path
    generator, generator_params = init_model(
        transformers.FlaxAutoModelForMaskedLM,
        generator_config,
        path and os.path.join(path, "generator"),
        model_args,
        training_args,
        abstract,
    )
    discriminator, discriminator_params = init_model(MODEL_CLASS, config, path, model_args, training_args, abstract)
    return (generator, discriminator), {"generator": generator_params, "discriminator": discriminator_params}


def init_objective_params(config, rng):
    return {}


def save_model(model, params, output_dir):
    """The discriminator in output_dir (what one fine-tunes), the generator in output_dir/generator."""
    generator, discriminator = model
    discriminator.save_pretrained(output_dir, params=params["discriminator"])
    generator.save_pretrained(os.path.join(output_dir, "generator"), params=params["generator"])


def loss_sums(model, params, batch, rng, train, bf16):
    """The generator's cross-entropy and accuracy at the masked positions; its samples (not differentiated) fill
    them in, and the discriminator's binary cross-entropy and accuracy over every real token: replaced or not."""
    generator, discriminator = model
    params, batch = params["model"], dict(batch)
    labels = batch.pop("labels")
    masked, real = labels != -100, batch["attention_mask"]
    generator_rng, sample_rng, discriminator_rng = jax.random.split(rng, 3)
    logits = model_logits(generator, params["generator"], batch, bf16, dropout_rng=generator_rng, train=train)
    sampled = jax.random.categorical(sample_rng, lax.stop_gradient(logits).astype(jnp.float32))
    inputs = jnp.where(masked, sampled, batch["input_ids"])
    replaced = masked & (inputs != labels)
    scores = model_logits(
        discriminator,
        params["discriminator"],
        {**batch, "input_ids": inputs},
        bf16,
        dropout_rng=discriminator_rng,
        train=train,
    ).astype(jnp.float32)
    generator_loss, generator_correct, count = token_sums(logits, labels, masked)
    return {
        "generator_loss": (generator_loss, count),
        "generator_accuracy": (generator_correct, count),
        "discriminator_loss": ((optax.sigmoid_binary_cross_entropy(scores, replaced) * real).sum(), real.sum()),
        "discriminator_accuracy": ((((scores > 0) == replaced) * real).sum(), real.sum()),
    }
