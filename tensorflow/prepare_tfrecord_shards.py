#!/usr/bin/env python
# Reproduction of Hugging Face's examples/tensorflow/language-modeling-tpu/prepare_tfrecord_shards.py
# (Apache-2.0 upstream), for transformers 4.57.6 / tensorflow 2.21, with local text files.
"""Tokenize one split, concatenate and cut it into blocks of --max_length tokens, and write TFRecord
shards of --shard_size blocks: OUTPUT_DIR/<split>/dataset-<shard>-<count>.tfrecord, each record with
int64 `input_ids` and `attention_mask`, and OUTPUT_DIR/<split>/shards.json naming the tokenizer. tensorflow/run_mlm.py
counts the samples from the file names and refuses shards of another tokenizer.
Paths go through tf.io.gfile, so gs:// buckets work for those who have them.

  python tensorflow/prepare_tfrecord_shards.py --tokenizer_name_or_path out/unigram \
      --train_file data/ptb/train.txt --split train --max_length 128 --shard_size 1000 --output_dir out/shards

Differences from upstream: --train_file reads local text; blank lines are dropped (upstream turned
each into a [CLS] [SEP] pair); the records-count file goes into the output folder (upstream wrote it
into the working directory); existing shards are only replaced with --overwrite_output_dir, and
each shard is written under a temporary name and renamed when complete.
"""

import argparse
import codecs
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from itertools import chain

# Only tf.io / tf.train are used here: keep transformers from importing JAX and PyTorch.
os.environ.setdefault("USE_FLAX", "0")
os.environ.setdefault("USE_TORCH", "0")

logger = logging.getLogger(__name__)


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=(
            "Prepare TFRecord shards from pre-tokenized samples of the wikitext dataset (or a local text file)."
        )
    )
    parser.error = fail  # a bad or missing flag: one line, not a usage block
    parser.add_argument(
        "--dataset_name",
        type=str,
        default="wikitext",
        help="Name of the dataset on the hub (ignored with --train_file).",
    )
    parser.add_argument(
        "--dataset_config", type=str, default="wikitext-103-raw-v1", help="Configuration name of the dataset."
    )
    parser.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="Allow datasets defined on the Hub in their own modeling files.",
    )
    parser.add_argument(
        "--train_file",
        type=str,
        default=None,
        help="A local text file (one text per line) holding the --split to prepare.",
    )
    parser.add_argument(
        "--tokenizer_name_or_path",
        type=str,
        default="sayakpaul/unigram-tokenizer-wikitext",
        help="Tokenizer identifier or folder (tensorflow/train_unigram.py writes one).",
    )
    parser.add_argument("--shard_size", type=int, default=1000, help="Number of entries to go in a single shard.")
    parser.add_argument("--split", type=str, default="train", choices=["train", "test", "validation"])
    parser.add_argument("--limit", default=None, type=int, help="Limit the number of texts (lines) to read.")
    parser.add_argument(
        "--max_length",
        type=int,
        default=512,
        help=(
            "Maximum sequence length. "
            "For training on TPUs, it helps to have a maximum sequence length that is a multiple of 8."
        ),
    )
    parser.add_argument(
        "--output_dir",
        default="tf-tpu",
        type=str,
        help="Output directory where the TFRecord shards will be saved (a gs:// URL works too).",
    )
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="Replace the shards already in OUTPUT_DIR/<split>."
    )
    parser.add_argument("--num_proc", type=int, default=None, help="Processes for tokenization (upstream used 4).")
    args = parser.parse_args(argv)
    for flag in ("shard_size", "max_length"):
        if getattr(args, flag) <= 0:
            fail(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if args.limit is not None and args.limit <= 0:
        fail(f"--limit must be positive, got {args.limit}")
    return args


def hub_reachable(timeout=5.0):
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    import requests

    try:
        requests.head(constants.ENDPOINT, timeout=timeout)
        return True
    except requests.RequestException:
        return False


def check_hub_name(flag, name):
    """A hub id must be reachable, or (HF_HUB_OFFLINE=1) in the local cache, which loading it then checks."""
    from huggingface_hub import constants

    if not os.path.exists(name) and not constants.HF_HUB_OFFLINE and not hub_reachable():
        fail(
            f"{flag} {name!r} is not a local path and the Hugging Face Hub is unreachable (offline?); pass local "
            "files instead (--train_file, and a tokenizer folder from tensorflow/train_unigram.py)"
        )


# Where a local folder has no tokenizer.json and tokenizer_config.json names no class known here: any of these is a
# vocabulary some tokenizer class reads.
VOCABULARY_FILES = ("vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")


def missing_tokenizer_files(path):
    """The files a local tokenizer folder lacks, [] where it is whole: tokenizer.json, or every vocabulary file of the
    class its tokenizer_config.json names (transformers' slow classes open a missing one as None: a TypeError)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "tokenizer.json")):
        return []
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class") or ""
        needed = list(tokenizer_class_from_name(name.removesuffix("Fast")).vocab_files_names.values())
    except Exception:  # noqa: BLE001 - no tokenizer_config.json, or a class this install cannot name
        if any(os.path.isfile(os.path.join(path, name)) for name in VOCABULARY_FILES):
            return []
        return ["tokenizer.json", f"a vocabulary ({', '.join(VOCABULARY_FILES)})"]
    absent = [name for name in needed if not os.path.isfile(os.path.join(path, name))]
    return ["tokenizer.json", *absent] if absent or not needed else []


def check_tokenizer_folder(flag, path):
    missing = missing_tokenizer_files(path)
    if missing:
        fail(
            f"{flag} {path} holds no complete tokenizer: it lacks {', '.join(missing)}; write one with "
            "tensorflow/train_unigram.py or tokenizers/train_tokenizer.py, or pass the folder that holds one"
        )


def check_text_file(flag, path):
    """A local text file: a file (not a folder), UTF-8 (with the line of the first byte that is not), not blank."""
    if os.path.isdir(path):
        fail(f"{flag} {path} is a directory; pass a text file")
    if not os.path.isfile(path):
        fail(f"{flag} {path} does not exist")
    decoder, line, empty, newline = codecs.getincrementaldecoder("utf-8")(), 1, True, b"\n"
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            empty = empty and not chunk.strip()
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                where = line + chunk.count(newline, 0, e.start)
                fail(
                    f"{flag} {path} is not UTF-8 text (byte 0x{chunk[e.start]:02x} on line {where}); "
                    "convert it first, e.g. with iconv -f latin1 -t utf-8"
                )
            line += chunk.count(newline)
    if empty:
        fail(f"{flag} {path} is empty: it has no non-blank line")


def check_writable(flag, path):
    """Fail unless the folder `path` (existing or not) can be created and written into; leaves no trace."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(f"{flag} {path}: {parent} is a file, not a folder")
    try:
        shutil.rmtree(tempfile.mkdtemp(prefix=".write-test-", dir=parent))
    except OSError as e:
        fail(f"{flag} {path} cannot be written ({e.strerror} in {parent}); choose another folder")


def load_split(args):
    import datasets

    if args.train_file is not None:
        dataset = datasets.load_dataset("text", data_files={args.split: args.train_file}, split=args.split)
    else:
        check_hub_name("--dataset_name", args.dataset_name)
        dataset = datasets.load_dataset(
            args.dataset_name, args.dataset_config, split=args.split, trust_remote_code=args.trust_remote_code
        )
    dataset = dataset.filter(lambda text: bool(text.strip()), input_columns=["text"], desc="Dropping blank lines")
    if args.limit is not None:
        dataset = dataset.select(range(min(len(dataset), args.limit)))
    if len(dataset) == 0:
        fail(f"the {args.split} split has no non-blank text")
    return dataset


def vocab_digest(tokenizer):
    """The tokenizer's vocabulary, tokens and ids, as a SHA-256 digest (run_mlm.py compares its tokenizer's)."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def group_texts(examples, max_length):
    """Concatenate the texts and cut them into blocks of exactly max_length tokens (the remainder is dropped)."""
    concatenated = {k: list(chain.from_iterable(examples[k])) for k in examples.keys()}
    total_length = (len(concatenated[list(examples.keys())[0]]) // max_length) * max_length
    return {k: [t[i : i + max_length] for i in range(0, total_length, max_length)] for k, t in concatenated.items()}


def get_serialized_examples(tokenized_data):
    import tensorflow as tf

    records = []
    for input_ids, attention_mask in zip(tokenized_data["input_ids"], tokenized_data["attention_mask"]):
        features = {
            "input_ids": tf.train.Feature(int64_list=tf.train.Int64List(value=input_ids)),
            "attention_mask": tf.train.Feature(int64_list=tf.train.Int64List(value=attention_mask)),
        }
        records.append(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
    return records


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    if args.train_file is not None:
        check_text_file("--train_file", args.train_file)
    if not args.output_dir.startswith("gs://"):
        check_writable("--output_dir", args.output_dir)
    check_hub_name("--tokenizer_name_or_path", args.tokenizer_name_or_path)
    check_tokenizer_folder("--tokenizer_name_or_path", args.tokenizer_name_or_path)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path)
    except Exception as e:  # noqa: BLE001 - a damaged tokenizer file raises what its reader raises
        fail(
            f"cannot load the tokenizer {args.tokenizer_name_or_path!r} ({type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0]})"
        )

    import tensorflow as tf

    split_dir = os.path.join(args.output_dir, args.split)
    old_shards = tf.io.gfile.glob(os.path.join(split_dir, "*.tfrecord"))
    if old_shards and not args.overwrite_output_dir:
        fail(f"{split_dir} already holds {len(old_shards)} shards; pass --overwrite_output_dir to replace them")
    dataset = load_split(args)

    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = (
        True  # texts are cut into blocks below
    )
    tokenized = dataset.map(
        lambda examples: tokenizer(examples["text"]),
        batched=True,
        num_proc=args.num_proc,
        remove_columns=dataset.column_names,
        desc="Tokenizing",
    )
    keep = [c for c in tokenized.column_names if c in ("input_ids", "attention_mask")]
    grouped = tokenized.select_columns(keep).map(
        group_texts,
        fn_kwargs={"max_length": args.max_length},
        batched=True,
        batch_size=1000,
        num_proc=args.num_proc,
        desc=f"Grouping in blocks of {args.max_length}",
    )
    if len(grouped) == 0:
        fail(f"the {args.split} split has fewer than --max_length {args.max_length} tokens: no block to write")

    tf.io.gfile.makedirs(split_dir)
    for path in old_shards:
        tf.io.gfile.remove(path)
    shard_count = total_records = 0
    for shard in range(0, len(grouped), args.shard_size):
        dataset_snapshot = grouped[shard : shard + args.shard_size]
        records_containing = len(dataset_snapshot["input_ids"])
        filename = os.path.join(split_dir, f"dataset-{shard_count}-{records_containing}.tfrecord")
        with tf.io.TFRecordWriter(filename + ".tmp") as out_file:
            for record in get_serialized_examples(dataset_snapshot):
                out_file.write(record)
        tf.io.gfile.rename(filename + ".tmp", filename, overwrite=True)
        logger.info(f"Wrote file {filename} containing {records_containing} records")
        shard_count += 1
        total_records += records_containing

    with tf.io.gfile.GFile(os.path.join(args.output_dir, f"split-{args.split}-records-count.txt"), "w") as f:
        print(f"Total {args.split} records: {total_records}", file=f)
    written = dict(
        tokenizer=args.tokenizer_name_or_path, vocab_size=len(tokenizer), vocab_sha256=vocab_digest(tokenizer)
    )
    with tf.io.gfile.GFile(os.path.join(split_dir, "shards.json"), "w") as f:
        json.dump(written, f)
    logger.info(
        f"{args.split}: {total_records} records of {args.max_length} tokens in {shard_count} shards under {split_dir}"
    )


if __name__ == "__main__":
    main()
