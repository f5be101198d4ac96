"""flax/run_mlm_flax.py end to end on a slice of the real default corpus, and its bad-input errors."""

import json
import math
import os

import pytest
from conftest import (
    RELOAD_RTOL,
    ROOT,
    TWO_DEVICES,
    TWO_DEVICES_OPTIMISED,
    bad_input,
    check_ok,
    datasets_cache,
    error_line,
    hub_cache,
    load_script,
    logged_losses,
    run,
    script_args,
)

SCRIPT = "flax/run_mlm_flax.py"


def mlm_args(model_dir, corpus, output_dir, *extra):
    return script_args(SCRIPT, "roberta", model_dir, corpus, output_dir, "--max_seq_length", "64", *extra)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("mlm")
    result = check_ok(
        run(
            mlm_args(
                tiny_model_dir,
                corpus,
                out,
                "--do_train",
                "--do_eval",
                "--per_device_train_batch_size",
                "8",
                "--learning_rate",
                "3e-3",
                "--warmup_steps",
                "20",
                "--num_train_epochs",
                "2",
                "--logging_steps",
                "20",
                "--save_steps",
                "100",
                "--overwrite_output_dir",
            ),
            env=TWO_DEVICES_OPTIMISED,
        )
    )
    return out, result


def test_trains_on_two_devices_and_loss_falls(trained):
    out, result = trained
    log = result.stdout + result.stderr
    assert "2 devices" in log
    losses = logged_losses(log)
    assert len(losses) >= 5, log[-2000:]
    assert losses[-1] < losses[0] - 0.5, losses  # the first window averages steps 1-20 (ln 1000 = 6.9 at step 0)
    train = json.loads((out / "train_results.json").read_text())
    assert train["num_devices"] == 2 and train["global_batch_size"] == 16 and train["global_step"] > 100
    # transformers' notice that its Flax classes go in v5: the pin is deliberate, the log leaves it out
    assert "deprecated and will be removed in Transformers v5" not in log


def test_eval_metrics_written_and_consistent(trained):
    out, result = trained
    metrics = json.loads((out / "eval_results.json").read_text())
    assert all(math.isfinite(metrics[k]) for k in ("eval_loss", "eval_accuracy", "eval_perplexity"))
    assert abs(metrics["eval_perplexity"] - math.exp(metrics["eval_loss"])) < 1e-6 * metrics["eval_perplexity"]
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    # Every validation example is evaluated: blocks of 64 tokens from the validation slice, none dropped.
    assert metrics["eval_masked_tokens"] > 0.1 * metrics["eval_samples"] * 60
    assert list(out.glob("runs/*/events.out.tfevents.*")), "TensorBoard event file missing"


def test_trained_model_beats_untrained_and_checkpoint_reloads(trained, tiny_model_dir, corpus, tmp_path):
    out, _ = trained
    trained_metrics = json.loads((out / "eval_results.json").read_text())
    # The untrained model (same config, no --do_train) on the same masks.
    untrained = tmp_path / "untrained"
    check_ok(run(mlm_args(tiny_model_dir, corpus, untrained, "--do_eval")))
    untrained_metrics = json.loads((untrained / "eval_results.json").read_text())
    assert untrained_metrics["eval_accuracy"] < 0.02
    assert trained_metrics["eval_accuracy"] > max(0.025, 5 * untrained_metrics["eval_accuracy"])
    assert trained_metrics["eval_loss"] < untrained_metrics["eval_loss"] - 0.5
    # The saved checkpoint, reloaded by from_pretrained on one device, gives the same eval (same masks).
    reloaded = tmp_path / "reloaded"
    args = mlm_args(tiny_model_dir, corpus, reloaded, "--do_eval")
    args[args.index("--config_name") + 1] = str(out)
    args += ["--model_name_or_path", str(out)]
    check_ok(run(args))
    reloaded_metrics = json.loads((reloaded / "eval_results.json").read_text())
    assert reloaded_metrics["eval_masked_tokens"] == trained_metrics["eval_masked_tokens"]
    assert reloaded_metrics["eval_loss"] == pytest.approx(trained_metrics["eval_loss"], rel=RELOAD_RTOL)
    # Counts of correct argmaxes: equal unless two logits tie within float rounding.
    assert reloaded_metrics["eval_accuracy"] == pytest.approx(trained_metrics["eval_accuracy"], abs=1e-9)


def test_checkpoint_restores_the_saved_model(trained, tiny_model_dir, corpus):
    """The last checkpoint (Orbax), restored through the script's own path (parse_args, build_train_state's abstract
    state on a mesh of this process's device, read_checkpoint), holds the weights of the model saved beside it in
    from_pretrained form: the same logits, bit for bit, from the same program on the same inputs. Two writers of the
    same train state at the same step; a weight changed in either file, or a checkpoint of another step, differs."""
    import jax
    import numpy as np
    from transformers import AutoTokenizer, FlaxAutoModelForMaskedLM

    out, _ = trained
    step = json.loads((out / "train_results.json").read_text())["global_step"]
    checkpoint = out / f"checkpoint-{step}"
    assert (checkpoint / "trainer_state").is_dir()
    assert not list(out.glob(".tmp-*")) and not list(out.glob("*orbax-checkpoint-tmp*"))
    script = load_script(SCRIPT, "reload_run_mlm_flax")
    model_args, _, training_args = script.parse_args(mlm_args(tiny_model_dir, corpus, out, "--do_train")[1:])
    config, _ = script.load_config_and_tokenizer(model_args)
    plan = script.TrainingPlan(
        script.make_mesh(training_args.fsdp, jax.devices()[:1]), 1, 1, 0, 8, 16, total_steps=step
    )
    _, abstract_state, _ = script.build_train_state(model_args, training_args, config, plan, abstract=True)
    arrays, trainer_state = script.read_checkpoint(str(checkpoint), {"params": abstract_state.params})
    assert trainer_state["global_step"] == int(arrays["step"]) == step
    saved = FlaxAutoModelForMaskedLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = dict(tokenizer(["the company said its shares <mask> N points"], return_tensors="np"))
    logits = jax.jit(lambda params: saved(**inputs, params=params).logits)
    from_checkpoint, from_saved = np.asarray(logits(arrays["params"]["model"])), np.asarray(logits(saved.params))
    assert np.isfinite(from_saved).all()
    assert np.array_equal(from_checkpoint, from_saved)


def test_line_by_line_json_adafactor_bf16_checkpointing(tiny_model_dir, corpus, tmp_path):
    """The other upstream paths in one short run: --line_by_line with --pad_to_max_length on a JSON-lines
    file, --adafactor, --dtype bfloat16 and --gradient_checkpointing; a relative --output_dir (Orbax wants
    absolute paths), run from another folder."""
    files = {}
    for split, n in (("train", 600), ("validation", 100)):
        lines = (corpus / f"{split}_slice.txt").read_text().splitlines()[:n]
        files[split] = tmp_path / f"{split}.json"
        files[split].write_text("".join(json.dumps({"id": i, "text": line}) + "\n" for i, line in enumerate(lines)))
    out = tmp_path / "out"
    args = mlm_args(
        tiny_model_dir,
        corpus,
        out,
        "--do_train",
        "--do_eval",
        "--line_by_line",
        "--pad_to_max_length",
        "--adafactor",
        "--dtype",
        "bfloat16",
        "--gradient_checkpointing",
        "--per_device_train_batch_size",
        "16",
        "--max_steps",
        "8",
        "--logging_steps",
        "4",
        "--learning_rate",
        "1e-3",
    )
    args[args.index("--train_file") + 1] = str(files["train"])
    args[args.index("--validation_file") + 1] = str(files["validation"])
    args[0], args[args.index("--output_dir") + 1] = os.path.join(ROOT, args[0]), "out"
    result = check_ok(run(args, cwd=tmp_path))
    assert len(logged_losses(result.stdout + result.stderr)) == 2 and (out / "checkpoint-8" / "trainer_state").is_dir()
    metrics = json.loads((out / "eval_results.json").read_text())
    assert math.isfinite(metrics["eval_loss"])
    # line by line: one example per non-empty validation line, each padded to 64 tokens
    assert metrics["eval_samples"] == sum(
        1 for line in (corpus / "validation_slice.txt").read_text().splitlines()[:100] if line.strip()
    )
    train_results = json.loads((out / "train_results.json").read_text())
    assert train_results["global_step"] == 8 and train_results["max_seq_length"] == 64


# --- bad input: one line, non-zero exit, nothing overwritten ---------------------------------------


@pytest.fixture()
def bad(tiny_model_dir, corpus, tmp_path):
    return bad_input(
        lambda out, *extra: mlm_args(tiny_model_dir, corpus, out, "--do_train", "--do_eval", *extra),
        "run_mlm_flax.py",
        tmp_path / "out",
    )


def test_missing_train_file(bad, tmp_path):
    assert "does not exist" in bad(train_file=tmp_path / "nope.txt")


def test_empty_train_file(bad, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "empty" in bad(train_file=empty)


def test_unsupported_or_mixed_extension(bad, tmp_path):
    odd = tmp_path / "train.parquet"
    odd.write_text("text")
    assert "extension" in bad(train_file=odd)
    lines = tmp_path / "train.json"
    lines.write_text('{"text": "a b c"}\n')
    assert "same extension" in bad(train_file=lines)


def test_output_dir_not_empty(bad, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "flax_model.msgpack").write_text("precious")
    assert "--overwrite_output_dir" in bad(output_dir=out)
    assert (out / "flax_model.msgpack").read_text() == "precious" and len(list(out.iterdir())) == 1


def test_config_vocab_smaller_than_tokenizer(bad, tiny_model_dir, tmp_path):
    small = tmp_path / "small_config"
    check_ok(
        run(
            [
                "tokenizers/create_config.py",
                "--model_type",
                "roberta",
                "--vocab_size",
                "500",
                "--output_dir",
                str(small),
            ]
        )
    )
    line = bad("--config_name", str(small))
    assert "vocab_size" in line and "500" in line


def test_batch_size_not_positive_or_larger_than_data(bad):
    assert "--per_device_train_batch_size" in bad("--per_device_train_batch_size", "0")
    assert "fewer than one global batch" in bad("--per_device_train_batch_size", "100000", env=TWO_DEVICES)


def test_max_seq_length_beyond_model_positions(bad, tiny_model_dir, tmp_path):
    short = tmp_path / "short_config"
    check_ok(
        run(
            [
                "tokenizers/create_config.py",
                "--model_type",
                "roberta",
                "--tokenizer_name",
                str(tiny_model_dir),
                "--config_overrides",
                "max_position_embeddings=34",
                "--output_dir",
                str(short),
            ]
        )
    )
    line = bad("--config_name", str(short))
    assert "--max_seq_length 64" in line and "32 positions" in line


def test_hub_names_while_offline(bad, tmp_path):
    # A closed local port stands for an unreachable hub, whatever network the test machine has.
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    line = bad("--dataset_name", "oscar-corpus/oscar", env=offline)
    assert "--dataset_name 'oscar-corpus/oscar'" in line and "--train_file" in line
    assert "--model_name_or_path 'roberta-base'" in bad("--model_name_or_path", "roberta-base", env=offline)
    assert "--push_to_hub" in bad("--push_to_hub", env=offline)


def test_a_dataset_name_loads_offline_from_the_datasets_cache(tiny_model_dir, corpus, tmp_path):
    """HF_HUB_OFFLINE=1 with a --dataset_name loaded once before (the datasets cache, as on a cluster without
    internet): it trains and evaluates from the cache exactly as from the same text files."""
    files = {"train": corpus / "train_slice.txt", "validation": corpus / "validation_slice.txt"}
    env = datasets_cache(tmp_path / "hf", "org/ptb-slice", files)
    steps = ("--do_train", "--do_eval", "--max_steps", "2", "--per_device_train_batch_size", "8")
    check_ok(run(mlm_args(tiny_model_dir, corpus, tmp_path / "files", *steps)))
    args = mlm_args(tiny_model_dir, corpus, tmp_path / "cached", *steps, "--dataset_name", "org/ptb-slice")
    for flag in ("--train_file", "--validation_file"):
        del args[args.index(flag) : args.index(flag) + 2]
    check_ok(run(args, env=env))
    cached, first = (json.loads((tmp_path / d / "eval_results.json").read_text()) for d in ("cached", "files"))
    assert cached["eval_samples"] == first["eval_samples"] and cached["eval_loss"] == first["eval_loss"]


def test_line_by_line_says_how_much_it_cuts(tiny_model_dir, corpus, tmp_path, caplog):
    """--line_by_line keeps each line's first --max_seq_length tokens, as the tokenizer truncates, and says once per
    split how many lines were cut and how many tokens that dropped."""
    import datasets
    from transformers import AutoTokenizer

    script = load_script(SCRIPT, "line_by_line_run_mlm_flax")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lines = ["the company said its shares rose " * 20, "a short line", "   ", "the market fell " * 10]
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": lines})})
    args = script.DataTrainingArguments(line_by_line=True, max_seq_length=32)
    rows = script.preprocess(raw, args, tokenizer, 32)["train"]
    kept = [line for line in lines if not line.isspace()]
    truncated = tokenizer(kept, truncation=True, max_length=32, return_special_tokens_mask=True)
    assert rows.column_names == ["input_ids", "attention_mask", "special_tokens_mask"]
    assert all(rows[name] == truncated[name] for name in rows.column_names)
    content = [len(ids) - 2 for ids in tokenizer(kept).input_ids]  # <s> and </s> aside
    cut = sum(n - 30 for n in content if n > 30)
    warnings = [r.getMessage() for r in caplog.records if "--line_by_line" in r.getMessage()]
    assert warnings == [
        f"--line_by_line: 2 of 3 train lines are longer than --max_seq_length 32 and were cut, dropping {cut:,} of "
        f"their {cut + 60:,} tokens ({100 * cut / sum(content):.1f} % of all train tokens); raise --max_seq_length to "
        "keep them"
    ]
    # And as a user runs it: the same line, before any long work (flax/dump_noised_examples.py stops after the data).
    (tmp_path / "long.txt").write_text("\n".join(lines) + "\n")
    args = mlm_args(tiny_model_dir, corpus, tmp_path / "out", "--do_train", "--line_by_line")
    args += ["--per_device_train_batch_size", "1"]
    args[args.index("--train_file") + 1] = str(tmp_path / "long.txt")
    args[args.index("--max_seq_length") + 1] = "32"
    dump = ["flax/dump_noised_examples.py", SCRIPT, "--rows", "1", "--", *args[1:]]
    assert warnings[0] in check_ok(run(dump)).stderr
    row = json.loads((tmp_path / "out" / "noised_examples.jsonl").read_text())
    # What the masked-LM head sees too: labels[j] is the original token at masked_positions[j].
    scored = [(p, t) for p, t in zip(row["masked_positions"], row["labels"], strict=True) if t != -100]
    assert scored and all(row["original_ids"][p] == t for p, t in scored), row


def test_a_hub_name_loads_offline_from_the_local_cache(trained, corpus, tmp_path):
    """HF_HUB_OFFLINE=1 with the model downloaded beforehand (a cluster without internet): the hub name loads from the
    cache and evaluates as its folder does; a name the cache lacks is one line."""
    out, _ = trained
    env = hub_cache(tmp_path / "hf", "org/tiny-roberta", out)
    args = mlm_args(
        "org/tiny-roberta", corpus, tmp_path / "cached", "--do_eval", "--model_name_or_path", "org/tiny-roberta"
    )
    check_ok(run(args, env=env))
    cached, first = (json.loads((d / "eval_results.json").read_text()) for d in (tmp_path / "cached", out))
    assert cached["eval_masked_tokens"] == first["eval_masked_tokens"]
    assert cached["eval_loss"] == pytest.approx(first["eval_loss"], rel=RELOAD_RTOL)
    line = error_line(
        run(mlm_args("org/missing", corpus, tmp_path / "missing", "--do_eval"), env=env), "run_mlm_flax.py"
    )
    assert "cannot load the config or tokenizer" in line and "org/missing" in line
    assert not (tmp_path / "out").exists()
