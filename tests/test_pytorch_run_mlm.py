"""pytorch/run_mlm.py on the Trainer: one process, torchrun over gloo, gradient accumulation,
resumption, PyTorch/XLA through xla_spawn.py (in its own venv), and bad input."""

import json
import math
import os
import re
import shutil
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import (
    RELOAD_RTOL,
    bad_input,
    check_ok,
    error_line,
    hub_cache,
    load_script,
    refusal,
    run,
    script_args,
)

SCRIPT = "pytorch/run_mlm.py"
NO_DROPOUT = "hidden_dropout_prob=0,attention_probs_dropout_prob=0"
# The XLA environment (bash run.sh setup-xla); `bash run.sh test` points XLA_PYTHON at it.
XLA_PYTHON = os.environ.get(
    "XLA_PYTHON",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-xla", "bin", "python"),
)


def mlm_args(model_dir, corpus, output_dir, *extra):
    args = script_args(
        SCRIPT,
        "roberta",
        model_dir,
        corpus,
        output_dir,
        "--max_seq_length",
        "64",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        *extra,
    )
    args.remove("--model_type")
    args.remove("roberta")
    return args


def trainer_losses(log):
    """The training losses the Trainer printed ({'loss': X, ...})."""
    return [float(x) for x in re.findall(r"'loss': ([0-9.]+)", log)]


def results(out, split):
    return json.loads((out / f"{split}_results.json").read_text())


@pytest.fixture(scope="module")
def trained(tiny_model_dir, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("pt") / "run"
    args = mlm_args(
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
        "10",
        "--max_steps",
        "60",
        "--logging_steps",
        "10",
        "--save_steps",
        "30",
    )
    return out, args, check_ok(run(args))


def test_trains_and_loss_falls(trained):
    out, _, result = trained
    losses = trainer_losses(result.stdout)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses  # ln 1000 = 6.9 at the start
    train = results(out, "train")
    assert train["global_step"] == 60 and train["world_size"] == 1 and train["global_batch_size"] == 8
    metrics = results(out, "eval")
    assert (
        0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["eval_masked_tokens"] > 0.1 * metrics["eval_samples"] * 60
    )
    # approx (1e-6): exp of the same float in the script and here
    assert metrics["eval_loss"] < 6.5 and metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    # No line that reads as an error or points to a hub: not the Trainer's nor the model card's, nor TensorFlow's start
    log = result.stdout + result.stderr
    quiet = ("Do not forget to share", "Dropping the following result", "absl::InitializeLog", "oneDNN custom")
    assert not [line for line in log.splitlines() if any(text in line for text in quiet)]


@pytest.mark.parametrize("extra", [[], ["--prediction_loss_only"]])
def test_upstream_result_keys_read_as_upstream_tests_do(trained, tiny_model_dir, corpus, tmp_path, monkeypatch, extra):
    """Upstream's example tests import the script, patch sys.argv, call main() and read all_results.json["perplexity"].
    The trained model evaluated again: upstream's key, ours beside it, and the same token-weighted eval_loss as at
    the end of training, with --prediction_loss_only (upstream's tests pass it) or without."""
    out, _, _ = trained
    module = load_script(SCRIPT, "pytorch_run_mlm_main")
    monkeypatch.setattr(
        sys,
        "argv",
        mlm_args(tiny_model_dir, corpus, tmp_path / "eval", "--do_eval", "--model_name_or_path", str(out), *extra),
    )
    module.main()
    metrics = json.loads((tmp_path / "eval" / "all_results.json").read_text())
    assert metrics["perplexity"] == metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert (
        metrics["eval_loss"] == pytest.approx(results(out, "eval")["eval_loss"], rel=RELOAD_RTOL)
        and "eval_accuracy" in metrics
    )


def test_resume_continues_exactly(trained, tmp_path):
    """A run cut after its checkpoint at step 30 resumes there and logs the same losses for steps 31-60."""
    out, args, result = trained
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(out / "checkpoint-30", again / "checkpoint-30")
    for damaged in (45, 50, 55):
        shutil.copytree(out / "checkpoint-30", again / f"checkpoint-{damaged}")
    (again / "checkpoint-45" / "trainer_state.json").unlink()  # a save that was cut short
    weights = again / "checkpoint-50" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    (again / "checkpoint-55" / "optimizer.pt").unlink()  # the Trainer would go on with a fresh optimizer
    args = list(args)
    args[args.index("--output_dir") + 1] = str(again)
    resumed = check_ok(run(args))
    log = resumed.stdout + resumed.stderr
    assert "checkpoint-45: trainer_state.json is missing" in log and "checkpoint-55: optimizer.pt is missing" in log
    assert "checkpoint-50: model.safetensors is damaged" in log and "Traceback" not in log
    assert "resuming training at" in resumed.stdout + resumed.stderr
    # The Trainer prints 4 decimals (5e-5 each); its resume replays the data order, not every float bit.
    assert trainer_losses(resumed.stdout) == pytest.approx(trainer_losses(result.stdout)[3:], abs=2e-4)
    assert results(again, "train")["global_step"] == 60
    assert results(again, "eval")["eval_loss"] == pytest.approx(results(out, "eval")["eval_loss"], rel=RELOAD_RTOL)


def test_checkpoint_of_another_config_is_refused(trained, bad, tmp_path):
    """Rerunning with another config into a folder with a checkpoint would auto-resume it and die of a size
    mismatch inside the Trainer: one line saying what differs instead."""
    out, _, _ = trained
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(out / "checkpoint-30", again / "checkpoint-30")
    line = bad("--config_overrides", "hidden_size=32", output_dir=again)
    assert "checkpoint-30 holds a model of another config (hidden_size 64 there, 32 here)" in line
    (again / "checkpoint-30" / "scheduler.pt").unlink()
    line = bad("--resume_from_checkpoint", str(again / "checkpoint-30"), output_dir=again)
    assert "checkpoint-30 cannot be resumed: scheduler.pt is missing" in line


def test_saved_model_reloads_to_identical_eval(trained, tmp_path):
    out, args, _ = trained
    again = [a for a in args if a != "--do_train"] + ["--model_name_or_path", str(out)]
    again[again.index("--output_dir") + 1] = str(tmp_path / "eval")
    again[again.index("--config_name") + 1] = str(out)
    check_ok(run(again))
    assert results(tmp_path / "eval", "eval")["eval_loss"] == pytest.approx(
        results(out, "eval")["eval_loss"], rel=RELOAD_RTOL
    )
    assert results(tmp_path / "eval", "eval")["eval_accuracy"] == results(out, "eval")["eval_accuracy"]


def test_a_hub_name_loads_offline_from_the_local_cache(trained, tmp_path):
    """HF_HUB_OFFLINE=1 with the model downloaded beforehand (a cluster without internet): the hub name loads from the
    cache and evaluates as its folder does."""
    out, args, _ = trained
    env = hub_cache(tmp_path / "hf", "org/tiny-roberta", out)
    again = [a for a in args if a != "--do_train"] + ["--model_name_or_path", "org/tiny-roberta"]
    for flag, value in (("--output_dir", tmp_path / "cached"), ("--config_name", "org/tiny-roberta")):
        again[again.index(flag) + 1] = str(value)
    again[again.index("--tokenizer_name") + 1] = "org/tiny-roberta"
    check_ok(run(again, env=env))
    assert results(tmp_path / "cached", "eval")["eval_loss"] == pytest.approx(
        results(out, "eval")["eval_loss"], rel=RELOAD_RTOL
    )


def test_line_by_line_says_how_much_it_cuts(tiny_model_dir, corpus, tmp_path):
    """--line_by_line keeps each line's first --max_seq_length tokens, as the tokenizer truncates, and says once per
    split how many lines were cut and how many tokens that dropped (an evaluation, from the command line)."""
    import transformers

    lines = ["the company said its shares rose " * 20, "a short line"]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    args = mlm_args(tiny_model_dir, corpus, tmp_path / "out", "--do_eval", "--line_by_line", "--max_seq_length", "32")
    for flag in ("--train_file", "--validation_file"):
        args[args.index(flag) + 1] = str(tmp_path / "lines.txt")
    result = check_ok(run(args))
    log = result.stdout + result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    long, short = (len(ids) for ids in tokenizer(lines, add_special_tokens=False).input_ids)
    cut = long - (32 - tokenizer.num_special_tokens_to_add())  # the counts leave special tokens out
    message = (
        f"--line_by_line: 1 of 2 validation lines are longer than --max_seq_length 32 and were cut, dropping "
        f"{cut:,} of their {long:,} tokens ({100 * cut / (long + short):.1f} % of all validation tokens)"
    )
    assert log.count(message) == 1, log[-3000:]


def test_streaming_line_by_line(tiny_model_dir, corpus, tmp_path):
    """--streaming (an IterableDataset: needs --max_steps) with --line_by_line (one example per line,
    padded per batch): the other preprocessing path, end to end."""
    out = tmp_path / "stream"
    result = check_ok(
        run(
            mlm_args(
                tiny_model_dir,
                corpus,
                out,
                "--do_train",
                "--do_eval",
                "--streaming",
                "--line_by_line",
                "--per_device_train_batch_size",
                "8",
                "--max_steps",
                "6",
                "--logging_steps",
                "3",
                "--max_eval_samples",
                "40",
                "--save_strategy",
                "no",
                "--max_seq_length",
                "128",
            )
        )
    )
    assert len(trainer_losses(result.stdout)) == 2 and results(out, "train")["global_step"] == 6
    metrics = results(out, "eval")
    assert math.isfinite(metrics["eval_loss"])
    # 40 lines of PTB, each one sequence of its own tokens: n of them (1797), not special ones, each masked with
    # probability 0.15 (a binomial count: within 5 standard deviations, 1 in 1.7 million outside). Grouped text would
    # be 40 blocks of 128 tokens (3 n), its count 30 standard deviations above this one's.
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    lines = [line for line in (corpus / "validation_slice.txt").read_text().splitlines() if line.strip()][:40]
    length = 128 - tokenizer.num_special_tokens_to_add()
    n = sum(min(len(ids), length) for ids in tokenizer(lines, add_special_tokens=False).input_ids)
    assert 40 * 128 > 2.5 * n
    assert abs(metrics["eval_masked_tokens"] - 0.15 * n) <= 5 * math.sqrt(n * 0.15 * 0.85), (n, metrics)


@pytest.fixture(scope="module")
def equivalence(tiny_model_dir, corpus, tmp_path_factory):
    """Three steps on a global batch of 8 from 16 rows (the third starts the second epoch, masked anew), without
    dropout: one process with batch 8, and the same command line (per-device batch and output folder aside) for the
    other launchers. Plain SGD, so that the weights are the initial ones minus the learning rate times the gradients
    (AdamW's first step is about lr x sign(g): a weight whose gradient is within float rounding of zero would end 2 lr
    apart, and a wrong gradient scale would not show at all)."""
    root = tmp_path_factory.mktemp("equiv")

    def args(name, batch, *extra):
        return mlm_args(
            tiny_model_dir,
            corpus,
            root / name,
            "--do_train",
            "--do_eval",
            "--config_overrides",
            NO_DROPOUT,
            "--per_device_train_batch_size",
            str(batch),
            "--optim",
            "sgd",
            "--learning_rate",
            "1.0",
            "--max_steps",
            "3",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--max_train_samples",
            "16",
            *extra,
        )

    single = check_ok(run(args("single", 8)))
    return root, args, trainer_losses(single.stdout)


def weights(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "model.safetensors"))


def assert_same_run(root, name, log, expected_losses):
    """The same sums in another order: float32 rounding, measured 6e-8 at most in the weights (1e-4 leaves 1000x),
    while a gradient off by 2x (a wrong divisor, a lost half) moves them by up to 0.08 (measured at half the rate)."""
    # The Trainer rounds each logged loss to 4 decimals (log_history too): each within 5e-5 of its own, so two losses a
    # float's noise apart print up to 1e-4 + noise apart (6.99985 and 6.99984: 6.9999 and 6.9998), and 1e-4 is not
    # exact in binary: 2e-5 added for the noise. Their unrounded mean (train_loss) at the noise's own 1e-5.
    assert trainer_losses(log) == pytest.approx(expected_losses, abs=1.2e-4)
    single, other = results(root / "single", "train")["train_loss"], results(root / name, "train")["train_loss"]
    assert other == pytest.approx(single, abs=1e-5)
    a, b = weights(root / "single"), weights(root / name)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-4
    assert results(root / name, "eval")["eval_loss"] == pytest.approx(
        results(root / "single", "eval")["eval_loss"], rel=RELOAD_RTOL
    )


def test_gradient_accumulation_equals_the_larger_batch(equivalence):
    root, args, expected = equivalence
    assert len(expected) == 3
    result = check_ok(run(args("accumulated", 4, "--gradient_accumulation_steps", "2")))
    assert_same_run(root, "accumulated", result.stdout, expected)


def test_persistent_dataloader_workers_equal_one_process(equivalence):
    """Workers kept across epochs keep the collator they started with: the second epoch is still masked anew."""
    root, args, expected = equivalence
    persistent = ("--dataloader_num_workers", "1", "--dataloader_persistent_workers", "true")
    assert_same_run(root, "workers", check_ok(run(args("workers", 8, *persistent))).stdout, expected)


def test_torchrun_two_processes_equals_one_process(equivalence):
    """torchrun on CPU with no extra flag: world size 2 over gloo, gradients averaged over the global batch."""
    root, args, expected = equivalence
    elastic = {"TMPDIR": str(root)}  # torchrun's torchelastic_* folders, which it leaves behind
    result = check_ok(run(["-m", "torch.distributed.run", "--nproc_per_node", "2", *args("ddp", 4)], env=elastic))
    assert result.stdout.count("world size: 2") == 2
    assert (
        results(root / "ddp", "train")["world_size"] == 2 and results(root / "ddp", "train")["global_batch_size"] == 8
    )
    assert_same_run(root, "ddp", result.stdout, expected)


def test_bf16_autocast_on_cpu(equivalence):
    """--bf16 runs as CPU autocast; on a CPU without bf16 instructions (LM_CPU_BF16=0) after one warning."""
    root, args, expected = equivalence
    result = check_ok(run(args("bf16", 8, "--bf16"), env={"LM_CPU_BF16": "0"}))
    assert (result.stdout + result.stderr).count("--bf16: this CPU") == 1
    losses = trainer_losses(result.stdout)
    # bf16 rounds each product's inputs to 8 significant bits (2**-9 relative): about 1e-2 of a loss of 7.
    assert losses == pytest.approx(expected, abs=0.05) and losses[-1] < losses[0]
    # ... and autocast took effect, which the check above cannot tell: float32's run in another order moves the
    # weights by 6e-8 at most (assert_same_run), the same program run again by nothing; bf16's products, after 3 steps
    # at a rate of 1, by 4e-4 (measured on an Intel Xeon, family 6 model 207; the losses by 1e-4 of 7).
    a, b = weights(root / "single"), weights(root / "bf16")
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) > 1e-5


@pytest.mark.skipif(
    not os.path.exists(XLA_PYTHON) and not os.environ.get("CI"),
    reason=f"no PyTorch/XLA environment at {XLA_PYTHON} (bash run.sh setup-xla)",
)
def test_xla_spawn_one_core_on_xla_cpu_matches_eager(equivalence):
    root, args, expected = equivalence
    cmd = args("xla", 8)
    result = check_ok(
        run(["pytorch/xla_spawn.py", "--num_cores", "1", *cmd], env={"PJRT_DEVICE": "CPU"}, python=XLA_PYTHON)
    )
    assert "device: xla:0" in result.stdout
    # XLA's CPU compiler fuses and reorders the float32 sums and has its own exp and tanh: 1e-4 of a loss of 7
    # (torch_xla 2.9 against eager torch 2.13).
    assert trainer_losses(result.stdout) == pytest.approx(expected, abs=5e-3)
    xla, eager = results(root / "xla", "eval"), results(root / "single", "eval")
    assert xla["eval_loss"] == pytest.approx(eager["eval_loss"], abs=5e-3)
    assert (xla["eval_samples"], xla["eval_masked_tokens"]) == (eager["eval_samples"], eager["eval_masked_tokens"])


@pytest.mark.skipif(
    not os.path.exists(XLA_PYTHON) and not os.environ.get("CI"),
    reason=f"no PyTorch/XLA environment at {XLA_PYTHON} (bash run.sh setup-xla)",
)
def test_xla_spawn_several_cores_without_tpu_fails_at_once(tiny_model_dir, corpus, tmp_path):
    cmd = mlm_args(tiny_model_dir, corpus, tmp_path / "out", "--do_train")
    line = error_line(
        run(["pytorch/xla_spawn.py", "--num_cores", "2", *cmd], env={"PJRT_DEVICE": "CPU"}, python=XLA_PYTHON),
        "xla_spawn.py",
    )
    assert "--num_cores 2 needs a TPU" in line and "torchrun" in line
    assert not (tmp_path / "out").exists()


def test_xla_spawn_without_torch_xla(tiny_model_dir, corpus, tmp_path):
    line = error_line(
        run(["pytorch/xla_spawn.py", "--num_cores", "1", *mlm_args(tiny_model_dir, corpus, tmp_path, "--do_train")]),
        "xla_spawn.py",
    )
    assert "torch_xla is not installed" in line and "setup-xla" in line


# --- the collator's masks ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT, "pytorch_run_mlm")


@pytest.fixture(scope="module")
def collator(script, tiny_model_dir):
    from transformers import AutoTokenizer

    return script.DataCollatorForMaskedLM(
        AutoTokenizer.from_pretrained(str(tiny_model_dir)), mlm_probability=0.15, seed=3
    )


def features(tokenizer, n, length=64):
    rng = np.random.default_rng(0)
    ids = rng.integers(len(tokenizer.all_special_ids) + 5, tokenizer.vocab_size, size=(n, length))
    ids[:, 0], ids[:, -1] = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [
        {"input_ids": list(map(int, row)), "attention_mask": [1] * length, "example_id": i}
        for i, row in enumerate(ids)
    ]


def test_masking_rates_and_specials(collator):
    tokenizer = collator.tokenizer
    feats = features(tokenizer, 400)
    batch = collator(feats)
    original = np.array([f["input_ids"] for f in feats])
    labels, inputs = batch["labels"].numpy(), batch["input_ids"].numpy()
    selected = labels != -100
    assert not selected[:, [0, -1]].any()  # <s> and </s> are never targets
    rate = selected.sum() / (400 * 62)
    assert abs(rate - 0.15) < 4 * math.sqrt(0.15 * 0.85 / (400 * 62))
    assert (labels[selected] == original[selected]).all() and (inputs[~selected] == original[~selected]).all()
    n = selected.sum()
    as_mask = (inputs[selected] == tokenizer.mask_token_id).mean()
    kept = (inputs[selected] == original[selected]).mean()
    for share, expected in ((as_mask, 0.8), (kept, 0.1)):
        assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / n), (as_mask, kept)


def test_masks_depend_on_example_and_epoch_not_batch(collator):
    feats = features(collator.tokenizer, 8)
    whole = collator(feats)["labels"].numpy()
    halves = np.concatenate([collator(feats[4:])["labels"].numpy(), collator(feats[:4])["labels"].numpy()])
    assert np.array_equal(whole, np.concatenate([halves[4:], halves[:4]]))
    collator.epoch = 1
    try:
        assert not np.array_equal(collator(feats)["labels"].numpy(), whole)
    finally:
        collator.epoch = 0


def test_evaluation_counts_every_row_while_loaders_read_ahead(script, collator, tiny_model_dir, tmp_path):
    """torch_xla's loader threads read the evaluation loader to its end while its first batches are evaluated, and
    collate training batches meanwhile. Here the loader has read all its batches before the first is evaluated: every
    row still counts once (accelerate cut each batch to the last one's row), and a training batch collated during the
    evaluation still gets the training masks."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForMaskedLM, TrainerCallback, TrainingArguments

    rows, train_rows = features(collator.tokenizer, 7, length=16), features(collator.tokenizer, 4, length=16)
    trainer = script.build_trainer(
        AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(tiny_model_dir)),
        collator.tokenizer,
        None,
        Dataset.from_list(rows),
        SimpleNamespace(mlm_probability=0.15, line_by_line=False, pad_to_max_length=False, streaming=False),
        TrainingArguments(
            tmp_path,
            do_eval=True,
            per_device_eval_batch_size=2,
            remove_unused_columns=False,
            dataloader_pin_memory=False,  # no accelerator: torch would warn that pinning does nothing
            report_to=[],
        ),
    )
    training = trainer.data_collator
    expected = training(train_rows)["labels"]

    class DuringEvaluation(TrainerCallback):
        def on_prediction_step(self, *args, **kwargs):
            self.labels = training(train_rows)["labels"]

    class ReadAhead:
        def __init__(self, loader):
            self.loader, self.dataset = loader, loader.dataset

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            ahead = iter(self.loader)
            batches = [next(ahead) for _ in range(len(self.loader))]  # at its end, not yet closed
            yield from batches
            next(ahead, None)

    during, loader = DuringEvaluation(), trainer.get_eval_dataloader
    trainer.add_callback(during)
    trainer.get_eval_dataloader = lambda dataset=None: ReadAhead(loader(dataset))
    metrics = trainer.evaluate()
    evaluation = replace(training, evaluating=True)(rows)["labels"]
    assert metrics["eval_masked_tokens"] == int((evaluation != -100).sum()) > 0
    assert torch.equal(during.labels, expected)


# --- bad input: one line, non-zero exit, nothing overwritten ---------------------------------------


@pytest.fixture()
def bad(tiny_model_dir, corpus, tmp_path):
    return bad_input(
        lambda out, *extra: mlm_args(tiny_model_dir, corpus, out, "--do_train", "--do_eval", *extra),
        "run_mlm.py",
        tmp_path / "out",
    )


def test_bad_files_and_flags(bad, tmp_path):
    assert "does not exist" in bad(train_file=tmp_path / "nope.txt")
    assert "--per_device_train_batch_size" in bad("--per_device_train_batch_size", "100000")
    assert "--config_overrides" in bad("--config_overrides", "hidden_size=32", "--model_name_or_path", str(tmp_path))


def test_a_finished_run_is_not_trained_again(trained, bad, tmp_path):
    """The finished command again: one line, every file as it was (the Trainer would resume at checkpoint-60, train
    a 61st step past --max_steps and rewrite the results)."""
    out, args, _ = trained
    before = {path.name: path.read_bytes() for path in out.glob("*.json")}
    assert "checkpoint-60 is at step 60 and this run ends at step 60: nothing left to train" in refusal(list(args))
    assert {path.name: path.read_bytes() for path in out.glob("*.json")} == before
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-30", "checkpoint-60"]
    assert "nowhere cannot be resumed: no such folder" in bad("--resume_from_checkpoint", str(tmp_path / "nowhere"))


def test_output_dir_without_checkpoint_is_kept(bad, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "model.safetensors").write_text("precious")
    assert "--overwrite_output_dir" in bad(output_dir=out)
    assert "Training/evaluation parameters" not in capsys.readouterr().out  # not after a 150-line dump
    assert (out / "model.safetensors").read_text() == "precious" and len(list(out.iterdir())) == 1


def test_hub_names_while_offline(bad, tmp_path):
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    assert "--dataset_name 'oscar-corpus/oscar'" in bad("--dataset_name", "oscar-corpus/oscar", env=offline)
    assert "--push_to_hub" in bad("--push_to_hub", env=offline)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("native", ["0", "1"])
def test_bf16_warning_only_without_bf16_instructions(native, monkeypatch):
    module = load_script(SCRIPT, "pytorch_run_mlm_bf16")
    warned = []
    monkeypatch.setattr(module.logger, "warning", warned.append)
    monkeypatch.setenv("LM_CPU_BF16", native)
    for bf16 in (False, True):
        module.warn_if_bf16_is_slow(SimpleNamespace(bf16=bf16, device=module.torch.device("cpu")))
    assert len(warned) == (native == "0") and all(w.startswith("--bf16: this CPU") for w in warned)
