#!/usr/bin/env python
"""Write the first training rows of a Flax training script's run as its train step would see them, noised by the
script's own collate_batch, to output_dir/noised_examples.jsonl, and train nothing: each row before noise, the model
input (trailing padding left out) and the batch's other arrays (labels with -100 kept, masked-LM's masked_positions,
...), the first two decoded. Any of the four scripts, or a renamed copy of one; the run's own flags follow `--`, and
the run itself may then go into the same --output_dir:

  python flax/dump_noised_examples.py flax/run_t5_mlm_flax.py --rows 4 -- --output_dir out/t5 --config_name out/t5 \\
      --tokenizer_name out/t5 --train_file data/ptb/train.txt --max_seq_length 128
"""

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

# The supported range, from requirements.txt's pins (Python 3.11) to requirements-current.txt's (Python 3.12+): a
# package missing or outside it is one line here, before an import fails deep inside transformers or jax.
STACK = {
    "jax": "0.9.2",
    "jaxlib": "0.9.2",
    "flax": "0.12.6",
    "optax": "0.2.8",
    "orbax-checkpoint": "0.12.8",
    "transformers": "4.57.6",
    "datasets": "5.0.1",
    "tokenizers": "0.22.2",
    "safetensors": "0.4",
    "tqdm": "4.0",
}


def check_stack(script, stack):
    """Exit with one line where this Python lacks a package of `stack` ({name: the oldest supported version}), has
    one older, or has transformers 5 or later (no Flax models); each line ends in the install command."""
    versions = {}
    for name in stack:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    current = sys.version_info >= (3, 12)  # jax 0.11 and later need Python 3.12
    if missing := [name for name in stack if name not in versions]:
        sys.exit(
            f"{script}: error: {', '.join(missing)} not installed for {sys.executable}: "
            + (
                "pip install -r requirements-current.txt"
                if current
                else "bash run.sh setup, then source .venv/bin/activate"
            )
        )
    jax = "jax==0.12.1 jaxlib==0.12.1 flax==0.12.12" if current else "jax==0.9.2 jaxlib==0.9.2 flax==0.12.6"
    for name, oldest in stack.items():
        if tuple(int(part) for part in re.findall(r"\d+", versions[name])[:3]) < tuple(map(int, oldest.split("."))):
            sys.exit(
                f"{script}: error: {name} {versions[name]} is older than the {oldest} this script needs: pip install "
                + (jax if name in ("jax", "jaxlib", "flax") else f"'{name}>={oldest}'")
            )
    if int(versions["transformers"].split(".")[0]) >= 5:
        sys.exit(
            f"{script}: error: transformers {versions['transformers']} has no Flax models (5.0 removed them); "
            "this script needs 4.57, the last release with them: pip install 'transformers==4.57.6'"
        )


check_stack(os.path.basename(__file__), STACK)

import numpy as np


def fail(message):
    """One line on stderr naming what is wrong and what to do, and a non-zero exit."""
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def load_script(path):
    """A Flax training script imported by its path, under a name of its own
    (flax/ shares its name with the package)."""
    if not os.path.isfile(path):
        fail(f"{path} does not exist: name a Flax training script, such as flax/run_mlm_flax.py")
    spec = importlib.util.spec_from_file_location("dumped_" + os.path.basename(path)[:-3], path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if not all(hasattr(script, name) for name in ("parse_args", "preprocess", "collate_batch")):
        fail(f"{path} is not a Flax training script: it has no parse_args, preprocess or collate_batch")
    return script


def dump(script, flags, count):
    """The run's data prepared as its main() prepares it (the same checks and lock on output_dir), then its first
    `count` training rows, in training order, collated as the first epoch collates them."""
    model_args, data_args, training_args = script.parse_args(flags)
    script.setup_logging(training_args.log_level)
    training_args.do_train = True  # training rows
    if data_args.streaming:
        fail("the rows are dumped from the data in memory: leave out --streaming")
    script.validate_args(model_args, data_args, training_args)
    script.find_checkpoint(training_args, model_args)
    lock = script.start_process(model_args, training_args)  # held until the rows are written
    raw_datasets = script.load_raw_datasets(model_args, data_args)
    config, tokenizer = script.load_config_and_tokenizer(model_args, training_args.gradient_checkpointing)
    length = script.resolve_max_seq_length(data_args, config, tokenizer)
    script.fit_attention(config, length)
    dataset = script.select_samples(script.preprocess(raw_datasets, data_args, tokenizer, length), data_args)
    plan = script.plan_training(training_args, dataset, length)
    collator = script.build_collator(data_args, config, tokenizer, length, dataset)
    path, seed, records = Path(training_args.output_dir) / "noised_examples.jsonl", training_args.seed, []
    for index, rows in enumerate(script.epoch_batches(plan.num_train_examples, plan.train_batch_size, seed, 0)):
        rows = np.sort(rows)
        examples = dataset["train"][rows]
        batch = script.collate_batch(collator, examples, (seed, 0), rows, len(rows))
        for k, row in enumerate(rows[: count - len(records)]):
            kept = np.flatnonzero(batch["input_ids"][k] != tokenizer.pad_token_id)
            inputs = batch["input_ids"][k][: kept[-1] + 1 if len(kept) else 0].tolist()
            record = dict(batch=index, row=int(row), original_ids=list(examples["input_ids"][k]), input_ids=inputs)
            record.update({key: values[k].tolist() for key, values in batch.items() if key != "input_ids"})
            record.update(original_text=tokenizer.decode(record["original_ids"]), input_text=tokenizer.decode(inputs))
            records.append(record)
        if len(records) == count:
            break
    if plan.process_index == 0:
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        script.logger.info(f"wrote {len(records)} noised training rows to {path}; trained nothing")
    if lock is not None:
        lock.close()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = fail
    parser.add_argument("script", help="a Flax training script, such as flax/run_mlm_flax.py")
    parser.add_argument("--rows", type=int, default=4, help="how many training rows to write (default 4)")
    parser.usage = "%(prog)s SCRIPT [--rows N] -- FLAGS (the script's own)"
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    if args.rows < 1:
        fail(f"--rows must be positive, got {args.rows}")
    dump(load_script(args.script), argv[cut + 1 :], args.rows)


if __name__ == "__main__":
    main()
