"""flax/run_bart_dlm_flax.py: BART's sentence permutation and text infilling, and the script end to end."""

import json
from collections import Counter

import numpy as np
import pytest
from conftest import (
    RELOAD_RTOL,
    TINY_BART,
    TWO_DEVICES_OPTIMISED,
    check_names_itself,
    check_ok,
    error_line,
    eval_reloaded,
    load_script,
    logged_losses,
    refusal,
    renamed_copy,
    run,
    script_args,
)
from transformers import AutoTokenizer

SCRIPT = "flax/run_bart_dlm_flax.py"
bart = load_script(SCRIPT, "run_bart_dlm_flax")


@pytest.fixture(scope="module")
def blocks(bart_dir, corpus, tmp_path_factory):
    """3,000 real blocks of 128 tokens (PTB, as the script packs them), from flax/dump_noised_examples.py."""
    out = tmp_path_factory.mktemp("dump")
    args = script_args(
        SCRIPT,
        "bart",
        bart_dir,
        corpus,
        out,
        "--max_seq_length",
        "128",
        "--per_device_train_batch_size",
        "64",
        "--do_train",
        "--mask_random",
        "0",
    )
    args[args.index("--train_file") + 1] = str(corpus / "train.txt")
    check_ok(run(["flax/dump_noised_examples.py", SCRIPT, "--rows", "3000", "--", *args[1:]]))
    rows = [json.loads(line) for line in (out / "noised_examples.jsonl").read_text().splitlines()]
    return AutoTokenizer.from_pretrained(bart_dir), rows


def collator(tokenizer, **kw):
    return bart.FlaxDataCollatorForBartDenoisingLM(tokenizer=tokenizer, decoder_start_token_id=2, **kw)


def runs(mask):
    """(start, end) of each run of True."""
    edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True)


def noise_properties(c, originals):
    """Text infilling's statistics over rows, stage by stage as the collator runs them (no permutation)."""
    shares, lengths_in_words, spans, zero, drawn, random_spans, over_budget = [], [], 0, 0, 0, 0, 0
    for i, row in enumerate(originals):
        rng = np.random.default_rng([9, i])
        starts = c.word_starts(row)
        budget = int(np.ceil(starts.sum() * c.mask_ratio))
        lengths = c.span_lengths(budget, rng)
        noised, mask = c.mask_spans(row, lengths[lengths > 0], rng)
        kept = len(noised) - (~mask).sum()  # one token per span left
        assert len(noised) == (~mask).sum() + kept and not np.isin(c.tokenizer.mask_token_id, row)
        for start, end in runs(mask):  # whole words: every span starts at a word start and stops before one
            assert starts[start] and (end == len(row) or starts[end] or c.special[row[end]]), (row, start, end)
        over_budget += (starts & mask).sum() > budget
        shares.append(mask.sum() / (~c.special[row]).sum())
        lengths_in_words.append((starts & mask).sum() / max(kept, 1))
        spans, zero, drawn = spans + kept, zero + (lengths == 0).sum(), drawn + len(lengths)
        random_spans += kept - (noised == c.tokenizer.mask_token_id).sum()
    return dict(
        share=np.mean(shares),
        share_std=np.std(shares),
        spans_per_100=100 * spans / sum(len(r) for r in originals),
        tokens_per_span=sum(s * (~c.special[r]).sum() for s, r in zip(shares, originals, strict=True)) / spans,
        words_per_span=np.mean(lengths_in_words),
        zero_share=zero / drawn,
        random_share=random_spans / spans,
        over_budget=over_budget,
        spans=spans,
        drawn=drawn,
    )


def test_infilling_follows_fairseq(blocks):
    """Per-row budget of ceil(words x 0.3) words in whole-word spans, zero-length draws kept for insertion, a tenth of
    the spans random; bounds are 5 sigma where the statistic is a count, and the spread is that of a per-row budget
    (fairseq: std about 0.047 at 128 tokens; upstream's batch-wide budget gave 0.072)."""
    tokenizer, rows = blocks
    p = noise_properties(collator(tokenizer), [np.array(r["original_ids"]) for r in rows])
    assert p["over_budget"] == 0
    # Spans stop at sentence and document ends (PTB: a document per line) and merge where they overlap, so fewer than
    # 30 % of the tokens are masked, in spans of about 5 tokens (fairseq's BART: 4.9-5.3).
    assert 0.2 < p["share"] <= 0.3 and p["share_std"] < 0.06 and 4.0 < p["tokens_per_span"] < 6.0, p
    # Zero-length draws: about e^-3 = 0.050 of the draws (the last of a row is cut to fit and never zero).
    assert 0.035 < p["zero_share"] < 0.06, p
    assert abs(p["random_share"] - 0.1) < 5 * np.sqrt(0.09 / p["spans"]), p  # 5 sigma of seeded numpy draws


def test_span_lengths_are_poisson_cut_to_the_budget(bart_dir):
    c = collator(AutoTokenizer.from_pretrained(bart_dir))
    lengths = c.span_lengths(200_000, np.random.default_rng(3))
    assert lengths.sum() == 200_000 and lengths[-1] > 0
    n = len(lengths)  # about 66,700 Poisson(3) draws: zeros e^-3 of them, mean 3 (variance 3), each within 5 sigma
    assert abs((lengths == 0).mean() - np.exp(-3)) < 5 * np.sqrt(np.exp(-3) * (1 - np.exp(-3)) / n)
    assert abs(lengths.mean() - 3.0) < 5 * np.sqrt(3.0 / n)
    assert c.span_lengths(0, np.random.default_rng(3)).size == 0


def test_token_spans_as_upstream(blocks):
    tokenizer, rows = blocks
    c = collator(tokenizer, mask_whole_words=False, mask_random=0.0, insert_zero_length_spans=False)
    row = np.array(rows[0]["original_ids"])
    assert (c.word_starts(row) == ~c.special[row]).all()
    out = c({"input_ids": [row]}, (1,), [0])
    assert (out["input_ids"] == tokenizer.mask_token_id).sum() > 0


def test_inserted_masks(blocks):
    """Zero-length spans become <mask> tokens at random inner places; the rest of the row keeps its order."""
    tokenizer, rows = blocks
    c = collator(tokenizer, mask_random=0.0)
    row = np.array(rows[0]["original_ids"][:100])
    out = c.insert_masks(row, 5, 128, np.random.default_rng(0))
    assert len(out) == 105 and (out == tokenizer.mask_token_id).sum() == 5 + (row == tokenizer.mask_token_id).sum()
    assert out[0] == row[0] and out[-1] == row[-1] and (out[out != tokenizer.mask_token_id] == row).all()
    assert len(c.insert_masks(row, 40, 128, np.random.default_rng(0))) == 128  # only as many as the block has room for


def test_permutation_is_uniform_over_orders(bart_dir):
    """Three units (two sentences and the block's tail): each of the 6 orders about equally often (chi-square, 5
    degrees of freedom, the 5-sigma critical value 37.1)."""
    tokenizer = AutoTokenizer.from_pretrained(bart_dir)
    c = collator(tokenizer)
    pad = tokenizer.pad_token_id
    row = np.array([10, 11, pad, 12, 13, 14, pad, 15, 16])
    counts = Counter(tuple(c.permute_sentences(row, np.random.default_rng([5, i]))) for i in range(6000))
    assert len(counts) == 6 and all(sorted(order) == sorted(row) for order in counts)
    assert sum((n - 1000) ** 2 / 1000 for n in counts.values()) < 37.1, counts
    document_end = np.array([10, 11, tokenizer.eos_token_id, tokenizer.bos_token_id, 12, pad, 13])
    assert [part.tolist() for part in c.sentences(document_end)] == [
        [10, 11, tokenizer.eos_token_id],
        [tokenizer.bos_token_id, 12, pad],
        [13],
    ]


def test_dump_labels_are_the_original_and_inputs_keep_its_order(blocks):
    """In the dumped training rows (seed 42, epoch 0): labels are the block (specials -100); the block's units are
    permuted (the collator's first draws, redone here), and the encoder input without its <mask>s is that
    permuted block with the masked spans taken out, in order."""
    tokenizer, rows = blocks
    special = set(tokenizer.all_special_ids)
    c = collator(tokenizer)
    assert [r["batch"] for r in rows[:64]] == [0] * 64 and rows[64]["batch"] == 1
    moved = shorter = 0
    for r in rows[:500]:
        original = np.array(r["original_ids"])
        assert r["labels"] == [-100 if t in special else t for t in r["original_ids"]]
        permuted = c.permute_sentences(original, np.random.default_rng([42, 0, r["row"]]))
        assert sorted(permuted.tolist()) == sorted(original.tolist())
        moved += (permuted != original).any()
        left = iter(permuted.tolist())
        assert all(t in left for t in r["input_ids"] if t != tokenizer.mask_token_id)
        shorter += len(r["input_ids"]) < len(original)
    assert moved > 400 and shorter > 450


def test_labels_and_decoder_inputs(blocks):
    tokenizer, rows = blocks
    ids = np.array([r["original_ids"] for r in rows[:50]])
    batch = collator(tokenizer)({"input_ids": ids.tolist()}, (4,), row_ids=np.arange(len(ids)))
    special = np.isin(ids, tokenizer.all_special_ids)
    assert (batch["labels"][~special] == ids[~special]).all() and (batch["labels"][special] == -100).all()
    shifted = np.where(special[:, :-1], tokenizer.pad_token_id, ids[:, :-1])
    assert (batch["decoder_input_ids"][:, 1:] == shifted).all() and (batch["decoder_input_ids"][:, 0] == 2).all()
    assert (batch["attention_mask"] == (batch["input_ids"] != tokenizer.pad_token_id)).all()
    # The noise depends on the example only.
    whole = collator(tokenizer)({"input_ids": ids[:6].tolist()}, (7,), row_ids=np.arange(6))
    part = collator(tokenizer)({"input_ids": ids[3:6].tolist()}, (7,), row_ids=np.arange(3, 6))
    assert (whole["input_ids"][3:] == part["input_ids"]).all()


def test_sentence_splitter_works_offline_in_norwegian():
    from sentencex import segment

    assert [s.strip() for s in segment("nb", "Dette er en test. Det var alt.")] == [
        "Dette er en test.",
        "Det var alt.",
    ]


@pytest.fixture(scope="module")
def trained(bart_dir, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bartrun")
    args = script_args(
        renamed_copy(SCRIPT, tmp_path_factory.mktemp("copy")),
        "bart",
        bart_dir,
        corpus,
        out,
        "--max_seq_length",
        "64",
        "--per_device_train_batch_size",
        "8",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "10",
        "--num_train_epochs",
        "1",
        "--logging_steps",
        "10",
        "--do_train",
        "--do_eval",
        "--overwrite_output_dir",
    )
    return out, args, check_ok(run(args, env=TWO_DEVICES_OPTIMISED))


def test_trains_on_two_devices_and_reloads(trained, tmp_path):
    out, args, result = trained
    log = result.stdout + result.stderr
    assert "2 devices" in log
    check_names_itself(args[0], log, out)
    losses = logged_losses(log)
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses
    metrics = json.loads((out / "eval_results.json").read_text())
    assert metrics["eval_loss"] < np.log(1000) and 0.0 < metrics["eval_accuracy"] < 1.0
    reloaded = eval_reloaded(args, out, tmp_path / "again")
    assert reloaded["eval_target_tokens"] == metrics["eval_target_tokens"]
    assert reloaded["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=RELOAD_RTOL)


def test_bad_input(bart_dir, corpus, tmp_path):
    base = script_args(SCRIPT, "bart", bart_dir, corpus, tmp_path / "o", "--do_train")
    assert "--permute_sentence_ratio" in refusal(base + ["--permute_sentence_ratio", "2"])
    assert "Flax bart model cannot recompute" in refusal(base + ["--gradient_checkpointing"])
    short = tmp_path / "short"
    check_ok(
        run(
            [
                "tokenizers/create_config.py",
                "--model_type",
                "bart",
                "--tokenizer_name",
                str(bart_dir),
                "--output_dir",
                str(short),
                "--config_overrides",
                TINY_BART + ",max_position_embeddings=32",
            ]
        )
    )
    short_args = list(base) + ["--max_seq_length", "64"]
    short_args[short_args.index("--config_name") + 1] = str(short)
    assert "--max_seq_length 64 is longer than the model's 32 positions" in refusal(short_args)
    # Beyond the tokenizer's maximum (512) too: the value typed is named, not the tokenizer's cut of it.
    short_args[short_args.index("--max_seq_length") + 1] = "1024"
    assert "--max_seq_length 1024 is longer than the model's 32 positions" in refusal(short_args)
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    assert "--dataset_name" in error_line(run(base + ["--dataset_name", "oscar"], env=offline), "run_bart_dlm_flax.py")
    assert not (tmp_path / "o").exists()
