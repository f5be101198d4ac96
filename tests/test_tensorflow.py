"""The TensorFlow pipeline on the real default corpus: train_unigram.py -> prepare_tfrecord_shards.py ->
run_mlm.py (MirroredStrategy on 2 logical CPUs after the TPU fallback, and OneDeviceStrategy with XLA)
-> fill_mask.py; the masking and the masked-only metrics; bad input."""

import json
import math
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import TINY_ROBERTA, check_ok, datasets_cache, error_line, hub_cache, load_script, refusal, run

MAX_LENGTH = 64
pytestmark = pytest.mark.usefixtures("optimised_xla")
OFFLINE = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("tf")
    check_ok(
        run(
            [
                "tensorflow/train_unigram.py",
                "--train_file",
                str(corpus / "train.txt"),
                "--vocab_size",
                "2000",
                "--output_dir",
                str(root / "tokenizer"),
            ]
        )
    )
    for split in ("train", "validation"):
        check_ok(
            run(
                [
                    "tensorflow/prepare_tfrecord_shards.py",
                    "--tokenizer_name_or_path",
                    str(root / "tokenizer"),
                    "--train_file",
                    str(corpus / f"{split}_slice.txt"),
                    "--split",
                    split,
                    "--max_length",
                    str(MAX_LENGTH),
                    "--shard_size",
                    "500",
                    "--output_dir",
                    str(root / "shards"),
                ]
            )
        )
    check_ok(
        run(
            [
                "tokenizers/create_config.py",
                "--model_type",
                "roberta",
                "--tokenizer_name",
                str(root / "tokenizer"),
                "--config_overrides",
                TINY_ROBERTA,
                "--output_dir",
                str(root / "config"),
            ]
        )
    )
    return root


def mlm_args(root, output_dir, *extra):
    return [
        "tensorflow/run_mlm.py",
        "--pretrained_model_config",
        str(root / "config"),
        "--tokenizer",
        str(root / "tokenizer"),
        "--train_dataset",
        str(root / "shards" / "train"),
        "--eval_dataset",
        str(root / "shards" / "validation"),
        "--max_length",
        str(MAX_LENGTH),
        "--learning_rate",
        "3e-3",
        "--output_dir",
        str(output_dir),
        *extra,
    ]


def test_tokenizer_loads_with_the_walkthrough_specials(prepared):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    # RoBERTa's order: TFRoberta takes id 1 for padding whatever the config says.
    assert tokenizer.convert_ids_to_tokens(list(range(5))) == ["[CLS]", "<pad>", "[SEP]", "<unk>", "[MASK]"]
    assert len(tokenizer) == 2000 and tokenizer.mask_token == "[MASK]" and tokenizer.pad_token_id == 1
    ids = tokenizer("the company said <unk> shares rose").input_ids
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id and tokenizer.unk_token_id in ids
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("the company said")


def test_tf_and_pytorch_roberta_agree_with_this_tokenizer(prepared, tmp_path):
    """TFRoberta numbers positions with pad id 1 whatever the config says; with the tokenizer's <pad> at 1
    the same weights give the same logits in TF and PyTorch, [SEP] in mid-sequence included."""
    import torch
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer, TFAutoModelForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    config = AutoConfig.from_pretrained(str(prepared / "config"))
    torch.manual_seed(0)
    AutoModelForMaskedLM.from_config(config).save_pretrained(tmp_path)
    pt_model = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    ids = tokenizer("the company said", "its shares rose", return_tensors="np").input_ids
    assert (ids[0, 1:-1] == tokenizer.sep_token_id).any()
    tf_logits = TFAutoModelForMaskedLM.from_pretrained(tmp_path, from_pt=True)(ids).logits.numpy()
    with torch.no_grad():
        pt_logits = pt_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(tf_logits - pt_logits).max() < 1e-4  # two frameworks' float32 kernels: about 1e-6 of logits ~1


def test_shard_names_counts_and_contents(prepared, corpus):
    import tensorflow as tf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    lines = [line for line in (corpus / "train_slice.txt").read_text().splitlines() if line.strip()]
    # As upstream, texts are concatenated and cut per map batch of 1000 texts (each batch drops its remainder).
    blocks = []
    for start in range(0, len(lines), 1000):
        stream = [t for ids in tokenizer(lines[start : start + 1000]).input_ids for t in ids]
        blocks += [stream[i : i + MAX_LENGTH] for i in range(0, len(stream) - MAX_LENGTH + 1, MAX_LENGTH)]
    expected = len(blocks)
    shards = sorted((prepared / "shards" / "train").glob("*.tfrecord"), key=lambda p: int(p.name.split("-")[1]))
    names = [re.fullmatch(r"dataset-(\d+)-(\d+)\.tfrecord", p.name) for p in shards]
    assert all(names) and [int(m.group(1)) for m in names] == list(range(len(shards)))
    counts = [int(m.group(2)) for m in names]
    assert sum(counts) == expected and all(c == 500 for c in counts[:-1]) and 0 < counts[-1] <= 500
    assert (
        prepared / "shards" / "split-train-records-count.txt"
    ).read_text().strip() == f"Total train records: {expected}"
    records = [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset([str(p) for p in shards])]
    assert len(records) == expected
    first, last = records[0].features.feature, records[-1].features.feature
    assert (
        list(first["input_ids"].int64_list.value) == blocks[0]
        and list(last["input_ids"].int64_list.value) == blocks[-1]
    )
    assert list(first["attention_mask"].int64_list.value) == [1] * MAX_LENGTH


@pytest.fixture(scope="module")
def mirrored(prepared):
    """No --no_tpu: the TPU lookup fails on this machine and the script falls back to MirroredStrategy
    over 2 logical CPU devices."""
    out = prepared / "mirrored"
    result = check_ok(
        run(mlm_args(prepared, out, "--num_cpu_devices", "2", "--num_epochs", "3", "--per_replica_batch_size", "64"))
    )
    return out, result.stdout + result.stderr


def test_tpu_fallback_to_mirrored_two_cpus_and_loss_falls(mirrored):
    out, log = mirrored
    assert "No TPU found (NotFoundError" in log and "Strategy: MirroredStrategy with 2 replica(s)" in log
    epochs = [float(x) for x in re.findall(r" - masked_loss: ([0-9.]+)", log)]
    assert len(epochs) == 3 and epochs[2] < epochs[0] - 0.2, epochs
    train = json.loads((out / "train_results.json").read_text())
    assert train["num_devices"] == 2 and train["global_batch_size"] == 128 and train["strategy"] == "MirroredStrategy"
    assert train["global_step"] == 3 * (train["train_samples"] // 128)
    # transformers' notice that its TF classes go in v5: our pin is deliberate, so the run's log leaves it out
    assert "deprecated and will be removed in Transformers v5" not in log


def test_metrics_written_and_model_reloads(mirrored, prepared, script):
    out, _ = mirrored
    train = json.loads((out / "train_results.json").read_text())
    metrics = json.loads((out / "eval_results.json").read_text())
    assert train["reload_max_abs_logit_diff"] <= 1e-6  # the same weights and program: rounding at most
    # The saved model, reloaded here, evaluates as the trained one did at the run's end (eval_results.json): on the
    # same masks of the same 128 validation records. The run drew them once, in one global batch (129 records, 128 a
    # batch), in a tf.data function whose random ops take their seeds from the global seed (--seed 42) alone: the
    # script's pipeline under tf.random.set_seed(42) draws them again (checked: another seed moves the loss by 0.2).
    # The same logits on one device as on two (each row on its own): float32 rounding, 1e-8 of 5 measured.
    import tensorflow as tf
    from transformers import AutoTokenizer, TFAutoModelForMaskedLM

    assert metrics["eval_samples"] == 128 and train["global_batch_size"] == 128
    model = TFAutoModelForMaskedLM.from_pretrained(str(out))
    records, _ = script.find_shards("--eval_dataset", str(prepared / "shards" / "validation"), MAX_LENGTH)
    tf.random.set_seed(42)
    mask_fn = script.make_mask_fn(AutoTokenizer.from_pretrained(str(prepared / "tokenizer")), 0.15)
    (batch,) = script.prepare_dataset(records, script.make_decode_fn(MAX_LENGTH), mask_fn, 128, shuffle=False)
    logits = model({k: batch[k] for k in ("input_ids", "attention_mask")}, training=False).logits
    loss, accuracy = script.MaskedLoss(), script.MaskedAccuracy()
    loss.update_state(batch["labels"], logits)
    accuracy.update_state(batch["labels"], logits)
    assert float(loss.result()) == pytest.approx(metrics["eval_loss"], rel=1e-6)
    # Counts of correct argmaxes: equal unless two logits tie within float rounding.
    assert float(accuracy.result()) == pytest.approx(metrics["eval_accuracy"], abs=1e-9)
    assert 0.0 < metrics["eval_accuracy"] < 1.0 and metrics["eval_loss"] < math.log(2000) - 1.0
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    # Keras' batch-averaged loss and the token-weighted one agree closely on equal-length batches.
    assert abs(metrics["eval_keras_loss"] - metrics["eval_loss"]) < 0.1
    assert (out / "tf_model.h5").is_file() and (out / "tokenizer.json").is_file()


def test_steps_schedule_and_tensorboard_from_given_weights(mirrored, prepared, tmp_path):
    """--max_steps past the end of the data (the 129 validation records, 16 a step: nearly two epochs), --eval_steps,
    --warmup_steps and --model_name_or_path (the weights the mirrored run trained), with the Trainer's TensorBoard tags
    at the global steps; --full_determinism repeats a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    trained, _ = mirrored
    out = tmp_path / "steps"
    steps = ["--no_tpu", "--model_name_or_path", str(trained), "--per_replica_batch_size", "16", "--max_steps", "16"]
    steps += ["--eval_steps", "6", "--warmup_steps", "8", "--full_determinism"]
    for folder in (out, tmp_path / "again"):
        args = mlm_args(prepared, folder, *steps)
        args[args.index("--train_dataset") + 1] = str(prepared / "shards" / "validation")
        check_ok(run(args))
    train = json.loads((out / "train_results.json").read_text())
    assert train["train_loss"] == json.loads((tmp_path / "again" / "train_results.json").read_text())["train_loss"]
    assert (
        train["global_step"] == 16
        and train["epoch"] == pytest.approx(16 * 16 / train["train_samples"])
        and train["epoch"] > 1
    )
    (events,) = (out / "runs").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
    accumulator.Reload()
    scalars = {
        tag: {e.step: float(make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)}
        for tag in accumulator.Tags()["tensors"]
    }
    assert {"train/loss", "train/accuracy", "train/learning_rate", "eval/loss", "eval/accuracy"} <= set(scalars)
    assert list(scalars["eval/loss"]) == [6, 12, 16]
    assert scalars["eval/loss"][16] == pytest.approx(
        json.loads((out / "eval_results.json").read_text())["eval_loss"],
        rel=1e-6,  # TensorBoard's float32: 6e-8
    )
    # Linear warm-up to the peak over 8 steps, then linear decay to 0 at step 16.
    assert [scalars["train/learning_rate"][step] for step in (6, 12, 16)] == pytest.approx(
        [3e-3 * 6 / 8, 3e-3 * 4 / 8, 0.0],
        abs=1e-9,  # float32 rates: 2e-10 at 3e-3
    )
    # It started from the trained weights: a fresh model is near log(vocabulary) after 6 steps.
    assert scalars["eval/loss"][6] < math.log(2000) - 1.0


def test_fill_mask_returns_k_scored_predictions(mirrored):
    out, _ = mirrored
    result = check_ok(
        run(
            [
                "tensorflow/fill_mask.py",
                "--model_dir",
                str(out),
                "--top_k",
                "3",
                "--json",
                "the company said its [MASK] rose",
            ]
        )
    )
    predictions = json.loads(result.stdout[result.stdout.index("[") :])[0]["masks"][0]
    scores = [p["score"] for p in predictions]
    assert len(predictions) == 3 and scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1.0 + 1e-6
    assert all(p["token"] and p["token"] not in ("[MASK]", "<pad>") for p in predictions)


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_pytorch_weights_load_into_fill_mask_and_run_mlm(weights, prepared, tmp_path, capsys):
    """A folder holding only PyTorch's weights (model.safetensors, as pytorch/run_mlm.py saves them, or the older
    pytorch_model.bin, still the hub's for many models): fill_mask.py's scores are the PyTorch model's probabilities,
    and run_mlm.py's --model_name_or_path starts from the PyTorch model's logits."""
    import torch
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(str(prepared / "config"))).eval()
    model.save_pretrained(tmp_path, safe_serialization=weights == "model.safetensors")
    tokenizer.save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.glob("*.[bs]*") if "token" not in p.name] == [weights]
    text = "the company said its [MASK] rose"
    fill_mask = load_script("tensorflow/fill_mask.py", "tf_fill_mask")
    fill_mask.main(["--model_dir", str(tmp_path), "--top_k", "3", "--json", text])
    predictions = json.loads(capsys.readouterr().out)[0]["masks"][0]
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        probabilities = model(ids).logits[0, ids[0].tolist().index(tokenizer.mask_token_id)].softmax(-1)
    third = float(probabilities.topk(3).values[-1])
    for p in predictions:  # two frameworks' float32 kernels: logits within about 1e-6, so probabilities within 1e-5
        assert p["score"] == pytest.approx(float(probabilities[tokenizer.convert_tokens_to_ids(p["token"])]), rel=1e-5)
        assert p["score"] >= third * (1 - 1e-5)  # the top 3, whatever the order of near-ties
    import tensorflow as tf

    run_mlm = load_script("tensorflow/run_mlm.py", "tf_run_mlm_weights")
    args = SimpleNamespace(
        model_name_or_path=str(tmp_path), learning_rate=1e-3, weight_decay_rate=0.0, jit_compile=False
    )
    tf_model, _ = run_mlm.create_model(args, model.config, tf.distribute.get_strategy(), 10, 1)
    with torch.no_grad():
        expected = model(ids).logits.numpy()
    # the same float32 model in two frameworks' kernels: logits agree to about 1e-6 of their scale
    np.testing.assert_allclose(tf_model(ids.numpy()).logits.numpy(), expected, atol=1e-5 * np.abs(expected).max())


def test_one_device_with_jit_compile(prepared):
    out = prepared / "xla"
    result = check_ok(
        run(
            mlm_args(prepared, out, "--no_tpu", "--jit_compile", "--max_steps", "24", "--per_replica_batch_size", "16")
        )
    )
    log = result.stdout + result.stderr
    assert "No TPU found" not in log and "Strategy: OneDeviceStrategy with 1 replica(s)" in log
    train = json.loads((out / "train_results.json").read_text())
    assert train["jit_compile"] and train["train_loss"] < math.log(2000) and train["step_time_median_s"] > 0


# --- masking and metrics, in process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def script():
    return load_script("tensorflow/run_mlm.py", "tf_run_mlm")


def test_masking_rate_and_80_10_10(script, prepared):
    import tensorflow as tf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    rng = np.random.default_rng(0)
    ids = rng.integers(5, len(tokenizer), size=(512, MAX_LENGTH))
    ids[:, 0], ids[:, 10], ids[:, 20] = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.unk_token_id
    attention = np.ones_like(ids)
    attention[:, -8:] = 0
    ids[:, -8:] = tokenizer.pad_token_id
    batch = script.make_mask_fn(tokenizer, 0.15)(
        {"input_ids": tf.constant(ids), "attention_mask": tf.constant(attention)}
    )
    inputs, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    selected = labels != -100
    assert not selected[:, [0, 10, 20]].any() and not selected[:, -8:].any()
    maskable = 512 * (MAX_LENGTH - 3 - 8)
    assert abs(selected.sum() / maskable - 0.15) < 4 * math.sqrt(0.15 * 0.85 / maskable)
    assert (labels[selected] == ids[selected]).all() and (inputs[~selected] == ids[~selected]).all()
    n = selected.sum()
    for share, expected in (
        ((inputs[selected] == tokenizer.mask_token_id).mean(), 0.8),
        ((inputs[selected] == ids[selected]).mean(), 0.1),
    ):
        assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / n), share


def test_masked_metrics_match_a_hand_computation(script):
    import tensorflow as tf

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 6, 11)).astype(np.float32)
    labels = rng.integers(0, 11, size=(4, 6))
    labels[rng.random((4, 6)) < 0.6] = -100
    labels[0, 0] = int(np.argmax(logits[0, 0]))  # at least one hit
    mask = labels != -100
    accuracy = script.MaskedAccuracy()
    loss = script.MaskedLoss()
    for half in (slice(0, 2), slice(2, 4)):  # two batches: the metric accumulates over tokens
        accuracy.update_state(tf.constant(labels[half]), tf.constant(logits[half]))
        loss.update_state(tf.constant(labels[half]), tf.constant(logits[half]))
    expected_accuracy = (np.argmax(logits, -1) == labels)[mask].mean()
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected_loss = -np.take_along_axis(log_probs, np.where(mask, labels, 0)[..., None], -1)[..., 0][mask].mean()
    # A ratio of integer counts (IEEE division: the same on every CPU); a float32 log-softmax against numpy's.
    assert float(accuracy.result()) == pytest.approx(expected_accuracy, abs=1e-12)
    assert float(loss.result()) == pytest.approx(expected_loss, rel=1e-5)
    assert expected_accuracy != pytest.approx(mask.mean())  # Keras' "accuracy" would report about this


# --- bad input: one line, non-zero exit ---------------------------------------------------------------


def test_bad_shards(prepared, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refusal(mlm_args(prepared, tmp_path / "out", "--no_tpu", "--train_dataset", str(empty)))
    assert "no .tfrecord files found" in line
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    shutil.copy(next((prepared / "shards" / "train").glob("*.tfrecord")), unnamed / "data.tfrecord")
    assert "-<shard>-<count>.tfrecord" in refusal(
        mlm_args(prepared, tmp_path / "out", "--no_tpu", "--train_dataset", str(unnamed))
    )
    line = refusal(mlm_args(prepared, tmp_path / "out", "--no_tpu", "--max_length", "128"))
    assert "sequences of 64 tokens" in line and "--max_length is 128" in line
    assert not (tmp_path / "out").exists()


def test_missing_tokenizer_and_hub_offline(prepared, tmp_path):
    line = error_line(
        run(mlm_args(prepared, tmp_path / "out", "--tokenizer", str(tmp_path / "no-tokenizer")), env=OFFLINE),
        "run_mlm.py",
    )
    assert "--tokenizer" in line and "no-tokenizer" in line
    # a damaged tokenizer.json fails as it is read, after the strategy is chosen: --bfloat16 on a CPU without bf16
    # instructions warned first
    shutil.copytree(prepared / "tokenizer", tmp_path / "damaged")
    (tmp_path / "damaged" / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    result = run(
        mlm_args(prepared, tmp_path / "out2", "--no_tpu", "--bfloat16", "--tokenizer", str(tmp_path / "damaged")),
        env={**OFFLINE, "LM_CPU_BF16": "0"},
    )
    assert (
        "cannot load the tokenizer" in error_line(result, "run_mlm.py")
        and result.stderr.count("--bfloat16: this CPU") == 1
    )
    line = error_line(
        run(mlm_args(prepared, tmp_path / "out", "--hub_model_id", "me/tiny"), env=OFFLINE), "run_mlm.py"
    )
    assert "--hub_model_id" in line and "unreachable" in line
    line = error_line(
        run(
            ["tensorflow/train_unigram.py", "--dataset_name", "wikitext", "--output_dir", str(tmp_path / "tok")],
            env=OFFLINE,
        ),
        "train_unigram.py",
    )
    assert "--train_file" in line


def test_hub_names_load_offline_from_the_local_cache(prepared, corpus, tmp_path):
    """HF_HUB_OFFLINE=1 with the tokenizer and config downloaded beforehand (a cluster without internet): the shard
    writer takes the tokenizer's hub name from the cache (the same shards as from its folder), and so does the
    trainer, with the config's."""
    import tensorflow as tf

    env = hub_cache(tmp_path / "hf", "org/tf-tokenizer", prepared / "tokenizer")
    hub_cache(tmp_path / "hf", "org/tf-config", prepared / "config")
    shards = ["--train_file", str(corpus / "validation_slice.txt"), "--split", "validation", "--shard_size", "500"]
    shards += ["--max_length", str(MAX_LENGTH), "--output_dir", str(tmp_path / "shards")]
    check_ok(
        run(
            ["tensorflow/prepare_tfrecord_shards.py", "--tokenizer_name_or_path", "org/tf-tokenizer", *shards], env=env
        )
    )

    def records(shards):  # the features of every record (their order in the bytes varies from process to process)
        examples = [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset(sorted(map(str, shards)))]
        return [{k: list(v.int64_list.value) for k, v in e.features.feature.items()} for e in examples]

    ours, theirs = (sorted((d / "validation").glob("*.tfrecord")) for d in (tmp_path / "shards", prepared / "shards"))
    assert [p.name for p in ours] == [p.name for p in theirs] and records(ours) == records(theirs)
    written = [
        json.loads((d / "validation" / "shards.json").read_text()) for d in (tmp_path / "shards", prepared / "shards")
    ]
    assert written[0]["tokenizer"] == "org/tf-tokenizer" and written[0]["vocab_sha256"] == written[1]["vocab_sha256"]
    args = mlm_args(prepared, tmp_path / "out", "--no_tpu", "--max_steps", "1", "--per_replica_batch_size", "8")
    args[args.index("--pretrained_model_config") + 1] = "org/tf-config"
    args[args.index("--tokenizer") + 1] = "org/tf-tokenizer"
    check_ok(run(args, env=env))
    # A --dataset_name loaded once before, from the datasets cache.
    datasets_cache(tmp_path / "hf", "org/ptb-slice", {"train": corpus / "validation_slice.txt"})
    unigram = ["--dataset_name", "org/ptb-slice", "--dataset_config", "default", "--vocab_size", "300"]
    check_ok(run(["tensorflow/train_unigram.py", *unigram, "--output_dir", str(tmp_path / "unigram")], env=env))
    assert (tmp_path / "unigram" / "tokenizer.json").is_file()


def test_shards_of_another_tokenizer_are_refused(prepared, tiny_model_dir, tmp_path):
    """Shards written with a 2,000-token tokenizer, refused in one line before training: with a tokenizer of one token
    more (by the vocabulary shards.json records), and, for shards written before shards.json, with a 1,000-token one
    (ids past the vocabulary)."""
    from transformers import AutoTokenizer

    larger = AutoTokenizer.from_pretrained(prepared / "tokenizer")
    larger.add_tokens(["<another>"])
    larger.save_pretrained(tmp_path / "larger")
    line = refusal(mlm_args(prepared, tmp_path / "out", "--no_tpu", "--tokenizer", str(tmp_path / "larger")))
    assert f"--train_dataset {prepared / 'shards' / 'train'} was written with the tokenizer " in line, line
    assert "(2000 tokens), not this --tokenizer (2001 tokens)" in line, line
    shutil.copytree(prepared / "shards" / "train", tmp_path / "old")
    (tmp_path / "old" / "shards.json").unlink()
    args = mlm_args(prepared, tmp_path / "out", "--no_tpu", "--tokenizer", str(tiny_model_dir))
    args[args.index("--train_dataset") + 1] = str(tmp_path / "old")
    line = refusal(args)
    assert "--train_dataset" in line and "but the tokenizer has 1000 tokens" in line, line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_shards_are_not_overwritten(prepared, corpus):
    before = sorted(p.name for p in (prepared / "shards" / "validation").iterdir())
    line = error_line(
        run(
            [
                "tensorflow/prepare_tfrecord_shards.py",
                "--tokenizer_name_or_path",
                str(prepared / "tokenizer"),
                "--train_file",
                str(corpus / "train_slice.txt"),
                "--split",
                "validation",
                "--max_length",
                "32",
                "--output_dir",
                str(prepared / "shards"),
            ]
        ),
        "prepare_tfrecord_shards.py",
    )
    assert "--overwrite_output_dir" in line
    assert sorted(p.name for p in (prepared / "shards" / "validation").iterdir()) == before


@pytest.mark.parametrize("native", ["0", "1"])
def test_bfloat16_warning_only_without_bf16_instructions(script, native, monkeypatch):
    warned = []
    monkeypatch.setattr(script.logger, "warning", warned.append)
    monkeypatch.setenv("LM_CPU_BF16", native)
    script.warn_if_bf16_is_slow("OneDeviceStrategy")
    script.warn_if_bf16_is_slow("TPUStrategy")  # a TPU computes bf16 itself
    assert len(warned) == (native == "0") and all(w.startswith("--bfloat16: this CPU") for w in warned)
