#!/usr/bin/env python
"""Fill in the mask token with a model trained by tensorflow/run_mlm.py, as the walkthrough's
`pipeline("fill-mask", framework="tf")` does, and print the top-k tokens with their scores.

  python tensorflow/fill_mask.py --model_dir out/tf-mlm "the company said its [MASK] rose"
"""

import argparse
import json
import os
import sys

# Not USE_TORCH=0: with torch installed, transformers 4.57's pipelines then fail to import
# (NameError: LRScheduler in trainer_pt_utils).
os.environ.setdefault("USE_FLAX", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if os.path.exists("/dev/nvidiactl") else "3")  # as run_mlm.py


WEIGHTS = ("tf_model.h5", "model.safetensors", "pytorch_model.bin")


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.error = fail  # a bad or missing flag: one line, not a usage block
    parser.add_argument(
        "--model_dir", required=True, help="Folder with the model and tokenizer (run_mlm.py's --output_dir)."
    )
    parser.add_argument("--top_k", type=int, default=5, help="How many predictions to print per mask.")
    parser.add_argument("--json", action="store_true", help="Print the predictions as JSON.")
    parser.add_argument("text", nargs="+", help="Text(s) containing the tokenizer's mask token, e.g. [MASK].")
    args = parser.parse_args(argv)
    if args.top_k <= 0:
        fail(f"--top_k must be positive, got {args.top_k}")
    if not os.path.isdir(args.model_dir):
        fail(f"--model_dir {args.model_dir} does not exist (relative paths are read from {os.getcwd()})")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        fail(f"--model_dir {args.model_dir} holds no model (config.json); train one with tensorflow/run_mlm.py")
    weights = [n for n in WEIGHTS if os.path.isfile(os.path.join(args.model_dir, n))]
    if not weights:
        fail(
            f"--model_dir {args.model_dir} holds no TensorFlow or PyTorch weights ({', '.join(WEIGHTS)}); for a Flax "
            "run's output, convert it with flax/export_to_pytorch.py first"
        )
    missing = missing_tokenizer_files(args.model_dir)
    if missing:
        fail(
            f"--model_dir {args.model_dir} holds no complete tokenizer: it lacks {', '.join(missing)}; copy in the "
            "tokenizer the model was trained with (tensorflow/run_mlm.py saves it beside the model)"
        )

    from transformers import AutoTokenizer, TFAutoModelForMaskedLM, pipeline
    from transformers.utils import logging

    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    for text in args.text:
        if tokenizer.mask_token not in text:
            fail(f"{text!r} has no {tokenizer.mask_token}, the mask token of this tokenizer")
    # PyTorch's weights only by from_pt: transformers 4.57 fails on PyTorch's model.safetensors without it
    # (TypeError: 'builtins.safe_open' object is not iterable)
    model = TFAutoModelForMaskedLM.from_pretrained(args.model_dir, from_pt="tf_model.h5" not in weights)
    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer, framework="tf")
    results = []
    for text in args.text:
        predictions = fill(text, top_k=args.top_k)
        # One mask gives a list of predictions; several give a list per mask.
        per_mask = predictions if predictions and isinstance(predictions[0], list) else [predictions]
        results.append(
            {
                "text": text,
                "masks": [
                    [
                        {"token": tokenizer.convert_ids_to_tokens(int(p["token"])), "score": float(p["score"])}
                        for p in mask
                    ]
                    for mask in per_mask
                ],
            }
        )
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for result in results:
        print(result["text"])
        for i, mask in enumerate(result["masks"]):
            for p in mask:
                print(f"  mask {i}: {p['token']!r:>16} {p['score']:.4f}")


if __name__ == "__main__":
    main()
