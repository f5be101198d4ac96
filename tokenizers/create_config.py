#!/usr/bin/env python
"""Write the config.json of a README reference architecture, with no hub access.

The hyper-parameters are the published ones of roberta-base, gpt2 (with the README's resid/embd/
attn dropout 0.0), google/t5-v1_1-base, facebook/bart-base and bert-base-uncased. Only the
architecture is written: no weights, no tokenizer, no generation settings.

  --vocab_size N         the vocabulary size (give the tokenizer's: len(tokenizer))
  --tokenizer_name D     optional: take the vocabulary size and the pad/bos/eos/decoder-start
                         ids from the tokenizer in D, so config and tokenizer agree
  --config_overrides S   "key=value,key=value" applied last, as in upstream's run_mlm.py

Example:
  python tokenizers/create_config.py --model_type roberta --vocab_size 8192 --output_dir out/model \
      --config_overrides "hidden_size=64,num_hidden_layers=2,num_attention_heads=2,intermediate_size=128"
"""

import argparse
import importlib.util
import json
import os
import re
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

from transformers import CONFIG_MAPPING

LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")
# The other counts and widths of the five configs: a model with none of one cannot be built or trained.
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "num_attention_heads",
    "n_positions",
    "n_ctx",
    "n_embd",
    "n_inner",
    "n_head",
    "d_model",
    "d_kv",
    "d_ff",
    "num_heads",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
)
REFERENCE = {
    # roberta-base
    "roberta": dict(
        vocab_size=50265,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=514,
        type_vocab_size=1,
        initializer_range=0.02,
        layer_norm_eps=1e-5,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    ),
    # gpt2 (124M), dropouts 0.0 as in the README's CLM example
    "gpt2": dict(
        vocab_size=50257,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        initializer_range=0.02,
        bos_token_id=50256,
        eos_token_id=50256,
    ),
    # google/t5-v1_1-base
    "t5": dict(
        vocab_size=32128,
        d_model=768,
        d_kv=64,
        d_ff=2048,
        num_layers=12,
        num_decoder_layers=12,
        num_heads=12,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.1,
        layer_norm_epsilon=1e-6,
        initializer_factor=1.0,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    ),
    # facebook/bart-base
    "bart": dict(
        vocab_size=50265,
        d_model=768,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=12,
        decoder_attention_heads=12,
        encoder_ffn_dim=3072,
        decoder_ffn_dim=3072,
        max_position_embeddings=1024,
        activation_function="gelu",
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        init_std=0.02,
        scale_embedding=False,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    ),
    # bert-base-uncased
    "bert": dict(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=512,
        type_vocab_size=2,
        initializer_range=0.02,
        layer_norm_eps=1e-12,
        pad_token_id=0,
    ),
}


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def check_hub_name(flag, name):
    """A name that is not a local path is a hub id: fail at once if the hub cannot be reached (not after the hub
    client's retries), unless HF_HUB_OFFLINE=1 asks for the local cache."""
    import requests
    from huggingface_hub import constants

    if not os.path.exists(name) and not constants.HF_HUB_OFFLINE:
        try:
            requests.head(constants.ENDPOINT, timeout=5.0)
        except requests.RequestException:
            fail(
                f"{flag} {name!r} is not a local path and the Hugging Face Hub is unreachable (offline?); pass a "
                "tokenizer folder (tokenizers/train_tokenizer.py), "
                "or set HF_HUB_OFFLINE=1 to use a copy in the local cache"
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
            "tokenizers/train_tokenizer.py, or pass the folder that holds one"
        )


def token_ids_from_tokenizer(model_type, path):
    from transformers import AutoTokenizer

    check_hub_name("--tokenizer_name", path)
    check_tokenizer_folder("--tokenizer_name", path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any load failure becomes one line
        fail(f"--tokenizer_name {path}: cannot load a tokenizer ({type(e).__name__})")
    ids = {"vocab_size": len(tokenizer)}
    for name in ("pad", "bos", "eos"):
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None:
            ids[f"{name}_token_id"] = token_id
    if model_type == "t5":
        ids["decoder_start_token_id"] = ids.get("pad_token_id", 0)
    if model_type == "bart":
        ids["decoder_start_token_id"] = ids.get("eos_token_id")
    return {k: v for k, v in ids.items() if v is not None}


def build_config(model_type, vocab_size=None, tokenizer_name=None, config_overrides=None):
    values = dict(REFERENCE[model_type])
    if tokenizer_name:
        values.update(token_ids_from_tokenizer(model_type, tokenizer_name))
    tokens = values["vocab_size"] if tokenizer_name else None
    if vocab_size is not None:
        values["vocab_size"] = vocab_size
    config = CONFIG_MAPPING[model_type](**values)
    if config_overrides:
        for item in config_overrides.split(","):
            if item.count("=") != 1 or not item.split("=")[0].strip():
                fail(f"--config_overrides: {item!r} is not key=value (pairs separated by commas, no spaces)")
        try:
            config.update_from_string(config_overrides)
        except (ValueError, TypeError) as e:  # TypeError: a key whose default is None (gpt2's n_inner)
            fail(f"--config_overrides: {e}")
    check_values(config, tokens)
    return config


def check_values(config, tokens):
    """Fail on a value no model can train with: no layers, a size below 1, a dropout outside [0, 1), fewer
    embeddings than tokens."""
    for key, value in config.to_dict().items():
        if key in LAYERS and isinstance(value, int) and value < 1:
            fail(f"{key}={value}: a model needs at least one layer")
        if key in SIZES and isinstance(value, int) and value < 1:
            fail(
                f"--config_overrides {key}={value}: a model's sizes (positions, widths, heads, vocabulary) are at "
                "least 1"
            )
        if re.search(r"dropout|_prob$|pdrop", key) and isinstance(value, (int, float)) and not 0 <= value < 1:
            fail(f"{key}={value}: a dropout probability is at least 0 and below 1")
    if tokens and config.vocab_size < tokens:
        fail(
            f"vocab_size={config.vocab_size} is smaller than the tokenizer's {tokens} tokens: "
            "no embedding for the rest"
        )


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = fail  # a bad or missing flag: one line, not a usage block
    parser.add_argument("--model_type", choices=sorted(REFERENCE), required=True)
    parser.add_argument("--vocab_size", type=int, help="default: the tokenizer's size, else the reference model's")
    parser.add_argument("--tokenizer_name", help="tokenizer folder to take vocab size and special token ids from")
    parser.add_argument("--config_overrides", help='e.g. "hidden_size=64,num_hidden_layers=2"')
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--overwrite_output_dir", action="store_true")
    args = parser.parse_args(argv)

    if args.vocab_size is not None and args.vocab_size <= 0:
        fail(f"--vocab_size must be positive, got {args.vocab_size}")
    if os.path.exists(os.path.join(args.output_dir, "config.json")) and not args.overwrite_output_dir:
        fail(f"{args.output_dir} already holds a config.json; pass --overwrite_output_dir to replace it")
    check_writable("--output_dir", args.output_dir)
    config = build_config(args.model_type, args.vocab_size, args.tokenizer_name, args.config_overrides)
    for heads in ("num_attention_heads", "decoder_attention_heads"):
        if args.model_type != "t5" and hasattr(config, heads) and config.hidden_size % getattr(config, heads):
            fail(
                f"hidden size {config.hidden_size} is not divisible by {getattr(config, heads)} attention heads "
                f"({heads}): each head takes an equal slice; change --config_overrides"
            )
    os.makedirs(args.output_dir, exist_ok=True)
    config.save_pretrained(args.output_dir)
    print(f"Saved a {args.model_type} config (vocab {config.vocab_size:,}) to {args.output_dir}/config.json")


if __name__ == "__main__":
    main()
