#!/usr/bin/env python
"""Train the tokenizer of the README from local text files.

  byte_level_bpe  A ByteLevelBPE tokenizer with the special tokens <s> <pad> </s> <unk> <mask>
                  (ids 0..4), as the README trains for RoBERTa and GPT-2. With --model_type roberta
                  (default) a post-processor wraps every sequence in <s> ... </s>; with gpt2 the
                  text is encoded as is (GPT2TokenizerFast), as a causal LM wants.
  unigram         The README's T5 SentencePiece-Unigram tokenizer (flax/t5_tokenizer_model.py):
                  pad=0, eos=1, unk=2, </s> appended. Wrapped as T5TokenizerFast with 100 sentinel
                  tokens <extra_id_0..99> added after the vocabulary, <extra_id_0> last, so the
                  sentinels of span corruption (counting down from len(tokenizer) - 1) are never
                  real words.

The output folder gets tokenizer.json plus tokenizer_config.json / special_tokens_map.json, so
``AutoTokenizer.from_pretrained(output_dir)`` works with no config.json beside it, and the
special tokens its model type uses are set: roberta's mask, pad, bos, eos and unk; gpt2's pad, bos, eos and unk
(<mask> is in its vocabulary, not named); T5's pad, eos and unk.

Example:
  python tokenizers/train_tokenizer.py --tokenizer_type byte_level_bpe \
      --train_file data/ptb/train.txt --vocab_size 8192 --min_frequency 2 --output_dir out/tok
"""

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile

# Only configs and tokenizers: keep transformers from importing PyTorch and TensorFlow (seconds at every start; with
# all three frameworks hidden it warns that models are unavailable).
os.environ.setdefault("USE_TORCH", "0")
os.environ.setdefault("USE_TF", "0")
if importlib.util.find_spec("transformers") is None:  # the system's Python, not .venv's
    sys.exit(
        f"{os.path.basename(__file__)}: error: transformers is not installed for {sys.executable}: "
        "bash run.sh setup, then source .venv/bin/activate"
    )

from tokenizers import ByteLevelBPETokenizer, processors
from transformers import GPT2TokenizerFast, RobertaTokenizerFast, T5TokenizerFast

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


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


def check_text_files(paths):
    """One clear line for a missing, unreadable or empty file; return the number of lines."""
    total = 0
    for path in paths:
        if os.path.isdir(path):
            fail(f"--train_file {path} is a directory; pass a text file")
        if not os.path.exists(path):
            fail(f"--train_file {path} does not exist")
        if not os.path.isfile(path):  # a pipe would be used up by the line count below, a device is no corpus
            fail(f"--train_file {path} is not a regular file; write the text to a file and pass that")
        with open(path, encoding="utf-8") as f:
            try:
                lines = sum(1 for line in f if line.strip())
            except UnicodeDecodeError as e:
                fail(f"--train_file {path} is not UTF-8 text ({e.reason} at byte {e.start})")
        if lines == 0:
            fail(f"--train_file {path} is empty: it has no non-blank line")
        total += lines
    return total


def batch_iterator(paths, batch_size=1000):
    batch = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    batch.append(line.rstrip("\n"))
                    if len(batch) == batch_size:
                        yield batch
                        batch = []
    if batch:
        yield batch


def train_byte_level_bpe(paths, num_lines, vocab_size, min_frequency, model_max_length, model_type):
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        batch_iterator(paths),
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        show_progress=True,
        length=(num_lines + 999) // 1000,
    )
    if model_type == "gpt2":
        return GPT2TokenizerFast(
            tokenizer_object=tokenizer._tokenizer,
            model_max_length=model_max_length,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
        )
    tokenizer.post_processor = processors.RobertaProcessing(
        sep=("</s>", tokenizer.token_to_id("</s>")), cls=("<s>", tokenizer.token_to_id("<s>"))
    )
    return RobertaTokenizerFast(tokenizer_object=tokenizer._tokenizer, model_max_length=model_max_length)


def train_unigram(paths, num_lines, vocab_size, model_max_length, num_sentinels=100):
    # The model lives beside the T5 script; load it by path (the flax/ folder must stay no package).
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flax", "t5_tokenizer_model.py")
    spec = importlib.util.spec_from_file_location("t5_tokenizer_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenizer = module.SentencePieceUnigramTokenizer(unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
    tokenizer.train_from_iterator(
        batch_iterator(paths), vocab_size=vocab_size, show_progress=True, length=(num_lines + 999) // 1000
    )
    sentinels = [f"<extra_id_{i}>" for i in reversed(range(num_sentinels))]
    return T5TokenizerFast(
        tokenizer_object=tokenizer._tokenizer,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=num_sentinels,
        additional_special_tokens=sentinels,
        model_max_length=model_max_length,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = fail  # a bad or missing flag: one line, not a usage block
    parser.add_argument("--tokenizer_type", choices=["byte_level_bpe", "unigram"], default="byte_level_bpe")
    parser.add_argument("--train_file", action="append", required=True, help="text file; repeat for several")
    parser.add_argument("--vocab_size", type=int, default=50265)
    parser.add_argument("--min_frequency", type=int, default=2)
    parser.add_argument(
        "--model_type",
        choices=["roberta", "gpt2"],
        help="byte_level_bpe's model: roberta (default) adds <s> ... </s>, gpt2 adds nothing",
    )
    parser.add_argument(
        "--model_max_length",
        type=int,
        help="longest sequence the model takes (default: roberta 512, gpt2 1024, unigram/T5 512)",
    )
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--overwrite_output_dir", action="store_true")
    args = parser.parse_args(argv)

    if args.tokenizer_type == "byte_level_bpe" and args.vocab_size < len(SPECIAL_TOKENS) + 256:
        fail(
            f"--vocab_size {args.vocab_size} is too small: a byte-level BPE needs at least {len(SPECIAL_TOKENS) + 256}"
        )
    if args.tokenizer_type == "unigram" and args.model_type:
        fail(f"--model_type {args.model_type} is for --tokenizer_type byte_level_bpe; a unigram tokenizer is T5's")
    args.model_type = args.model_type or "roberta"
    if args.tokenizer_type == "unigram" and args.vocab_size < 10:
        fail(f"--vocab_size {args.vocab_size} is too small for a unigram tokenizer")
    if os.path.exists(os.path.join(args.output_dir, "tokenizer.json")) and not args.overwrite_output_dir:
        fail(f"{args.output_dir} already holds a tokenizer.json; pass --overwrite_output_dir to replace it")
    check_writable("--output_dir", args.output_dir)
    num_lines = check_text_files(args.train_file)

    if args.tokenizer_type == "unigram":
        tokenizer = train_unigram(args.train_file, num_lines, args.vocab_size, args.model_max_length or 512)
    else:
        max_length = args.model_max_length or {"roberta": 512, "gpt2": 1024}[args.model_type]
        tokenizer = train_byte_level_bpe(
            args.train_file, num_lines, args.vocab_size, args.min_frequency, max_length, args.model_type
        )
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer.save_pretrained(args.output_dir)
    print(f"Saved a {len(tokenizer):,}-token {args.tokenizer_type} tokenizer to {args.output_dir}")
    sentinels = len(tokenizer.additional_special_tokens) if args.tokenizer_type == "unigram" else 0
    if len(tokenizer) - sentinels < args.vocab_size:
        print(f"note: --vocab_size {args.vocab_size:,} asked for more tokens than the trainer found in --train_file")
    config = os.path.join(args.output_dir, "config.json")
    if os.path.isfile(config):  # a model config beside an earlier tokenizer
        with open(config) as f:
            if json.load(f).get("vocab_size") != len(tokenizer):
                print(f"note: {config} was written for another tokenizer; rebuild it with tokenizers/create_config.py")


if __name__ == "__main__":
    main()
