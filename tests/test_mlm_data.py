"""The MLM collator and group_texts of flax/run_mlm_flax.py, against their specification."""

from types import SimpleNamespace

import datasets
import numpy as np
import pytest
from conftest import load_script
from transformers import AutoTokenizer

mlm = load_script("flax/run_mlm_flax.py", "run_mlm_flax")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def masked(tokenizer):
    """A large batch of real tokenized lines (special tokens and padding included), masked once."""
    rng = np.random.default_rng(0)
    words = ["the", "market", "fell", "N", "points", "<unk>", "said", "mr.", "shares", "of", "company"]
    lines = [" ".join(rng.choice(words, size=rng.integers(3, 40))) for _ in range(4000)]
    encoded = tokenizer(lines, return_special_tokens_mask=True)
    collator = mlm.FlaxDataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=0.15)
    original = tokenizer.pad(dict(encoded), pad_to_multiple_of=16, return_tensors="np")
    batch = collator(dict(encoded), (1,), row_ids=np.arange(len(lines)), row_width=original["input_ids"].shape[1])
    return original, batch


def test_shapes_and_padding(masked):
    original, batch = masked
    assert batch["input_ids"].shape == batch["labels"].shape == original["input_ids"].shape
    assert batch["input_ids"].shape[1] % 16 == 0
    assert (original["attention_mask"] == 0).any(), (
        "the batch must contain padding for the tests below to mean anything"
    )


def protected_positions(original, tokenizer):
    """Added special tokens, padding, and special tokens written in the text (PTB's literal <unk>)."""
    return (
        original["special_tokens_mask"].astype(bool)
        | (original["attention_mask"] == 0)
        | np.isin(original["input_ids"], tokenizer.all_special_ids)
    )


def test_special_and_pad_tokens_are_never_selected(masked, tokenizer):
    original, batch = masked
    protected = protected_positions(original, tokenizer)
    assert (original["input_ids"][~original["special_tokens_mask"].astype(bool)] == tokenizer.unk_token_id).any()
    assert (batch["labels"][protected] == -100).all()
    assert (batch["input_ids"][protected] == original["input_ids"][protected]).all()
    special_ids = set(tokenizer.all_special_ids)
    selected = batch["labels"] != -100
    assert not set(np.unique(original["input_ids"][selected])) & special_ids


def test_labels_are_the_original_ids_on_the_mask_and_minus_100_elsewhere(masked):
    original, batch = masked
    selected = batch["labels"] != -100
    assert (batch["labels"][selected] == original["input_ids"][selected]).all()
    # Off the mask, inputs are untouched.
    assert (batch["input_ids"][~selected] == original["input_ids"][~selected]).all()


def test_masking_rate_and_80_10_10_split(masked, tokenizer):
    original, batch = masked
    maskable = ~protected_positions(original, tokenizer)
    selected = batch["labels"] != -100
    n_maskable, n_selected = maskable.sum(), selected.sum()
    assert n_selected > 10000
    # Binomial standard deviations are ~0.0008 for the rate and ~0.002-0.003 for the split: 5-sigma bounds (seeded
    # numpy draws: the same on every CPU).
    assert abs(n_selected / n_maskable - 0.15) < 0.005
    inputs, ids = batch["input_ids"][selected], original["input_ids"][selected]
    as_mask = (inputs == tokenizer.mask_token_id).mean()
    unchanged = (inputs == ids).mean()
    changed_other = ((inputs != ids) & (inputs != tokenizer.mask_token_id)).mean()
    # A random replacement equals the original token 1/vocab of the time: it counts as unchanged.
    p_same = 1 / tokenizer.vocab_size
    assert abs(as_mask - 0.8) < 0.02
    assert abs(unchanged - (0.1 + 0.1 * p_same)) < 0.012
    assert abs(changed_other - 0.1 * (1 - p_same)) < 0.012


def upstream_group_texts(examples, max_seq_length):
    """Upstream's definition, verbatim in substance: sum(lists, []) then cut, dropping the remainder."""
    concatenated_examples = {k: sum(examples[k], []) for k in examples.keys()}
    total_length = len(concatenated_examples[list(examples.keys())[0]])
    if total_length >= max_seq_length:
        total_length = (total_length // max_seq_length) * max_seq_length
    return {
        k: [t[i : i + max_seq_length] for i in range(0, total_length, max_seq_length)]
        for k, t in concatenated_examples.items()
    }


@pytest.mark.parametrize("seed", range(8))
def test_group_texts_matches_upstream(seed):
    rng = np.random.default_rng(seed)
    n_texts = int(rng.integers(1, 50))
    lengths = rng.integers(0, 60, size=n_texts)
    examples = {
        "input_ids": [rng.integers(0, 1000, size=n).tolist() for n in lengths],
        "special_tokens_mask": [rng.integers(0, 2, size=n).tolist() for n in lengths],
    }
    block = int(rng.choice([4, 16, 64, 10_000]))  # 10_000: shorter than one block, kept whole as upstream
    ours = mlm.group_texts(examples, block)
    assert ours == upstream_group_texts(examples, block)
    total = int(lengths.sum())
    if total >= block:
        assert all(len(row) == block for row in ours["input_ids"])
        assert len(ours["input_ids"]) == total // block


def test_batch_splits_keep_or_drop_the_remainder():
    idx = np.arange(10)
    assert [len(b) for b in mlm.generate_batch_splits(idx, 4)] == [4, 4]
    assert np.concatenate(mlm.generate_batch_splits(idx, 4, drop_last=False)).tolist() == list(range(10))


def test_weight_decay_mask_skips_biases_and_layer_norms():
    params = {
        "encoder": {"dense": {"kernel": 1, "bias": 2}, "LayerNorm": {"scale": 3, "bias": 4}},
        "embeddings": {"word_embeddings": {"embedding": 5}},
    }
    mask = mlm.decay_mask_fn(params)
    assert mask["encoder"]["dense"] == {"kernel": True, "bias": False}
    assert mask["encoder"]["LayerNorm"] == {"scale": False, "bias": False}
    assert mask["embeddings"]["word_embeddings"]["embedding"] is True


def test_weight_decay_mask_matches_whole_module_names():
    """A norm is known by its own module's whole name: a Dense under a module named ln_head, and a module whose name
    merely holds "ln", keep their decay, and neither takes it from an unrelated (dense, kernel) elsewhere."""
    params = {
        "heads": {"ln_head": {"dense": {"kernel": 1}, "LayerNorm": {"scale": 2}}},
        "encoder": {"dense": {"kernel": 3}, "final_layer_norm": {"weight": 4}},
        "kiln": {"kernel": 5},
        "ln_f": {"scale": 6},
        "layernorm_embedding": {"scale": 7},
    }
    mask = mlm.decay_mask_fn(params)
    assert mask["heads"]["ln_head"] == {"dense": {"kernel": True}, "LayerNorm": {"scale": False}}
    assert mask["encoder"] == {"dense": {"kernel": True}, "final_layer_norm": {"weight": False}}
    assert mask["kiln"]["kernel"] is True and mask["ln_f"]["scale"] is False
    assert mask["layernorm_embedding"]["scale"] is False


def test_learning_rate_warms_up_then_decays_to_zero():
    schedule = mlm.create_learning_rate_fn(num_train_steps=100, num_warmup_steps=10, learning_rate=1.0)
    assert float(schedule(0)) == 0.0
    assert abs(float(schedule(5)) - 0.5) < 1e-6  # float32 arithmetic: 2**-24 relative
    assert abs(float(schedule(10)) - 1.0) < 1e-6
    assert abs(float(schedule(55)) - 0.5) < 1e-6
    assert float(schedule(100)) == 0.0


def test_masks_depend_on_the_example_not_the_batch(tokenizer):
    """Each example's masks are drawn from (seed, index): the same whatever the batching."""
    collator = mlm.FlaxDataCollatorForLanguageModeling(tokenizer=tokenizer)
    rng = np.random.default_rng(3)
    examples = [rng.integers(5, 1000, size=n).tolist() for n in rng.integers(5, 60, size=24)]
    ids = np.arange(100, 124)

    def collate(rows):
        batch = {"input_ids": [examples[i] for i in rows], "attention_mask": [[1] * len(examples[i]) for i in rows]}
        out = collator(batch, (7,), row_ids=ids[rows], row_width=64)
        return {i: out["labels"][k][: len(examples[i])].tolist() for k, i in enumerate(rows)}

    whole = collate(list(range(24)))
    pieces = {}
    for rows in ([5, 0, 17], list(range(1, 5)), list(range(6, 17)), list(range(18, 24))):
        pieces.update(collate(rows))
    assert pieces == whole
    assert sum(label != -100 for labels in whole.values() for label in labels) > 20


def test_a_batch_of_new_shapes_is_logged_as_a_recompilation(caplog):
    """Each new batch width compiles the train step again: the loop says so, with the shapes that changed."""
    loop, calls, jitted = mlm.Loop(first_step=0), [], mlm.jax.jit(lambda state, batch, votes=None: (state, {}))

    def step(state, batch, votes=None):
        calls.append(batch["labels"].shape)
        return jitted(state, batch, votes)

    step.trace = jitted.trace  # the loop counts the first step's FLOPs from its trace

    with caplog.at_level("INFO"):
        for width in (24, 24, 64, 24, 64):
            mlm.timed_step(step, None, {"input_ids": np.zeros((1, 2, 64)), "labels": np.zeros((1, 2, width))}, loop)
    again = [r.getMessage() for r in caplog.records if "compiles again" in r.getMessage()]
    assert len(calls) == 5 and again == [
        "the train step compiles again, for new batch shapes: labels (1, 2, 24) -> (1, 2, 64)"
    ]


def test_each_process_collates_only_its_block_of_every_micro_batch(monkeypatch):
    """In memory with two processes, each collates only its rows of a global batch of two micro-batches: process p
    the p-th half of each micro-batch (the layout global_batch assembles), so that together they are the batch."""
    dataset = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(16)]})
    monkeypatch.setattr(mlm.jax, "process_count", lambda: 2)
    shares = []
    for process in (0, 1):
        plan = SimpleNamespace(num_epochs=1, num_train_examples=16, train_batch_size=8, process_index=process)
        args = SimpleNamespace(seed=0, gradient_accumulation_steps=2)
        examples, _, rows, *_ = next(
            mlm.epoch_rows(SimpleNamespace(plan=plan, args=args, dataset={"train": dataset}), mlm.TrainingProgress())
        )
        assert [ids[0] for ids in examples["input_ids"]] == list(rows)
        shares.append(list(rows))
    whole = np.sort(mlm.epoch_batches(16, 8, 0, 0)[0]).reshape(2, 2, 2)  # [micro-batch, process, row]
    assert shares == [list(whole[:, process].reshape(-1)) for process in (0, 1)]
