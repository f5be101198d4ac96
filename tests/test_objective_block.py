"""The objective block holds any objective: ELECTRA (tests/electra_block.py: two models, two loss terms with their
own denominators, sampling in evaluation) pasted in place of run_mlm_flax.py's block, nothing else changed."""

import difflib
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    ROOT,
    TWO_DEVICES,
    check_ok,
    error_line,
    kill_after_first_checkpoint,
    load_script,
    losses_by_step,
    refusal,
    run,
    script_args,
)

START, END = "# === the objective", "# === end of the objective"


def electra_script(tmp_path):
    """A copy of run_mlm_flax.py with the ELECTRA block between the banners; checks that only the block differs."""
    original = (Path(ROOT) / "flax" / "run_mlm_flax.py").read_text()
    block = (Path(ROOT) / "tests" / "electra_block.py").read_text().rstrip() + "\n\n\n"
    copy = original[: original.index(START)] + block + original[original.index(END) :]
    before, after = original.splitlines(), copy.splitlines()
    first = next(i for i, line in enumerate(before) if line.startswith(START))
    last = next(i for i, line in enumerate(before) if line.startswith(END))
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        assert tag == "equal" or first <= i1 <= i2 <= last, (tag, i1, i2)
    script = tmp_path / "run_electra_flax.py"
    script.write_text(copy)
    return script


def patched_block_script(script, patch, directory):
    """A copy of a Flax training script whose objective block takes each top-level definition of `patch` (a file in
    tests/) in place of its own of the same name, the new ones first and the patch's header comment for the block's;
    checks that only the block differs."""
    import ast

    source = (Path(ROOT) / script).read_text()
    start, end = source.index(START), source.index(END)
    block, patch = source[start:end].splitlines(), (Path(ROOT) / "tests" / patch).read_text().splitlines()

    def definitions(lines):  # {name: (first line, end)} of each top-level statement, decorators included
        spans = {}
        for index, node in enumerate(ast.parse("\n".join(lines)).body):
            name = getattr(node, "name", None) or getattr(node, "targets", [ast.Name(index)])[0].id
            spans[name] = (
                min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1,
                node.end_lineno,
            )
        return spans

    ours, theirs = definitions(block), definitions(patch)
    for name, (first, last) in sorted(((n, ours[n]) for n in theirs if n in ours), key=lambda item: -item[1][0]):
        block[first:last] = patch[theirs[name][0] : theirs[name][1]]
    header = lambda lines: next(i for i, line in enumerate(lines) if not line.startswith("#"))  # noqa: E731
    new = [line for name, (first, last) in theirs.items() if name not in ours for line in [*patch[first:last], "", ""]]
    block = patch[: header(patch)] + ["", *new] + block[header(block) :]
    copy = Path(directory) / Path(script).name.replace("run_", "my_")
    copy.write_text(source[:start] + "\n".join(block) + "\n" + source[end:])
    return copy


def block_copy(script, directory, *replacements):
    """A copy of a Flax training script with each (old, new) replacement made once, inside its objective block."""
    source = (Path(ROOT) / script).read_text()
    start, end = source.index(START), source.index(END)
    block = source[start:end]
    for old, new in replacements:
        assert block.count(old) == 1, old
        block = block.replace(old, new)
    copy = Path(directory) / Path(script).name.replace("run_", "my_")
    copy.write_text(source[:start] + block + source[end:])
    return copy


# A causal LM that also scores, apart, its predictions of the training rows' most frequent tokens: state derived
# from the rows to be trained on (build_collator), recorded for resumes (resume_checks), and a per-token key in the
# batch that the model does not take and loss_sums reads.
FREQUENT_TOKENS = (
    (
        '    keep_linebreaks: bool = arg(True, "Whether to keep line breaks when using TXT files or not.")\n',
        '    keep_linebreaks: bool = arg(True, "Whether to keep line breaks when using TXT files or not.")\n'
        '    frequent_tokens: int = arg(5, "How many of the most frequent training tokens to score apart.")\n',
    ),
    (
        'SCORED_TOKENS = {"loss": "predicted_tokens"}',
        'SCORED_TOKENS = {"loss": "predicted_tokens", "frequent": "frequent_tokens"}',
    ),
    (
        "    return CausalLMCollator(pad)\n",
        "    values, counts = np.unique(np.concatenate(dataset['train']['input_ids']), return_counts=True)\n"
        "    logger.info(f\"build_collator counted tokens in {len(dataset['train'])} rows\")\n"
        "    frequent = sorted(values[np.argsort(-counts, kind='stable')[: data_args.frequent_tokens]].tolist())\n"
        "    return CausalLMCollator(pad), frequent\n",
    ),
    ('derives nothing from the data."""\n    return {}', '"""\n    return {\'frequent_tokens\': collator[1]}'),
    (
        "def collate_batch(collator, examples, seed, row_ids, num_rows, train=True):\n",
        "def collate_batch(collator, examples, seed, row_ids, num_rows, train=True):\n"
        "    collator, frequent = collator\n",
    ),
    (
        "    return batch\n",
        "    batch['frequent'] = np.isin(batch['input_ids'], frequent).astype(np.int32)\n    return batch\n",
    ),
    (
        '    return {"loss": (loss, count), "accuracy": (correct, count)}',
        "    mask = batch['attention_mask'][:, 1:] * batch['attention_mask'][:, :-1]\n"
        "    frequent = batch['frequent'][:, 1:] * mask\n"
        "    frequent_sum, _, frequent_count = token_sums(logits[:, :-1], batch['input_ids'][:, 1:], frequent)\n"
        '    return {"loss": (loss, count), "accuracy": (correct, count), "frequent": (frequent_sum, frequent_count)}',
    ),
)


def test_a_block_derives_state_from_its_rows_checks_it_on_resume_and_collates_keys_of_its_own(
    gpt2_dir, corpus, tmp_path
):
    """Through a copy of run_clm_flax.py (FREQUENT_TOKENS): build_collator sees the rows to be trained on
    (--max_train_samples applied), a batch key that the model's __call__ does not name reaches loss_sums and not the
    model, the extra pair's count is written, and a resume whose resume_checks differ is refused in one line."""
    script = block_copy("flax/run_clm_flax.py", tmp_path, *FREQUENT_TOKENS)
    out = tmp_path / "out"
    steps = ("--per_device_train_batch_size", "4", "--max_train_samples", "40", "--save_steps", "2", "--do_train")
    args = [*script_args(str(script), "gpt2", gpt2_dir, corpus, out, "--block_size", "32"), *steps, "--do_eval"]
    result = check_ok(run([*args, "--max_steps", "2"]))
    assert "build_collator counted tokens in 40 rows" in result.stderr
    results = json.loads((out / "eval_results.json").read_text())
    assert 0 < results["eval_frequent_tokens"] < results["eval_predicted_tokens"] and results["eval_frequent"] > 0
    line = refusal([*args, "--max_steps", "4", "--frequent_tokens", "3", "--resume_from_checkpoint"])
    assert "was written for other data (resume_checks {'frequent_tokens': [" in line, line


def test_fit_objective_grows_the_vocabulary_and_a_pretrained_models_embeddings(tiny_model_dir, tmp_path):
    """A block whose fit_objective adds a special token: the config grows before the vocabulary checks, and a
    pretrained model's embeddings and head bias grow with it, keeping their rows, the new one initialised."""
    import numpy as np
    import transformers
    from flax.traverse_util import flatten_dict

    pretrained = tmp_path / "pretrained"
    shutil.copytree(tiny_model_dir, pretrained)
    transformers.FlaxAutoModelForMaskedLM.from_config(
        transformers.AutoConfig.from_pretrained(pretrained), seed=1
    ).save_pretrained(pretrained)
    adds_a_token = (
        '        fail(f"tokenizer {source!r} has no mask token, which masked language modelling needs")\n',
        '        fail(f"tokenizer {source!r} has no mask token, which masked language modelling needs")\n'
        "    tokenizer.add_special_tokens({'additional_special_tokens': ['<extra>']})\n"
        "    config.vocab_size = max(config.vocab_size, len(tokenizer))\n",
    )
    script = load_script(str(block_copy("flax/run_mlm_flax.py", tmp_path, adds_a_token)), "grows_its_vocabulary")
    model_args = script.ModelArguments(model_name_or_path=str(pretrained))
    config, tokenizer = script.load_config_and_tokenizer(model_args)
    assert len(tokenizer) == config.vocab_size == 1001
    training_args = script.TrainingArguments(output_dir=str(tmp_path / "out"))
    params = flatten_dict(script.build_model(model_args, training_args, config, abstract=False)[1])
    before = flatten_dict(transformers.FlaxAutoModelForMaskedLM.from_pretrained(pretrained, _do_init=False)[1])
    grown = sorted("/".join(name) for name in params if params[name].shape != before[name].shape)
    assert grown == ["lm_head/bias", "roberta/embeddings/word_embeddings/embedding"], grown
    for name, value in params.items():
        np.testing.assert_array_equal(np.asarray(value)[tuple(slice(0, n) for n in before[name].shape)], before[name])
    new_row = np.asarray(params["roberta", "embeddings", "word_embeddings", "embedding"])[1000]
    assert 0.5 * config.initializer_range < new_row.std() < 2 * config.initializer_range  # the model's own init


def test_a_t5_copy_whose_fit_objective_adds_a_token_keeps_its_sentinels(t5_dir, corpus, tmp_path):
    """T5's sentinels are found by name: a token a copy adds in fit_objective comes after <extra_id_0> in the
    vocabulary, and spans are still written as <extra_id_0>, <extra_id_1>, ..., never as the new token (before, the
    copy was refused: no sentinels "at the top of its vocabulary")."""
    from transformers import AutoTokenizer

    adds_a_token = (
        '        fail(f"tokenizer {source!r} has no EOS token, which span corruption appends")\n',
        '        fail(f"tokenizer {source!r} has no EOS token, which span corruption appends")\n'
        "    tokenizer.add_special_tokens({'additional_special_tokens': ['<prefix_lm>']})\n"
        "    config.vocab_size = max(config.vocab_size, len(tokenizer))\n",
    )
    copy = block_copy("flax/run_t5_mlm_flax.py", tmp_path, adds_a_token)
    args = script_args(str(copy), "t5", t5_dir, corpus, tmp_path / "out", "--max_seq_length", "32")
    check_ok(
        run(
            [
                "flax/dump_noised_examples.py",
                str(copy),
                "--rows",
                "8",
                "--",
                *args[1:],
                "--per_device_train_batch_size",
                "4",
            ]
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(t5_dir)
    sentinels = tokenizer.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(100)])
    rows = [json.loads(line) for line in (tmp_path / "out" / "noised_examples.jsonl").read_text().splitlines()]
    for row in rows:
        written = [t for t in row["input_ids"] if t >= len(tokenizer) - 100]
        assert written == sentinels[: len(written)] and row["labels"][0] == sentinels[0], row
        assert len(tokenizer) not in row["input_ids"] + row["labels"]  # the new token's id


def test_a_pretrained_models_embeddings_grow_to_a_larger_tokenizer(tiny_model_dir, corpus, tmp_path):
    """--model_name_or_path with a tokenizer of more tokens: its vocabulary grows to the tokenizer's, as PyTorch's
    resize_token_embeddings does, old rows kept; a new model's config of fewer tokens is refused in one line."""
    import numpy as np
    import transformers

    pretrained, larger = tmp_path / "pretrained", tmp_path / "larger"
    shutil.copytree(tiny_model_dir, pretrained)
    model = transformers.FlaxAutoModelForMaskedLM.from_config(transformers.AutoConfig.from_pretrained(pretrained))
    model.save_pretrained(pretrained)
    tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained)
    tokenizer.add_tokens(["<new>", "<newer>"])
    tokenizer.save_pretrained(larger)
    script = load_script("flax/run_mlm_flax.py", "grows_to_its_tokenizer")
    model_args = script.ModelArguments(model_name_or_path=str(pretrained), tokenizer_name=str(larger))
    config = script.load_config_and_tokenizer(model_args)[0]
    training_args = script.TrainingArguments(output_dir=str(tmp_path / "out"))
    params = script.build_model(model_args, training_args, config, abstract=False)[1]
    embedding = np.asarray(params["roberta"]["embeddings"]["word_embeddings"]["embedding"])
    assert config.vocab_size == len(tokenizer) == embedding.shape[0] == 1002
    np.testing.assert_array_equal(
        embedding[:1000], model.params["roberta"]["embeddings"]["word_embeddings"]["embedding"]
    )
    args = script_args("flax/run_mlm_flax.py", "roberta", pretrained, corpus, tmp_path / "new", "--do_train")
    args[args.index("--tokenizer_name") + 1] = str(larger)
    assert "vocab_size (1000) is smaller than the tokenizer's 1002 tokens; rebuild the config" in refusal(args)


def test_electra_block_trains_evaluates_saves_both_models_and_resumes_exactly(tiny_model_dir, corpus, tmp_path):
    """Also: the copy refuses bad input and logs under its own name, never the original's."""
    from transformers import AutoTokenizer, ElectraConfig, FlaxElectraForMaskedLM, FlaxElectraForPreTraining

    script, model_dir = electra_script(tmp_path), tmp_path / "electra"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sizes = dict(hidden_size=64, embedding_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    ElectraConfig(
        vocab_size=len(tokenizer), max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, **sizes
    ).save_pretrained(model_dir)

    def command(output_dir, *extra):
        args = script_args(str(script), "electra", model_dir, corpus, output_dir, "--max_seq_length", "32")
        extra = ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", *extra)
        extra += ("--max_steps", "12", "--save_steps", "4", "--logging_steps", "2", "--learning_rate", "2e-3")
        return [*args, *extra, "--do_train", "--do_eval"]

    def train(output_dir, *extra):
        result = check_ok(run(command(output_dir, *extra), env=TWO_DEVICES))
        return result.stdout + result.stderr

    full, killed = tmp_path / "full", tmp_path / "killed"
    log = train(full)
    results = json.loads((full / "all_results.json").read_text())
    names = ("generator_loss", "generator_accuracy", "discriminator_loss", "discriminator_accuracy")
    assert all(0 <= results[f"eval_{name}"] for name in names) and results["eval_discriminator_accuracy"] > 0.5
    # eval_loss and perplexity are the first term's (the generator's masked-LM loss); the weighted sum trained on is
    # trained_loss, in evaluation and in training's log
    assert results["eval_loss"] == results["eval_generator_loss"]
    assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_generator_loss"]))
    assert results["eval_trained_loss"] == results["eval_generator_loss"] + 50 * results["eval_discriminator_loss"]
    assert "| trained_loss " in log
    assert "| discriminator_accuracy " in log and "discriminator_accuracy=" in log
    # Each pair's count under its name in SCORED_TOKENS: the generator scores the masked tokens, the discriminator
    # every real token.
    assert 0 < results["eval_masked_tokens"] < 0.3 * results["eval_real_tokens"] <= 0.3 * 32 * results["eval_samples"]
    # Both models load with from_pretrained: the discriminator from output_dir, the generator from its folder.
    assert FlaxElectraForPreTraining.from_pretrained(full).config.hidden_size == 64
    assert FlaxElectraForMaskedLM.from_pretrained(full / "generator").config.hidden_size == 16
    # Killed once its first checkpoint is complete, then resumed: the same weights and losses, bit for bit.
    killed_log = kill_after_first_checkpoint(command(killed), killed, env=TWO_DEVICES)
    resumed_log = train(killed, "--resume_from_checkpoint")
    assert int(re.search(r"Resuming at step (\d+)", resumed_log).group(1)) < 12, "the kill came too late"
    for weights in ("flax_model.msgpack", "generator/flax_model.msgpack"):
        assert (full / weights).read_bytes() == (killed / weights).read_bytes()
    full_losses, after = losses_by_step(log), losses_by_step(resumed_log)
    assert after and all(full_losses[s] == loss for s, loss in {**losses_by_step(killed_log), **after}.items())
    assert json.loads((killed / "eval_results.json").read_text())["eval_loss"] == results["eval_loss"]
    line = error_line(run([str(script), "--output_dir", str(tmp_path / "refused"), "--no_such_flag"]), script.name)
    assert "unknown argument --no_such_flag" in line
    written = "".join(p.read_text() for p in full.rglob("*") if p.is_file() and p.suffix in (".json", ".txt"))
    assert "run_mlm_flax" not in log + killed_log + resumed_log + written


def checkpointed(checkpoint, part):
    """params[part] of a checkpoint, read on the host: {path tuple: array}."""
    import jax
    import orbax.checkpoint as ocp
    from flax.traverse_util import flatten_dict

    state, checkpointer = checkpoint / "state", ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), checkpointer.metadata(state).item_metadata.tree
    )
    return flatten_dict(checkpointer.restore(state, restore_args=as_numpy)["params"][part])


def own_head_run(script, model_type, model_dir, corpus, length_flag, output_dir, *extra):
    """A copy's command line: 8 steps on two devices, 2 rows a device and 2 micro-batches a step, checkpoints at
    steps 4 and 8, its losses logged every 2 steps, trained and evaluated."""
    args = script_args(str(script), model_type, model_dir, corpus, output_dir, length_flag, "32", *extra)
    args += ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "8"]
    return [*args, "--save_steps", "4", "--logging_steps", "2", "--learning_rate", "2e-3", "--do_train", "--do_eval"]


def assert_saved_plain_and_resumes_bitwise(command, full, log, expected_keys, tmp_path):
    """The block's own head is trained and checkpointed (it moved from checkpoint-4 to checkpoint-8) and never saved:
    output_dir's msgpack (read from the file: from_pretrained would drop keys it does not know) holds exactly
    `expected_keys`, bit for bit checkpoint-8's params["model"]. Killed (kill -9) once its first checkpoint is
    complete, then resumed: the same model, head, losses and evaluation as the uninterrupted run, bit for bit."""
    from flax.serialization import msgpack_restore
    from flax.traverse_util import flatten_dict

    heads = [checkpointed(full / f"checkpoint-{step}", "objective") for step in (4, 8)]
    assert heads[0] and all(not np.array_equal(heads[0][name], heads[1][name]) for name in heads[0])
    saved = flatten_dict(msgpack_restore((full / "flax_model.msgpack").read_bytes()))
    assert sorted(saved) == sorted(expected_keys), sorted(set(saved) ^ set(expected_keys))
    model = checkpointed(full / "checkpoint-8", "model")
    assert sorted(model) == sorted(saved) and all(np.array_equal(model[name], saved[name]) for name in model)
    killed = tmp_path / "killed"
    killed_log = kill_after_first_checkpoint(command(killed), killed, env=TWO_DEVICES)
    resumed = check_ok(run([*command(killed), "--resume_from_checkpoint"], env=TWO_DEVICES))
    assert (full / "flax_model.msgpack").read_bytes() == (killed / "flax_model.msgpack").read_bytes()
    again = checkpointed(killed / "checkpoint-8", "objective")
    assert sorted(again) == sorted(heads[1]) and all(np.array_equal(heads[1][name], again[name]) for name in again)
    after = losses_by_step(resumed.stdout + resumed.stderr)
    assert after and all(losses_by_step(log)[s] == loss for s, loss in {**losses_by_step(killed_log), **after}.items())
    scores = lambda path: {  # noqa: E731
        k: v for k, v in json.loads(path.read_text()).items() if "runtime" not in k and "per_second" not in k
    }
    assert scores(killed / "eval_results.json") == scores(full / "eval_results.json")
    return heads


def test_a_block_with_parameters_of_its_own_trains_resumes_exactly_and_saves_a_plain_model(gpt2_dir, corpus, tmp_path):
    """tests/mtp_block.py in a copy of run_clm_flax.py: two extra heads of the block's own (params["objective"]), on
    two devices with accumulation, are trained and evaluated, each head's loss reported; eval_loss is the next-token
    loss; each head's count is the eval rows' positions that have the token it predicts; the heads are in every
    checkpoint and resume bit for bit, and the saved model is a plain GPT-2, without them: its msgpack holds a new
    GPT-2's parameters, bit for bit the last checkpoint's params["model"]."""
    import jax
    from flax.traverse_util import flatten_dict
    from transformers import AutoTokenizer, FlaxGPT2LMHeadModel, GPT2Config

    script = patched_block_script("flax/run_clm_flax.py", "mtp_block.py", tmp_path)
    command = lambda output_dir: own_head_run(script, "gpt2", gpt2_dir, corpus, "--block_size", output_dir)  # noqa: E731
    full = tmp_path / "full"
    result = check_ok(run(command(full), env=TWO_DEVICES))
    log = result.stdout + result.stderr
    assert re.search(r"Model: gpt2, [\d,]+ parameters \(and [\d,]+ of the objective's own\)", log), log[-2000:]
    results = json.loads((full / "eval_results.json").read_text())
    ahead = [results[f"eval_ahead_{k}_loss"] for k in (2, 3)]
    assert all(0 < loss for loss in ahead) and results["eval_perplexity"] == pytest.approx(
        math.exp(results["eval_loss"])
    )
    assert results["eval_trained_loss"] == pytest.approx(results["eval_loss"] + 0.15 * sum(ahead), rel=1e-12)
    # The counts by hand: the validation text's tokens (each line with its newline, --keep_linebreaks) in blocks
    # of 32, each with 31 positions that have the next token, 30 the one 2 ahead and 29 the one 3 ahead.
    tokenizer = AutoTokenizer.from_pretrained(gpt2_dir)
    lines = (corpus / "validation_slice.txt").read_text().splitlines(keepends=True)
    blocks = sum(len(tokenizer(line)["input_ids"]) for line in lines) // 32
    assert blocks > 10 and results["eval_samples"] == blocks
    counts = [results[f"eval_{name}_tokens"] for name in ("predicted", "ahead_2", "ahead_3")]
    assert counts == [31 * blocks, 30 * blocks, 29 * blocks], (counts, blocks)
    new = flatten_dict(
        FlaxGPT2LMHeadModel(GPT2Config.from_pretrained(full), _do_init=False).init_weights(jax.random.key(0), (1, 1))
    )
    heads = assert_saved_plain_and_resumes_bitwise(command, full, log, new, tmp_path)
    layers = {"dense": ("bias", "kernel"), "ln": ("bias", "scale")}
    expected = sorted(f"{layer}_{k}/{name}" for k in (2, 3) for layer, names in layers.items() for name in names)
    assert sorted("/".join(name) for name in heads[0]) == expected


def test_a_block_on_the_encoders_states_with_a_weight_from_a_flag(t5_dir, corpus, tmp_path):
    """tests/span_bag_block.py in a copy of run_t5_mlm_flax.py: a head of the block's own on the encoder's final
    states (ModelStates.encoder_hidden) and a second loss term weighted by --bag_loss_weight (0.25 here, not the
    block's 0.5), on two devices with accumulation: trained and evaluated (eval_loss is span corruption's alone, the
    trained loss weighs the bag term by the flag, one count a row); the head in every checkpoint; the saved model a
    plain T5 that from_pretrained loads with no unexpected or missing keys; kill -9 and a resume end bit for bit as
    the uninterrupted run."""
    import transformers
    from flax.traverse_util import flatten_dict
    from transformers.testing_utils import CaptureLogger

    script = patched_block_script("flax/run_t5_mlm_flax.py", "span_bag_block.py", tmp_path)
    flags = ("--bag_loss_weight", "0.25")
    command = lambda output_dir: own_head_run(script, "t5", t5_dir, corpus, "--max_seq_length", output_dir, *flags)  # noqa: E731
    full = tmp_path / "full"
    result = check_ok(run(command(full), env=TWO_DEVICES))
    log = result.stdout + result.stderr
    assert re.search(r"Model: t5, [\d,]+ parameters \(and [\d,]+ of the objective's own\)", log), log[-2000:]
    results = json.loads((full / "eval_results.json").read_text())
    assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]))
    assert 0 < results["eval_bag_loss"] < math.log(2)  # below a head that knows nothing: it learned
    assert results["eval_trained_loss"] == pytest.approx(results["eval_loss"] + 0.25 * results["eval_bag_loss"])
    assert results["eval_bag_rows"] == results["eval_samples"] > 10
    load_script("flax/run_t5_mlm_flax.py", "bag_run_t5_mlm_flax").clip_with_a_max_for_t5()  # today's jax
    with CaptureLogger(transformers.modeling_flax_utils.logger) as loading:
        model, params = transformers.FlaxT5ForConditionalGeneration.from_pretrained(full, _do_init=False)
    assert "were not used" not in loading.out and "newly initialized" not in loading.out, loading.out
    new = flatten_dict(model.params_shape_tree)  # a new T5's, by shapes
    heads = assert_saved_plain_and_resumes_bitwise(command, full, log, new, tmp_path)
    config = transformers.AutoConfig.from_pretrained(full)
    width, vocab_size = config.d_model, config.vocab_size
    assert {name: head.shape for name, head in heads[0].items()} == {
        ("ln", "scale"): (width,),
        ("ln", "bias"): (width,),
        ("dense", "kernel"): (width, vocab_size),
        ("dense", "bias"): (vocab_size,),
    }


# A causal LM that also scores the tokens of row 0 apart, each counted as 1.0 (a mean of exactly 1 wherever the row
# is in the batch), and logs the seed each collate_batch receives.
FIRST_ROW = (
    (
        'SCORED_TOKENS = {"loss": "predicted_tokens"}',
        'SCORED_TOKENS = {"loss": "predicted_tokens", "first": "row_0_tokens"}',
    ),
    (
        "    return batch\n",
        "    logger.info(f'collate_batch seed {seed}')\n"
        "    batch['first'] = batch['attention_mask'] * np.isin(np.arange(num_rows), "
        "np.flatnonzero(np.asarray(row_ids) == 0))[:, None]\n"
        "    return batch\n",
    ),
    (
        '    return {"loss": (loss, count), "accuracy": (correct, count)}',
        "    mask = batch['attention_mask'][:, 1:] * batch['attention_mask'][:, :-1]\n"
        "    first = (batch['first'][:, 1:] * mask).sum()\n"
        '    return {"loss": (loss, count), "accuracy": (correct, count), "first": (first, first)}',
    ),
)


def test_the_collators_seed_and_a_metric_absent_from_most_steps_through_a_copy(gpt2_dir, corpus, tmp_path):
    """Through a copy of run_clm_flax.py (FIRST_ROW): collate_batch's seed is (--seed, epoch) in training, a streamed
    pass being an epoch, and (--seed,) in evaluation; a log line averages over its window's tokens, so a metric scored
    in one step of ten logs its mean (1), not the mean of ten per-step means (0.1)."""
    script = block_copy("flax/run_clm_flax.py", tmp_path, *FIRST_ROW)
    args = script_args(str(script), "gpt2", gpt2_dir, corpus, tmp_path / "out", "--block_size", "32", "--seed", "7")
    args += ["--overwrite_output_dir"]
    args += ["--per_device_train_batch_size", "4", "--max_train_samples", "40", "--logging_steps", "10"]
    args += ["--max_eval_samples", "20", "--do_train", "--save_steps", "100"]
    for extra, seeds in (
        (["--do_eval", "--num_train_epochs", "2"], ["(7, 0)", "(7,)", "(7, 1)", "(7,)"]),
        (["--streaming", "--max_steps", "20"], ["(7, 0)", "(7, 1)"]),
    ):
        result = check_ok(run([*args, *extra]))
        logged = re.findall(r"collate_batch seed (\([^)]*\))", result.stderr)
        assert [s for i, s in enumerate(logged) if i == 0 or s != logged[i - 1]] == seeds, logged
        assert re.findall(r"\| first ([0-9.]+)", result.stdout + result.stderr) == ["1.0000", "1.0000"]
        if "--do_eval" in extra:
            results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
            assert results["eval_first"] == 1 and 0 < results["eval_row_0_tokens"] < results["eval_predicted_tokens"]


def test_noise_from_a_stateful_generator_is_refused(monkeypatch):
    """A block whose collate_batch draws from a generator that keeps state (numpy's global one, say) would resume with
    other noise than the uninterrupted run: the first rows collated twice differ, and the run stops in one line."""
    import datasets
    import numpy as np

    script = load_script("flax/run_mlm_flax.py", "objective_block_run_mlm_flax")
    rows = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8, 9, 10]]})
    pure = lambda collator, examples, seed, ids, n: {"input_ids": np.array(examples["input_ids"]) + seed[0]}  # noqa: E731
    monkeypatch.setattr(script, "collate_batch", pure)
    script.check_noise_is_pure(None, rows, 1)
    np.random.seed(0)
    stateful = lambda collator, examples, seed, ids, n: {"input_ids": np.random.randint(0, 9, (n, 3))}  # noqa: E731
    monkeypatch.setattr(script, "collate_batch", stateful)
    with pytest.raises(
        SystemExit, match=r"collate_batch noised the same rows differently .*default_rng\(\[\*seed, row_id\]\)"
    ):
        script.check_noise_is_pure(None, rows, 1)
