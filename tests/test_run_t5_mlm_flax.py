"""flax/run_t5_mlm_flax.py: T5 span corruption against its specification, and the script end to end."""

import json

import numpy as np
import pytest
from conftest import (
    RELOAD_RTOL,
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

SCRIPT = "flax/run_t5_mlm_flax.py"
t5 = load_script(SCRIPT, "run_t5_mlm_flax")


def make_collator(tokenizer, length, density, span):
    expanded, targets = t5.compute_input_and_target_lengths(length, density, span)
    collator = t5.FlaxDataCollatorForT5MLM(
        sentinels=t5.find_sentinels(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        noise_density=density,
        mean_noise_span_length=span,
        input_length=length,
        target_length=targets,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    return collator, expanded, targets


# The last three: length x density rounds to 0 noise tokens (T5's mask then takes one; its length helper did not).
SETTINGS = [
    (64, 0.15, 3.0),
    (128, 0.15, 3.0),
    (512, 0.15, 3.0),
    (100, 0.3, 2.0),
    (37, 0.5, 1.0),
    (256, 0.15, 8.0),
    (8, 0.05, 3.0),
    (11, 0.05, 3.0),
    (4, 0.15, 3.0),
]


@pytest.mark.parametrize("length,density,span", SETTINGS)
def test_span_corruption_spec(t5_dir, length, density, span):
    tokenizer = AutoTokenizer.from_pretrained(t5_dir)
    collator, expanded, targets = make_collator(tokenizer, length, density, span)
    rng = np.random.default_rng(length)
    first_sentinel = len(tokenizer) - 1
    # Real token ids only (no sentinels), with literal <pad> (id 0) sprinkled in: upstream #15443/#15835.
    ids = rng.integers(3, 1000, size=(16, expanded))
    ids[rng.random(ids.shape) < 0.05] = 0
    batch = collator({"input_ids": ids.tolist()}, (length,), row_ids=np.arange(16))
    assert batch["input_ids"].shape == (16, length) and batch["labels"].shape == (16, targets)
    assert batch["decoder_input_ids"].shape == (16, targets)
    assert (batch["decoder_input_ids"][:, 0] == 0).all()
    assert (batch["decoder_input_ids"][:, 1:] == batch["labels"][:, :-1]).all()
    for row in range(16):
        inputs, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
        assert inputs[-1] == tokenizer.eos_token_id and labels[-1] == tokenizer.eos_token_id
        inputs, labels = inputs[:-1], labels[:-1]
        in_sentinels = [t for t in inputs if t > 999]
        # Sentinels are distinct, count down from len(tokenizer) - 1, and the same in input and target.
        assert in_sentinels == list(range(first_sentinel, first_sentinel - len(in_sentinels), -1))
        assert [t for t in labels if t > 999] == in_sentinels and labels[0] == first_sentinel
        # Every original token appears exactly once across input and target, in order.
        spans, current = {}, None
        for t in labels:
            if t > 999:
                current = t
                spans[current] = []
            else:
                spans[current].append(t)
        rebuilt = [piece for t in inputs for piece in (spans[t] if t > 999 else [t])]
        assert rebuilt == ids[row].tolist()
        noise = sum(len(v) for v in spans.values())
        assert noise >= 1 and len(rebuilt) - noise >= 1
        assert noise == int(round(expanded * density)) or noise in (1, expanded - 1)


def test_noise_mask_spans_have_the_requested_mean():
    rng = np.random.default_rng(0)
    masks = np.array([t5.random_spans_noise_mask(568, 0.15, 3.0, rng) for _ in range(200)])
    assert abs(masks.mean() - 0.15) < 0.002  # seeded numpy draws (the same on every CPU), 113,600 positions
    starts = (masks[:, 1:] & ~masks[:, :-1]).sum()
    assert abs(masks.sum() / starts - 3.0) < 0.2
    assert not masks[:, 0].any()  # a non-noise span comes first


def test_rows_of_other_lengths_are_padded_in_one_batch(t5_dir):
    """A copy may mix objectives, so rows of other lengths in one batch: each row's inputs and targets are padded to
    the batch's longest (inputs with <pad> and no attention, labels with -100), its own tokens as if it were alone."""
    tokenizer = AutoTokenizer.from_pretrained(t5_dir)
    collator, expanded, targets = make_collator(tokenizer, 32, 0.15, 3.0)
    rows = [list(range(5, 5 + expanded)), list(range(5, 5 + 2 * expanded)), list(range(5, 25))]
    batch = collator({"input_ids": rows}, (0,), row_ids=np.arange(3))
    for i, row in enumerate(rows):
        alone = collator({"input_ids": [row]}, (0,), row_ids=np.array([i]))
        for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
            width = alone[key].shape[1]
            assert (batch[key][i, :width] == alone[key][0]).all() and (batch[key][i, width:] == fill).all(), key
    assert batch["attention_mask"][0, :32].all() and not batch["attention_mask"][0, 32:].any()  # the spec's length
    assert batch["input_ids"].shape[1] > 32 and batch["labels"].shape == batch["decoder_input_ids"].shape


def test_lengths_match_t5():
    # T5's random_spans_helper for its default pretraining setting: 568 tokens -> inputs 512, targets 114.
    assert t5.compute_input_and_target_lengths(512, 0.15, 3.0) == (568, 114)
    # By hand: 141 tokens -> 21 noise in 7 spans -> inputs 120 + 7 + 1 = 128, targets 21 + 7 + 1 = 29;
    # 142 tokens would give 129 inputs.
    assert t5.compute_input_and_target_lengths(128, 0.15, 3.0) == (141, 29)
    # Spans of one token: every noise token gets a sentinel, so blocks are shorter than the inputs.
    assert t5.compute_input_and_target_lengths(37, 0.5, 1.0) == (36, 37)


@pytest.fixture(scope="module")
def trained(t5_dir, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("t5run")
    args = script_args(
        renamed_copy(SCRIPT, tmp_path_factory.mktemp("copy")),
        "t5",
        t5_dir,
        corpus,
        out,
        "--max_seq_length",
        "64",
        "--per_device_train_batch_size",
        "8",
        "--adafactor",
        "--learning_rate",
        "5e-3",
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
    assert len(losses) >= 5 and losses[-1] < losses[0] - 2.0, losses
    metrics = json.loads((out / "eval_results.json").read_text())
    assert metrics["eval_loss"] < np.log(1100) and 0.05 < metrics["eval_accuracy"] < 1.0
    assert (
        metrics["eval_target_tokens"] == metrics["eval_samples"] * 14
    )  # every target token of every block (targets_length 14)
    # Reload the checkpoint on one device and evaluate the same spans: the same loss.
    reloaded = eval_reloaded(args, out, tmp_path / "again")
    assert reloaded["eval_target_tokens"] == metrics["eval_target_tokens"]
    assert reloaded["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=RELOAD_RTOL)


def test_bad_input(t5_dir, corpus, tmp_path):
    base = [
        SCRIPT,
        "--output_dir",
        str(tmp_path / "o"),
        "--config_name",
        str(t5_dir),
        "--tokenizer_name",
        str(t5_dir),
        "--train_file",
        str(corpus / "train_slice.txt"),
        "--do_train",
    ]
    assert "does not exist" in refusal(base[:-3] + ["--train_file", str(tmp_path / "nope.txt"), "--do_train"])
    assert "--mlm_probability" in refusal(base + ["--mlm_probability", "1.5"])
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    assert "--dataset_name" in error_line(run(base + ["--dataset_name", "oscar"], env=offline), "run_t5_mlm_flax.py")


def test_more_noise_spans_than_sentinels_is_refused(t5_dir, corpus, tmp_path):
    """Density 0.5, spans of 3 and 512 inputs make 128 spans, more than the tokenizer's 100 sentinels."""
    args = script_args(
        SCRIPT,
        "t5",
        t5_dir,
        corpus,
        tmp_path / "o",
        "--max_seq_length",
        "512",
        "--mlm_probability",
        "0.5",
        "--do_train",
    )
    line = refusal(args)
    assert "makes 128 noise spans per block, but the tokenizer has 100 <extra_id_N> sentinels" in line
    assert not (tmp_path / "o").exists()


def test_dump_noised_examples(t5_dir, corpus, tmp_path):
    """The first rows of the first epoch in training order, each rebuilt exactly from its input and target."""
    args = script_args(
        SCRIPT,
        "t5",
        t5_dir,
        corpus,
        tmp_path,
        "--max_seq_length",
        "32",
        "--per_device_train_batch_size",
        "4",
        "--do_train",
    )
    check_ok(run(["flax/dump_noised_examples.py", SCRIPT, "--rows", "10", "--", *args[1:]]))
    rows = [json.loads(line) for line in (tmp_path / "noised_examples.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and [r["batch"] for r in rows] == [0] * 4 + [1] * 4 + [2] * 2
    assert [r["row"] for r in rows[:4]] == sorted(
        r["row"] for r in rows[:4]
    )  # a batch's rows in the order training uses
    eos = AutoTokenizer.from_pretrained(t5_dir).eos_token_id
    for r in rows:
        assert len(r["input_ids"]) == 32 and r["input_ids"][-1] == r["labels"][-1] == eos
        spans, current = {}, None
        for t in r["labels"][:-1]:
            if t >= 1000:
                current = spans.setdefault(t, [])
            else:
                current.append(t)
        assert [p for t in r["input_ids"][:-1] for p in (spans[t] if t >= 1000 else [t])] == r["original_ids"]
        assert "<extra_id_0>" in r["input_text"] and r["original_text"]
    assert not (tmp_path / "checkpoint-0").exists() and not (tmp_path / "flax_model.msgpack").exists()
    model_args, _, training_args = t5.parse_args(args[1:])  # the run itself goes into the folder, the rows beside it
    assert t5.find_checkpoint(training_args, model_args) is None
