# === the objective: multi-token prediction ======================================================================
# A worked example of an objective with parameters of its own, for a copy of run_clm_flax.py:
# tests/test_objective_block.py puts each definition here in place of the block's own of the same name (the rest of
# the block, shifted_token_sums among it, stays) and changes nothing outside the block. Beside the
# next-token head, two heads (LayerNorm -> Dense -> GELU -> the model's own output embedding) predict the tokens 2 and
# 3 ahead from the final hidden state (Gloeckle et al., 2024); the loss is the next-token loss + 0.3 x their mean.
# The heads are params["objective"]: trained, sharded, checkpointed and restored with the model, and never saved with
# it, so the saved model is a plain GPT-2.

MODEL_TYPES = ("gpt2",)
AHEAD = (2, 3)  # each extra head predicts the token this far ahead
SCORED_TOKENS = {"loss": "predicted_tokens", **{f"ahead_{k}_loss": f"ahead_{k}_tokens" for k in AHEAD}}
LOSS_TERMS = {"loss": 1.0, **{f"ahead_{k}_loss": 0.3 / len(AHEAD) for k in AHEAD}}
MIN_LENGTH = max(AHEAD) + 1  # tokens a block needs: one to read, and the furthest one ahead to predict


class AheadHeads(nn.Module):
    """A LayerNorm -> Dense -> GELU for each shift in AHEAD: the output embedding's inputs for the tokens ahead."""

    width: int

    @nn.compact
    def __call__(self, hidden):
        return [nn.gelu(nn.Dense(self.width, name=f"dense_{k}")(nn.LayerNorm(name=f"ln_{k}")(hidden))) for k in AHEAD]


def init_objective_params(config, rng):
    """The extra heads' parameters, new: a pretrained model brings none."""
    return AheadHeads(config.hidden_size).init(rng, jnp.zeros((1, 1, config.hidden_size)))["params"]


def loss_sums(model, params, batch, rng, train, bf16):
    """Next-token cross-entropy and accuracy, and each extra head's cross-entropy of the token it predicts, through
    the model's own output layer (capture_head's kernel and bias) and over the positions that have that token."""
    head = {}
    interceptors = [capture_head(head, model.config.vocab_size)]
    hidden = model_outputs(model, params["model"], batch, bf16, interceptors, dropout_rng=rng, train=train).hidden
    loss, correct, count = shifted_token_sums(head, batch, bf16, shift=1)
    sums = {"loss": (loss, count), "accuracy": (correct, count)}
    heads = objective_apply(AheadHeads(hidden.shape[-1]), params["objective"], hidden, bf16=bf16)
    for shift, inputs in zip(AHEAD, heads):
        ahead = {**head, "inputs": inputs, "logits": apply_head(head, inputs, bf16)}
        loss, _, count = shifted_token_sums(ahead, batch, bf16, shift)
        sums[f"ahead_{shift}_loss"] = (loss, count)
    return sums
