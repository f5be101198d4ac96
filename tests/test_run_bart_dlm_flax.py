"""flax/run_bart_dlm_flax.py: BART's sentence permutation and text infilling, and the script end to end."""

import json
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import TINY_BART, TWO_DEVICES, check_ok, error_line, eval_reloaded, load_script, logged_losses, run, script_args

SCRIPT = "flax/run_bart_dlm_flax.py"
bart = load_script(SCRIPT, "run_bart_dlm_flax")


@pytest.fixture(scope="module")
def blocks(bart_dir):
    """Rows shaped like the script's blocks: <s> sentences separated by <pad> </s>, 128 tokens."""
    tokenizer = AutoTokenizer.from_pretrained(bart_dir)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(300):
        row = [tokenizer.bos_token_id]
        while len(row) < 127:
            row += rng.integers(5, 1000, size=rng.integers(3, 20)).tolist() + [tokenizer.pad_token_id]
        rows.append(row[:127] + [tokenizer.eos_token_id])
    return tokenizer, np.array(rows)


def collator(tokenizer, **kw):
    return bart.FlaxDataCollatorForBartDenoisingLM(tokenizer=tokenizer, decoder_start_token_id=2, **kw)


def test_permutation_keeps_the_multiset_of_sentences(blocks):
    tokenizer, ids = blocks
    c = collator(tokenizer)
    permuted = c.permute_sentences(ids, np.random.default_rng(1))
    moved = 0
    for before, after in zip(ids, permuted, strict=True):
        a = Counter(tuple(s) for s in c.sentences(before))
        b = Counter(tuple(s) for s in c.sentences(after))
        assert a == b
        moved += [tuple(s) for s in c.sentences(before)] != [tuple(s) for s in c.sentences(after)]
    assert moved > 250  # ratio 1.0: almost every row is reordered


def test_infilling_masks_about_mlm_probability_and_collapses_spans(blocks):
    tokenizer, ids = blocks
    c = collator(tokenizer, mask_ratio=0.3)
    new_ids, mask = c.span_mask_tokens(ids.copy(), np.random.default_rng(2))
    special = np.isin(ids, tokenizer.all_special_ids)
    fraction = mask.sum() / (~special).sum()
    # The span budget is 30 % of the tokens; overlapping spans and sentence ends only remove from it.
    assert 0.75 * 0.3 <= fraction <= 0.3 + 0.01, fraction
    assert not (mask & special).any()
    # Each span becomes one <mask>: the rows shrink by exactly the masked tokens beyond each span's first.
    starts = mask & ~np.roll(mask, 1, axis=1)
    for row in range(len(ids)):
        kept = new_ids[row][new_ids[row] != tokenizer.pad_token_id]
        expected = ids[row][~(mask[row] & ~starts[row])]
        expected = np.where(mask[row][~(mask[row] & ~starts[row])], tokenizer.mask_token_id, expected)
        assert kept.tolist() == expected[expected != tokenizer.pad_token_id].tolist()


def test_span_lengths_follow_the_poisson_mean(bart_dir):
    tokenizer = AutoTokenizer.from_pretrained(bart_dir)
    lengths = collator(tokenizer, poisson_lambda=3.0).span_lengths(200_000, np.random.default_rng(3))
    assert (lengths > 0).all()
    assert abs(lengths.sum() - 200_000) <= lengths.max()
    # Zero-length spans are dropped, so the mean is that of a zero-truncated Poisson: 3 / (1 - e^-3) = 3.157.
    # About 63,000 spans with variance ~2.7: a standard error of 0.0066.
    assert abs(lengths.mean() - 3 / (1 - np.exp(-3))) < 0.04


def test_labels_are_the_original_sequence(blocks):
    tokenizer, ids = blocks
    batch = collator(tokenizer)({"input_ids": ids.tolist()}, (4,), row_ids=np.arange(len(ids)))
    special = np.isin(ids, tokenizer.all_special_ids)
    assert (batch["labels"][~special] == ids[~special]).all() and (batch["labels"][special] == -100).all()
    assert (batch["decoder_input_ids"][:, 1:] == ids[:, :-1]).all() and (batch["decoder_input_ids"][:, 0] == 2).all()
    assert (batch["attention_mask"] == (batch["input_ids"] != tokenizer.pad_token_id)).all()
    assert (batch["input_ids"] == tokenizer.mask_token_id).any()
    # The noise depends on the example only.
    whole = collator(tokenizer)({"input_ids": ids[:6].tolist()}, (7,), row_ids=np.arange(6))
    part = collator(tokenizer)({"input_ids": ids[3:6].tolist()}, (7,), row_ids=np.arange(3, 6))
    assert (whole["input_ids"][3:] == part["input_ids"]).all()


def test_sentence_splitter_works_offline_in_norwegian():
    from sentencex import segment

    assert [s.strip() for s in segment("nb", "Dette er en test. Det var alt.")] == ["Dette er en test.", "Det var alt."]


@pytest.fixture(scope="module")
def trained(bart_dir, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bartrun")
    args = script_args(SCRIPT, "bart", bart_dir, corpus, out, "--max_seq_length", "64", "--per_device_train_batch_size", "8",
                       "--learning_rate", "3e-3", "--warmup_steps", "10", "--num_train_epochs", "1", "--logging_steps", "10",
                       "--do_train", "--do_eval", "--overwrite_output_dir")
    return out, args, check_ok(run(args, env=TWO_DEVICES))


def test_trains_on_two_devices_and_reloads(trained, tmp_path):
    out, args, result = trained
    log = result.stdout + result.stderr
    assert "2 devices" in log
    losses = logged_losses(log)
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses
    metrics = json.loads((out / "eval_results.json").read_text())
    assert metrics["eval_loss"] < np.log(1000) and 0.0 < metrics["eval_accuracy"] < 1.0
    reloaded = eval_reloaded(args, out, tmp_path / "again")
    assert reloaded["eval_target_tokens"] == metrics["eval_target_tokens"]
    assert reloaded["eval_loss"] == pytest.approx(metrics["eval_loss"], abs=1e-5)


def test_bad_input(bart_dir, corpus, tmp_path):
    base = script_args(SCRIPT, "bart", bart_dir, corpus, tmp_path / "o", "--do_train")
    assert "--permute_sentence_ratio" in error_line(run(base + ["--permute_sentence_ratio", "2"]), "run_bart_dlm_flax.py")
    short = tmp_path / "short"
    check_ok(run(["tokenizers/create_config.py", "--model_type", "bart", "--tokenizer_name", str(bart_dir), "--output_dir",
                  str(short), "--config_overrides", TINY_BART + ",max_position_embeddings=32"]))
    short_args = list(base) + ["--max_seq_length", "64"]
    short_args[short_args.index("--config_name") + 1] = str(short)
    assert "--max_seq_length 64 is longer than the model's 32 positions" in error_line(run(short_args), "run_bart_dlm_flax.py")
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    assert "--dataset_name" in error_line(run(base + ["--dataset_name", "oscar"], env=offline), "run_bart_dlm_flax.py")
    assert not (tmp_path / "o").exists()
