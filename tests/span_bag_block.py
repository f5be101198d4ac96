# === the objective: T5 span corruption, and the encoder's bag of what the spans removed =========================
# A worked example of an objective on an encoder's states, for a copy of run_t5_mlm_flax.py:
# tests/test_objective_block.py puts each definition here in place of the block's own of the same name (the rest of
# the block stays) and changes nothing outside the block. Beside span corruption, a head of the block's own
# (LayerNorm -> Dense onto the vocabulary) reads the encoder's final states (ModelStates.encoder_hidden), averaged
# over each row's real input tokens, and predicts which tokens the corruption removed from the row's input (those of
# its targets found nowhere in its inputs: sentinels and EOS are in both), a sigmoid cross-entropy over the
# vocabulary. That is a second loss term, "bag_loss", one count a row, weighted by --bag_loss_weight. The head is
# params["objective"]: trained, sharded, checkpointed and restored with the model, never saved with it, so the saved
# model is a plain T5.

SCORED_TOKENS = {"loss": "target_tokens", "bag_loss": "bag_rows"}
LOSS_TERMS = {"loss": 1.0, "bag_loss": 0.5}  # bag_loss's weight: --bag_loss_weight


@dataclass
class DataTrainingArguments(DataArguments):
    max_seq_length: int | None = arg(
        None, "The input length after span corruption (default: the tokenizer's maximum)."
    )
    mlm_probability: float = arg(0.15, "Ratio of tokens to mask for span masked language modeling loss")
    mean_noise_span_length: float = arg(3.0, "Mean span length of masked tokens")
    train_ref_file: str | None = arg(None, "Accepted as upstream, unused: no whole-word masking by reference.")
    validation_ref_file: str | None = arg(None, "Accepted as upstream, unused: no whole-word masking by reference.")
    bag_loss_weight: float = arg(0.5, "The weight of the bag head's loss beside span corruption's.")


class BagHead(nn.Module):
    """LayerNorm -> Dense: a logit for each token of the vocabulary, that the row's spans removed it."""

    vocab_size: int

    @nn.compact
    def __call__(self, pooled):
        return nn.Dense(self.vocab_size, name="dense")(nn.LayerNorm(name="ln")(pooled))


def init_objective_params(config, rng):
    """The bag head's parameters, new: a pretrained model brings none."""
    return BagHead(config.vocab_size).init(rng, jnp.zeros((1, config.d_model)))["params"]


def multi_hot(ids, mask, vocab_size):
    """[rows, vocab_size]: 1.0 where a row has the id at a position `mask` sets."""
    rows = jnp.arange(ids.shape[0])[:, None]
    zeros = jnp.zeros((ids.shape[0], vocab_size), jnp.float32)
    return zeros.at[rows, jnp.where(mask, ids, 0)].max(mask.astype(jnp.float32))


def loss_sums(model, params, batch, rng, train, bf16):
    """Span corruption's cross-entropy and accuracy over the target tokens, and the bag head's mean sigmoid
    cross-entropy over the vocabulary, summed over the rows that have targets (padding rows have none)."""
    batch = dict(batch)
    labels = batch.pop("labels")
    states = model_outputs(model, params["model"], batch, bf16, dropout_rng=rng, train=train)
    loss, correct, count = token_sums(states.logits, labels, labels >= 0)
    real = batch["attention_mask"][..., None]
    pooled = (states.encoder_hidden * real).sum(1) / jnp.maximum(real.sum(1), 1)
    vocab_size = model.config.vocab_size
    logits = objective_apply(BagHead(vocab_size), params["objective"], pooled, bf16=bf16).astype(jnp.float32)
    inputs = multi_hot(batch["input_ids"], batch["attention_mask"] > 0, vocab_size)
    removed = multi_hot(labels, labels >= 0, vocab_size) * (1.0 - inputs)
    rows = (labels >= 0).any(axis=1)
    bag = (optax.sigmoid_binary_cross_entropy(logits, removed).mean(axis=1) * rows).sum()
    return {"loss": (loss, count), "accuracy": (correct, count), "bag_loss": (bag, rows.sum())}
