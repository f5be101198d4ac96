#!/usr/bin/env python
# Reproduction of Hugging Face's examples/tensorflow/language-modeling-tpu/train_unigram.py (Apache-2.0
# upstream), for tokenizers 0.22 / transformers 4.57.6, with local text files and a local output folder.
"""Train the Unigram tokenizer of the Keras/TF TPU walkthrough.

Metaspace pre-tokenization, the special tokens [CLS] <pad> [SEP] <unk> [MASK] (ids 0-4), a
post-processor that wraps every text in [CLS] ... [SEP]; saved as an ALBERT-style fast tokenizer that
`AutoTokenizer.from_pretrained(output_dir)` loads. Upstream only pushed it to the hub; here it is
written to --output_dir, and pushed too with --export_to_hub.

  python tensorflow/train_unigram.py --train_file data/ptb/train.txt --vocab_size 10048 --output_dir out/unigram
"""

import argparse
import codecs
import logging
import os
import shutil
import sys
import tempfile

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import Unigram
from tokenizers.trainers import UnigramTrainer

logger = logging.getLogger(__name__)
# RoBERTa's id order (<s> <pad> </s> <unk> <mask>). The walkthrough put <pad> at 3 and [SEP] at 1, but
# TFRobertaEmbeddings hard-codes padding_idx = 1 for its position ids: every [SEP] was then treated as
# padding, and a PyTorch RoBERTa (which takes config.pad_token_id) numbered positions differently.
SPECIAL_TOKENS = ["[CLS]", "<pad>", "[SEP]", "<unk>", "[MASK]"]


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a unigram tokenizer on the wikitext dataset (or local text files)."
    )
    parser.error = fail  # a bad or missing flag: one line, not a usage block
    parser.add_argument(
        "--dataset_name",
        type=str,
        default="wikitext",
        help="Name of the training dataset on the hub (ignored with --train_file).",
    )
    parser.add_argument(
        "--dataset_config", type=str, default="wikitext-103-raw-v1", help="Configuration name of the training dataset."
    )
    parser.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="Allow datasets defined on the Hub in their own modeling files.",
    )
    parser.add_argument(
        "--train_file",
        type=str,
        action="append",
        help="A local text file to train on, one text per line (repeat the flag for several).",
    )
    parser.add_argument("--batch_size", type=int, default=1000, help="Batch size during training.")
    parser.add_argument("--vocab_size", type=int, default=10048, help="Size of the desired vocabulary.")
    parser.add_argument("--limit", default=None, type=int, help="Limit the number of texts (lines) to train on.")
    parser.add_argument(
        "--output_dir", type=str, default="unigram-tokenizer-wikitext", help="Where the tokenizer is saved."
    )
    parser.add_argument("--overwrite_output_dir", action="store_true", help="Write into a non-empty --output_dir.")
    parser.add_argument(
        "--export_to_hub",
        action="store_true",
        help="Also push the tokenizer to the hub as unigram-tokenizer-<dataset>.",
    )
    args = parser.parse_args(argv)
    if args.batch_size <= 0 or args.vocab_size <= len(SPECIAL_TOKENS):
        fail(f"--batch_size must be positive and --vocab_size larger than {len(SPECIAL_TOKENS)}")
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


def load_texts(args):
    """The training texts: the local files' non-blank lines, or the hub dataset's `text` column."""
    if args.train_file:
        texts = []
        for path in args.train_file:
            check_text_file("--train_file", path)
            with open(path, encoding="utf-8") as f:
                texts.extend(line.rstrip("\n") for line in f if line.strip())
        if not texts:
            fail(f"--train_file {' '.join(args.train_file)}: no non-blank line to train on")
        return texts[: args.limit]
    from huggingface_hub import constants

    if not os.path.exists(args.dataset_name) and not constants.HF_HUB_OFFLINE and not hub_reachable():
        fail(
            f"--dataset_name {args.dataset_name!r} is not a local path and the Hugging Face Hub is unreachable "
            "(offline?); pass --train_file with local text (see tokenizers/prepare_corpus.py)"
        )
    import datasets

    dataset = datasets.load_dataset(
        args.dataset_name, args.dataset_config, split="train", trust_remote_code=args.trust_remote_code
    )
    if args.limit is not None:
        dataset = dataset.select(range(min(len(dataset), args.limit)))
    return dataset["text"]


def train(texts, vocab_size, batch_size=1000):
    tokenizer = Tokenizer(Unigram())
    tokenizer.normalizer = normalizers.Sequence([normalizers.Replace("``", '"'), normalizers.Replace("''", '"')])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = UnigramTrainer(unk_token="<unk>", special_tokens=SPECIAL_TOKENS, vocab_size=vocab_size)
    batches = (texts[i : i + batch_size] for i in range(0, len(texts), batch_size))
    tokenizer.train_from_iterator(batches, trainer=trainer, length=len(texts))
    cls_token_id, sep_token_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_token_id), ("[SEP]", sep_token_id)],
    )
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    if os.path.isdir(args.output_dir) and os.listdir(args.output_dir) and not args.overwrite_output_dir:
        fail(f"output directory {args.output_dir} is not empty; pass --overwrite_output_dir to write into it")
    check_writable("--output_dir", args.output_dir)
    if args.export_to_hub and not hub_reachable():
        fail(
            "--export_to_hub: the Hugging Face Hub is unreachable (offline?); drop --export_to_hub and upload "
            f"{args.output_dir} later"
        )
    texts = load_texts(args)
    logger.info(f"Training a {args.vocab_size}-piece unigram tokenizer on {len(texts):,} texts")
    tokenizer = train(texts, args.vocab_size, args.batch_size)

    from transformers import AlbertTokenizerFast

    # ALBERT's fast tokenizer has exactly these special tokens ([CLS] [SEP] <unk> <pad> [MASK]).
    wrapped = AlbertTokenizerFast(tokenizer_object=tokenizer, model_max_length=512)
    wrapped.save_pretrained(args.output_dir)
    logger.info(f"Saved a tokenizer of {len(wrapped):,} tokens to {args.output_dir}")
    if len(wrapped) < args.vocab_size:
        logger.info(f"--vocab_size {args.vocab_size:,} asked for more pieces than the trainer found in the texts")
    if args.export_to_hub:
        logger.info("Exporting the trained tokenizer to Hub.")
        wrapped.push_to_hub(f"unigram-tokenizer-{os.path.basename(args.dataset_name)}")


if __name__ == "__main__":
    main()
