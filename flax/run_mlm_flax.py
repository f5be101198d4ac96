#!/usr/bin/env python
# Reproduction of Hugging Face's examples/flax/language-modeling/run_mlm_flax.py (Apache-2.0 upstream),
# rewritten for transformers 4.57.6 / jax 0.9.2 / flax 0.12.6, offline by default.
"""Pretrain a masked language model (BERT, RoBERTa, ...) with Flax, data parallel over all devices.

Differences from upstream, all fixes or features named in README.md:
- Durable runs: Orbax checkpoints `checkpoint-{step}` hold the whole train state (parameters, optimizer
  state, step) and the data position, written atomically; `--save_total_limit` keeps the newest N;
  `--resume_from_checkpoint [PATH]` continues a run exactly (bitwise, on the same device count). Data
  order, masks and dropout keys derive from (seed, epoch, example) and (seed, step, device), so a
  resumed run draws what the uninterrupted run drew.
- A non-finite loss or gradient stops training with one line naming the step and the last good
  checkpoint, and never reaches a checkpoint.
- `--gradient_accumulation_steps N`: the update is the token-weighted mean over all N micro-batches
  (sum of per-token losses over the masked tokens of the global batch), as one batch of N times the
  size would give.
- Live throughput at every logging step (tokens/s, seconds per step, TFLOP/s as XLA counts the step,
  MFU with `--peak_tflops`) and the first step's compile time. TensorBoard events under
  `output_dir/runs/<date>_<host>` with the Trainer's tags; `train_results.json`, `eval_results.json` and
  `all_results.json` with the Trainer's keys; `--report_to`, `--log_level`. Tokens are never printed.
- `--dtype bfloat16` computes the dense layers as bf16 products with f32 accumulation on an f32 model
  (upstream's bf16 model is slower than f32 on CPUs); the LM head runs only at the masked positions.
- Evaluation covers every validation example with the same masks at every evaluation, whatever the
  batch size or device count; special tokens written in the text (PTB's `<unk>`) are never targets.
- Multi-host: every process builds the same global batch and feeds its own slice; launch with
  `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, or under SLURM, Open MPI or on a TPU pod
  slice, where `jax.distributed.initialize()` finds the cluster itself.
- Working defaults for `--eval_steps` (every epoch) and `--max_seq_length`; no training loop without
  `--do_train`; linear-time `group_texts`; `--max_steps` and fractional epochs; hub names are only
  contacted when given and fail at once offline.

Example (local files, see README.md):
  python flax/run_mlm_flax.py --output_dir out/mlm --model_type roberta --config_name out/model \
      --tokenizer_name out/tokenizer --train_file data/ptb/train.txt --validation_file data/ptb/validation.txt \
      --max_seq_length 128 --per_device_train_batch_size 16 --learning_rate 1e-3 --warmup_steps 100 \
      --num_train_epochs 1 --do_train --do_eval
"""

import atexit
import codecs
import contextlib
import ctypes
import datetime
import difflib
import fcntl
import functools
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Optional

# This script never uses TensorFlow, but transformers imports it (about 3 s) to test whether a
# tensor is a TF tensor when both are installed. USE_TF=1 in the environment still overrides.
os.environ.setdefault("USE_TF", "0")

import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import datasets
from datasets import load_dataset

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import traverse_util
from flax.training import train_state
from jax import lax
from transformers import (
    CONFIG_MAPPING,
    FLAX_MODEL_FOR_MASKED_LM_MAPPING,
    AutoConfig,
    AutoTokenizer,
    FlaxAutoModelForMaskedLM,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    set_seed,
)

logger = logging.getLogger(__name__)

MODEL_CONFIG_CLASSES = list(FLAX_MODEL_FOR_MASKED_LM_MAPPING.keys())
MODEL_TYPES = tuple(conf.model_type for conf in MODEL_CONFIG_CLASSES)
# These models number positions from pad_token_id + 1, so they fit max_position_embeddings - pad - 1 tokens.
OFFSET_POSITION_MODELS = ("roberta", "roberta-prelayernorm", "xlm-roberta")


# --- arguments -------------------------------------------------------------------------------------------------

@dataclass
class TrainingArguments:
    output_dir: str = field(metadata={"help": "Where the model, checkpoints, logs and results are written."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Write into a non-empty output_dir (a training run then starts afresh)."})
    do_train: bool = field(default=False, metadata={"help": "Whether to run training."})
    do_eval: bool = field(default=False, metadata={"help": "Whether to run eval on the dev set."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Batch size per device for training."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Batch size per device for evaluation."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches accumulated into one update (the global batch is per_device x devices x this)."})
    learning_rate: float = field(default=5e-5, metadata={"help": "The initial learning rate for AdamW."})
    weight_decay: float = field(default=0.0, metadata={"help": "Weight decay for AdamW if we apply some."})
    adam_beta1: float = field(default=0.9, metadata={"help": "Beta1 for AdamW optimizer"})
    adam_beta2: float = field(default=0.999, metadata={"help": "Beta2 for AdamW optimizer"})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "Epsilon for AdamW optimizer."})
    adafactor: bool = field(default=False, metadata={"help": "Whether or not to replace AdamW by Adafactor."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Total number of training epochs (may be fractional)."})
    max_steps: int = field(default=-1, metadata={"help": "If > 0: total number of training steps; overrides num_train_epochs."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warmup over warmup_steps."})
    logging_steps: int = field(default=500, metadata={"help": "Log every X updates steps."})
    save_steps: int = field(default=500, metadata={"help": "Save a checkpoint every X updates steps."})
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "Keep only the newest N checkpoint-* folders."})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={"nargs": "?", "const": "True", "help": "Continue from a checkpoint folder; without a value (or True), the last complete one in output_dir."})
    eval_steps: Optional[int] = field(default=None, metadata={"help": "Run an evaluation every X steps (default: every epoch)."})
    seed: int = field(default=42, metadata={"help": "Random seed that will be set at the beginning of training."})
    report_to: str = field(default="tensorboard", metadata={"help": "tensorboard (events under output_dir/runs) or none."})
    log_level: str = field(default="passive", metadata={"help": "debug, info, warning, error, critical, or passive (info)."})
    peak_tflops: Optional[float] = field(default=None, metadata={"help": "The peak TFLOP/s of one device, to log the model FLOPs utilisation (MFU)."})
    push_to_hub: bool = field(default=False, metadata={"help": "Whether or not to upload the trained model to the model hub after training."})
    hub_model_id: str = field(default=None, metadata={"help": "The name of the repository to keep in sync with the local `output_dir`."})
    hub_token: str = field(default=None, repr=False, metadata={"help": "The token to use to push to the Model Hub."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Use gradient checkpointing to save memory at the expense of slower backward pass."})

    def __post_init__(self):
        if self.output_dir is not None:
            self.output_dir = os.path.expanduser(self.output_dir)


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "The model checkpoint for weights initialization. Don't set if you want to train a model from scratch."})
    model_type: Optional[str] = field(default=None, metadata={"help": "If training from scratch, pass a model type from the list: " + ", ".join(MODEL_TYPES)})
    config_name: Optional[str] = field(default=None, metadata={"help": "Pretrained config name or path if not the same as model_name"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Pretrained tokenizer name or path if not the same as model_name"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Where do you want to store the pretrained models downloaded from s3"})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Whether to use one of the fast tokenizer (backed by the tokenizers library) or not."})
    dtype: Optional[str] = field(default="float32", metadata={"help": "Floating-point format of the computation: float32, float16, or bfloat16 (bf16 products with f32 accumulation on an f32 model)."})
    token: str = field(default=None, repr=False, metadata={"help": "The token to use as HTTP bearer authorization for remote files."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Whether to trust the execution of code from datasets/models defined on the Hub."})


@dataclass
class DataTrainingArguments:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "The name of the dataset to use (via the datasets library)."})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "The configuration name of the dataset to use (via the datasets library)."})
    train_file: Optional[str] = field(default=None, metadata={"help": "The input training data file (a text, csv or json file)."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "An optional input evaluation data file to evaluate the perplexity on (a text file)."})
    train_ref_file: Optional[str] = field(default=None, metadata={"help": "Whole-word-masking reference file (accepted as upstream; not used by this script)."})
    validation_ref_file: Optional[str] = field(default=None, metadata={"help": "Whole-word-masking reference file (accepted as upstream; not used by this script)."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Overwrite the cached training and evaluation sets"})
    validation_split_percentage: Optional[int] = field(default=5, metadata={"help": "The percentage of the train set used as validation set in case there's no validation split"})
    max_seq_length: Optional[int] = field(default=None, metadata={"help": "The maximum total input sequence length after tokenization (default: the tokenizer's, capped by the model's positions)."})
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={"help": "The number of processes to use for the preprocessing."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Ratio of tokens to mask for masked language modeling loss"})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Whether to pad all samples to `max_seq_length`. If False, will pad the samples dynamically when batching to the maximum length in the batch."})
    line_by_line: bool = field(default=False, metadata={"help": "Whether distinct lines of text in the dataset are to be handled as distinct sequences."})


# --- checks ----------------------------------------------------------------------------------------------------

def fail(message):
    """One line on stderr naming what is wrong and what to do, and a non-zero exit."""
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


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
    """A name that is not a local path is a hub id: fail at once if the hub cannot be reached."""
    if name is None or os.path.exists(name):
        return
    if not hub_reachable():
        fail(f"{flag} {name!r} is not a local path and the Hugging Face Hub is unreachable (offline?); "
             "pass local files instead (--train_file/--validation_file for data, a folder for models/tokenizers; "
             "see tokenizers/prepare_corpus.py), or set HF_HUB_OFFLINE=1 to use a copy in the local cache")


def parse_args(argv=None):
    """The three argument groups, from the command line or from one JSON file. A flag that does not exist (a
    typo), a malformed value or a missing file gets one line naming it, not argparse's usage block."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    parser.error = fail
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        if not os.path.isfile(argv[0]):
            fail(f"arguments file {argv[0]} does not exist")
        try:
            return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
        except ValueError as e:  # also malformed JSON
            fail(f"arguments file {argv[0]}: {str(e).splitlines()[0]}")
    *groups, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        flag = next((arg for arg in unknown if arg.startswith("-")), unknown[0]).split("=")[0]
        close = difflib.get_close_matches(flag, [option for action in parser._actions for option in action.option_strings], n=1)
        fail(f"unknown argument {flag}" + (f"; did you mean {close[0]}?" if close else "; see --help"))
    return groups


def setup_logging(training_args):
    level = {"passive": logging.INFO}.get(training_args.log_level, getattr(logging, training_args.log_level.upper(), None))
    if not isinstance(level, int):
        fail(f"--log_level must be one of debug, info, warning, error, critical, passive; got {training_args.log_level!r}")
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=level, datefmt="[%X]", force=True)
    datasets.utils.logging.set_verbosity(max(level, logging.WARNING))
    logging.getLogger("absl").setLevel(max(level, logging.WARNING))  # Orbax logs every file it writes at INFO


def validate_args(model_args, data_args, training_args):
    if data_args.dataset_name is None and data_args.train_file is None and data_args.validation_file is None:
        fail("need --dataset_name or --train_file/--validation_file")
    for flag, path in (("--train_file", data_args.train_file), ("--validation_file", data_args.validation_file)):
        if path is not None:
            check_data_file(flag, path)
    if data_args.train_file and data_args.validation_file:
        extensions = {path.split(".")[-1] for path in (data_args.train_file, data_args.validation_file)}
        if len(extensions) > 1:
            fail(f"--train_file and --validation_file must have the same extension (one loader reads both), got {sorted(extensions)}")
    for flag in ("train_ref_file", "validation_ref_file"):
        if getattr(data_args, flag):
            logger.warning(f"--{flag} is accepted for compatibility with upstream but not used (no whole word masking here)")
    if not 0.0 < data_args.mlm_probability < 1.0:
        fail(f"--mlm_probability must be in (0, 1), got {data_args.mlm_probability}")
    validate_training_args(training_args)
    if model_args.model_type is not None and model_args.model_type not in MODEL_TYPES:
        fail(f"--model_type {model_args.model_type!r} has no Flax masked-LM model; choose one of {', '.join(MODEL_TYPES)}")
    validate_model_args(model_args)
    check_hub_name("--dataset_name", data_args.dataset_name)


def check_data_file(flag, path):
    """A train or validation file: a file (not a folder) of a supported extension, not empty, and UTF-8 text
    (for other bytes the datasets loader says only that generating the dataset failed)."""
    if os.path.isdir(path):
        fail(f"{flag} {path} is a directory; pass a .txt, .csv or .json file")
    extension = path.split(".")[-1]
    if extension not in ("csv", "json", "txt"):
        fail(f"{flag} {path}: unsupported extension .{extension}; use a .txt, .csv or .json file")
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
                fail(f"{flag} {path} is not UTF-8 text (byte 0x{chunk[e.start]:02x} on line {where}); convert it first, "
                     "e.g. with iconv -f latin1 -t utf-8")
            line += chunk.count(newline)
    if empty:
        fail(f"{flag} {path} is empty")


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


def validate_model_args(model_args):
    if model_args.dtype not in ("float32", "float16", "bfloat16"):
        fail(f"--dtype must be one of float32, float16, bfloat16, got {model_args.dtype!r}")
    for flag in ("model_name_or_path", "config_name", "tokenizer_name"):
        check_hub_name(f"--{flag}", getattr(model_args, flag))
    for flag in ("config_name", "model_name_or_path"):
        path = getattr(model_args, flag)
        if path and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            fail(f"--{flag} {path} holds no config.json; write one with tokenizers/create_config.py")


def validate_training_args(training_args):
    if not training_args.do_train and not training_args.do_eval:
        fail("nothing to do: pass --do_train and/or --do_eval")
    for flag in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "logging_steps",
                 "save_steps", "eval_steps", "save_total_limit", "peak_tflops", "learning_rate", "adam_epsilon"):
        value = getattr(training_args, flag)
        if value is not None and value <= 0:
            fail(f"--{flag} must be positive, got {value}")
    for flag in ("weight_decay", "warmup_steps"):
        if getattr(training_args, flag) < 0:
            fail(f"--{flag} must not be negative, got {getattr(training_args, flag)}")
    for flag in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(training_args, flag) < 1.0:
            fail(f"--{flag} must be in [0, 1), got {getattr(training_args, flag)}")
    if training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        fail(f"--num_train_epochs must be positive (or give --max_steps), got {training_args.num_train_epochs}")
    if training_args.report_to not in ("tensorboard", "none", "all"):
        fail(f"--report_to {training_args.report_to!r}: this script logs to tensorboard or none")
    output_dir = training_args.output_dir
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        fail(f"--output_dir {output_dir} exists and is not a directory")
    check_writable("--output_dir", output_dir)
    if training_args.push_to_hub and not hub_reachable():
        fail(f"--push_to_hub: the Hugging Face Hub is unreachable (offline?); drop --push_to_hub and upload {output_dir} later")


def lock_output_dir(output_dir):
    """Hold output_dir/.lock while this process runs, so that a second run into the same folder is refused instead
    of mixing its files with this one's. An flock: the OS releases it however the process ends (kill -9 too),
    so a stale lock never blocks a later run. Returns the open file, to keep for the process's lifetime."""
    if not os.path.isdir(output_dir):  # made here: gone again if the run stops before writing anything into it
        atexit.register(lambda: os.path.isdir(output_dir) and os.listdir(output_dir) == [".lock"] and shutil.rmtree(output_dir))
    os.makedirs(output_dir, exist_ok=True)
    lock = open(os.path.join(output_dir, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        fail(f"another run ({lock.read().strip() or 'unknown'}) is writing into {output_dir}; wait for it to end, or choose another --output_dir")
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started {datetime.datetime.now():%Y-%m-%d %H:%M:%S}\n")
    lock.flush()
    return lock


def init_distributed():
    """Join the other processes of a multi-host run before any JAX computation: from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID when set, else wherever JAX finds the cluster itself (TPU pod
    slices, SLURM, Open MPI). On one host JAX devices are first touched after preprocessing, so datasets'
    worker processes fork before JAX starts threads."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        try:
            jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]), process_id=int(os.environ["JAX_PROCESS_ID"]))
        except (KeyError, ValueError) as e:
            fail(f"JAX_COORDINATOR_ADDRESS is set, so JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers too ({e})")
        return
    try:
        jax.distributed.initialize()
    except ValueError:  # no cluster found: a single process
        pass


# --- data ------------------------------------------------------------------------------------------------------

def load_raw_datasets(model_args, data_args):
    split_pct = data_args.validation_split_percentage
    common = dict(cache_dir=model_args.cache_dir, token=model_args.token)
    if data_args.dataset_name is not None:
        load = lambda **kw: load_dataset(data_args.dataset_name, data_args.dataset_config_name, trust_remote_code=model_args.trust_remote_code, **common, **kw)  # noqa: E731
    else:
        data_files = {}
        if data_args.train_file is not None:
            data_files["train"] = data_args.train_file
        if data_args.validation_file is not None:
            data_files["validation"] = data_args.validation_file
        extension = (data_args.train_file or data_args.validation_file).split(".")[-1]
        extension = "text" if extension == "txt" else extension
        load = lambda **kw: load_dataset(extension, data_files=data_files, **common, **kw)  # noqa: E731
    source = data_args.dataset_name or data_args.train_file or data_args.validation_file
    try:
        raw = load()
        if "validation" not in raw.keys() and "train" in raw.keys():
            if round(len(raw["train"]) * split_pct / 100) == 0:
                fail(f"{source} is too short to split {split_pct} % off for validation (it has {len(raw['train'])} examples); "
                     "give --validation_file, or more text")
            raw["validation"] = load(split=f"train[:{split_pct}%]")
            raw["train"] = load(split=f"train[{split_pct}%:]")
    except Exception as e:  # noqa: BLE001 - a dataset that cannot be read becomes one line
        fail(f"cannot load dataset {source!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return raw


def text_column(raw_datasets, data_args):
    """The column that holds the text: `text`, else (as upstream) the first column, if it holds strings."""
    features = raw_datasets["train" if "train" in raw_datasets else "validation"].features
    columns = list(features)
    if "text" in columns:
        return "text"
    if getattr(features[columns[0]], "dtype", None) in ("string", "large_string"):
        logger.warning(f"no column named 'text': taking the text from the first column, {columns[0]!r}")
        return columns[0]
    source = data_args.dataset_name or data_args.train_file or data_args.validation_file
    fail(f"{source} has no column named 'text' (its columns: {', '.join(columns)}); name the column that holds the text 'text'")


def group_texts(examples, max_seq_length):
    """Concatenate all texts and cut them into blocks of max_seq_length, dropping the remainder
    (a batch shorter than one block is kept whole), exactly as upstream but in linear time."""
    concatenated = {k: list(chain.from_iterable(examples[k])) for k in examples.keys()}
    total_length = len(concatenated[list(examples.keys())[0]])
    if total_length >= max_seq_length:
        total_length = (total_length // max_seq_length) * max_seq_length
    return {k: [t[i : i + max_seq_length] for i in range(0, total_length, max_seq_length)] for k, t in concatenated.items()}


def preprocess(raw_datasets, data_args, tokenizer, max_seq_length):
    """Tokenize; then either one example per non-empty line (--line_by_line) or the texts packed into blocks."""
    column_names = list(raw_datasets["train" if "train" in raw_datasets else "validation"].features)
    text_column_name = text_column(raw_datasets, data_args)
    map_kwargs = dict(num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache)
    if data_args.line_by_line:
        padding = "max_length" if data_args.pad_to_max_length else False

        def tokenize_lines(lines):
            lines = [line for line in lines if len(line) > 0 and not line.isspace()]
            return tokenizer(lines, return_special_tokens_mask=True, padding=padding, truncation=True, max_length=max_seq_length)

        return raw_datasets.map(tokenize_lines, input_columns=[text_column_name], batched=True, remove_columns=column_names,
                                desc="Running tokenizer on dataset line_by_line", **map_kwargs)
    # Every text becomes a sequence with its special tokens; group_texts then packs them into blocks.
    tokenized = raw_datasets.map(lambda texts: tokenizer(texts, return_special_tokens_mask=True), input_columns=[text_column_name],
                                 batched=True, remove_columns=column_names, desc="Running tokenizer on every text in dataset", **map_kwargs)
    return tokenized.map(group_texts, batched=True, fn_kwargs={"max_seq_length": max_seq_length},
                         desc=f"Grouping texts in chunks of {max_seq_length}", **map_kwargs)


@dataclass
class FlaxDataCollatorForLanguageModeling:
    """Masks tokens for MLM: of the tokens that are neither special nor padding, `mlm_probability` are selected;
    of those 80% become the mask token, 10% a random token, 10% stay. Labels are -100 elsewhere."""

    tokenizer: PreTrainedTokenizerBase
    mlm_probability: float = 0.15

    def __post_init__(self):
        if self.tokenizer.mask_token is None:
            raise ValueError("This tokenizer does not have a mask token which is necessary for masked language modeling.")

    def __call__(self, examples, seed, row_ids, row_width, pad_to_multiple_of=16):
        """`examples`: a dict of lists (input_ids, attention_mask, special_tokens_mask, ...). Each row's masks
        are drawn from (*seed, row id) alone, so they are the same whatever batch, device count or
        accumulation step the row falls in. `row_width` bounds every padded row length."""
        # Padding pre-tokenized ids is what pad() is for: silence its advice to call the tokenizer instead.
        self.tokenizer.deprecation_warnings["Asking-to-pad-a-fast-tokenizer"] = True
        batch = self.tokenizer.pad(examples, pad_to_multiple_of=pad_to_multiple_of, return_tensors="np")
        special_tokens_mask = batch.pop("special_tokens_mask", None)
        length = batch["input_ids"].shape[1]
        if length > row_width:
            raise ValueError(f"padded length {length} exceeds row_width {row_width}")
        rows = [np.random.default_rng([*seed, int(i)]) for i in row_ids]
        uniform = np.stack([g.random((3, row_width)) for g in rows], axis=1)[:, :, :length]
        words = np.stack([g.integers(0, self.tokenizer.vocab_size, size=row_width) for g in rows])[:, :length]
        batch["input_ids"], batch["labels"] = self.mask_tokens(
            batch["input_ids"], special_tokens_mask, batch.get("attention_mask"), uniform, words.astype(batch["input_ids"].dtype)
        )
        return dict(batch)

    def mask_tokens(self, input_ids, special_tokens_mask, attention_mask, uniform, random_words):
        """`uniform`: three [0, 1) draws per token (select, replace by mask, replace at random);
        `random_words`: the replacement token ids."""
        inputs, labels = input_ids.copy(), input_ids.copy()
        # Special tokens never become targets: those the tokenizer added (special_tokens_mask), padding
        # (attention_mask 0), and special tokens written in the text itself, such as PTB's literal <unk>.
        maskable = ~np.isin(input_ids, self.tokenizer.all_special_ids)
        if special_tokens_mask is not None:
            maskable &= ~special_tokens_mask.astype(bool)
        if attention_mask is not None:
            maskable &= attention_mask.astype(bool)
        masked_indices = (uniform[0] < self.mlm_probability) & maskable
        labels[~masked_indices] = -100
        indices_replaced = (uniform[1] < 0.8) & masked_indices
        inputs[indices_replaced] = self.tokenizer.mask_token_id
        indices_random = (uniform[2] < 0.5) & masked_indices & ~indices_replaced
        inputs[indices_random] = random_words[indices_random]
        return inputs, labels


def collate_batch(examples, seed, row_ids, num_rows, collator, row_width, mlm_probability):
    """The model's batch for rows `row_ids` of a dataset: masked, extended to `num_rows` with rows that carry
    no label (so every device gets a full batch), with the labels gathered at the masked positions."""
    batch = collator(examples, seed, row_ids, row_width)
    extra = num_rows - len(row_ids)
    if extra:
        fill = {"input_ids": collator.tokenizer.pad_token_id, "labels": -100}
        batch = {k: np.concatenate([v, np.full((extra,) + v.shape[1:], fill.get(k, 0), dtype=v.dtype)]) for k, v in batch.items()}
    return gather_masked(batch, mlm_probability)


def generate_batch_splits(samples_idx, batch_size, drop_last=True):
    num_samples = len(samples_idx)
    if drop_last:
        samples_to_remove = num_samples % batch_size
        if samples_to_remove != 0:
            samples_idx = samples_idx[:-samples_to_remove]
        sections_split = num_samples // batch_size
        return np.split(samples_idx, sections_split) if sections_split else []
    sections_split = math.ceil(num_samples / batch_size)
    return np.array_split(samples_idx, sections_split)


def epoch_batches(num_examples, batch_size, seed, epoch):
    """The example indices of every full batch of an epoch: a permutation drawn from (seed, epoch) alone."""
    return generate_batch_splits(np.random.default_rng([seed, epoch]).permutation(num_examples), batch_size)


# --- model and optimizer ---------------------------------------------------------------------------------------

def load_config_and_tokenizer(model_args):
    hub_kwargs = dict(cache_dir=model_args.cache_dir, token=model_args.token, trust_remote_code=model_args.trust_remote_code)
    try:
        if model_args.config_name:
            config = AutoConfig.from_pretrained(model_args.config_name, **hub_kwargs)
        elif model_args.model_name_or_path:
            config = AutoConfig.from_pretrained(model_args.model_name_or_path, **hub_kwargs)
        elif model_args.model_type:
            config = CONFIG_MAPPING[model_args.model_type]()
            logger.warning("You are instantiating a new config instance from scratch.")
        else:
            fail("need --config_name, --model_name_or_path or --model_type to know which model to train")
        tokenizer_source = model_args.tokenizer_name or model_args.model_name_or_path
        if tokenizer_source is None:
            fail("you are instantiating a new tokenizer from scratch, which this script does not do; "
                 "train one with tokenizers/train_tokenizer.py and pass it with --tokenizer_name")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, use_fast=model_args.use_fast_tokenizer, **hub_kwargs)
    except (OSError, ValueError) as e:
        fail(f"cannot load the config or tokenizer: {str(e).splitlines()[0]}")
    if config.model_type not in MODEL_TYPES:
        fail(f"config model_type {config.model_type!r} has no Flax masked-LM model; choose one of {', '.join(MODEL_TYPES)}")
    if config.vocab_size < len(tokenizer):
        fail(f"the config's vocab_size ({config.vocab_size}) is smaller than the tokenizer's {len(tokenizer)} tokens; "
             "rebuild the config with tokenizers/create_config.py --tokenizer_name ...")
    check_attention_heads(config)
    if tokenizer.mask_token is None:
        fail(f"tokenizer {tokenizer_source!r} has no mask token, which masked language modelling needs")
    return config, tokenizer


def check_attention_heads(config):
    """Each attention head takes an equal slice of the hidden size (T5 sizes its heads by d_kv instead)."""
    for heads in ("num_attention_heads", "decoder_attention_heads"):
        if config.model_type != "t5" and hasattr(config, heads) and config.hidden_size % getattr(config, heads):
            fail(f"the config's hidden size {config.hidden_size} is not divisible by its {getattr(config, heads)} attention heads "
                 f"({heads}); fix the config (tokenizers/create_config.py --config_overrides)")


def resolve_max_seq_length(data_args, config, tokenizer):
    """The tokenizer's limit and the model's positions both bound the sequence length."""
    model_positions = getattr(config, "max_position_embeddings", None)
    if model_positions is not None and config.model_type in OFFSET_POSITION_MODELS:
        model_positions -= (config.pad_token_id or 0) + 1
    if data_args.max_seq_length is None:
        max_seq_length = min(tokenizer.model_max_length, model_positions or tokenizer.model_max_length)
    else:
        if data_args.max_seq_length > tokenizer.model_max_length:
            logger.warning(f"--max_seq_length {data_args.max_seq_length} is larger than the tokenizer's maximum "
                           f"({tokenizer.model_max_length}); using {tokenizer.model_max_length}.")
        max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)
    if model_positions is not None and max_seq_length > model_positions:
        fail(f"--max_seq_length {max_seq_length} is longer than the model's {model_positions} positions")
    if max_seq_length <= 0:
        fail(f"--max_seq_length must be positive, got {max_seq_length}")
    return max_seq_length


@dataclass
class TrainingPlan:
    """Devices, batch sizes and step counts, settled before any long work starts."""

    num_devices: int
    local_devices: int
    process_index: int
    per_device_train_batch_size: int
    per_device_eval_batch_size: int
    gradient_accumulation_steps: int
    num_train_examples: int = 0
    steps_per_epoch: int = 0
    total_steps: int = 0

    @property
    def train_batch_size(self):
        return self.per_device_train_batch_size * self.num_devices * self.gradient_accumulation_steps

    @property
    def eval_batch_size(self):
        return self.per_device_eval_batch_size * self.num_devices

    @property
    def num_epochs(self):
        return math.ceil(self.total_steps / self.steps_per_epoch) if self.steps_per_epoch else 0


def plan_training(training_args, dataset, max_seq_length):
    plan = TrainingPlan(jax.device_count(), jax.local_device_count(), jax.process_index(), training_args.per_device_train_batch_size,
                        training_args.per_device_eval_batch_size, training_args.gradient_accumulation_steps)
    if training_args.do_train:
        plan.num_train_examples = len(dataset["train"])
        plan.steps_per_epoch = plan.num_train_examples // plan.train_batch_size
        if plan.steps_per_epoch == 0:
            fail(f"the train set has {plan.num_train_examples} examples of up to {max_seq_length} tokens, fewer than one "
                 f"global batch of {plan.train_batch_size} ({plan.per_device_train_batch_size} per device x {plan.num_devices} "
                 f"devices x {plan.gradient_accumulation_steps} accumulation steps); use more text or a smaller "
                 "--per_device_train_batch_size/--gradient_accumulation_steps/--max_seq_length")
        if training_args.max_steps > 0:
            plan.total_steps = training_args.max_steps
        else:
            plan.total_steps = int(plan.steps_per_epoch * training_args.num_train_epochs)
        if plan.total_steps <= 0:
            fail(f"no training step to run: --num_train_epochs {training_args.num_train_epochs} x {plan.steps_per_epoch} steps per epoch")
        if training_args.warmup_steps > plan.total_steps:
            peak = training_args.learning_rate * plan.total_steps / training_args.warmup_steps
            logger.warning(f"--warmup_steps {training_args.warmup_steps} is more than the {plan.total_steps} training steps: the learning "
                           f"rate only reaches {peak:.3g}, not --learning_rate {training_args.learning_rate:g}")
    if training_args.do_eval and len(dataset["validation"]) == 0:
        fail("the validation set is empty after tokenization; give a longer --validation_file")
    return plan


def create_learning_rate_fn(num_train_steps, num_warmup_steps, learning_rate):
    """Linear warm-up from 0 to learning_rate, then linear decay to 0 at num_train_steps."""
    warmup_fn = optax.linear_schedule(init_value=0.0, end_value=learning_rate, transition_steps=max(num_warmup_steps, 1))
    decay_fn = optax.linear_schedule(init_value=learning_rate, end_value=0, transition_steps=max(num_train_steps - num_warmup_steps, 1))
    return optax.join_schedules(schedules=[warmup_fn, decay_fn], boundaries=[num_warmup_steps])


def decay_mask_fn(params):
    """True for the weights AdamW decays: every parameter but biases and LayerNorm scales."""
    flat_params = traverse_util.flatten_dict(params)
    layer_norm_candidates = ["layernorm", "layer_norm", "ln"]
    layer_norm_named_params = {
        layer[-2:] for name in layer_norm_candidates for layer in flat_params.keys() if name in "".join(layer).lower()
    }
    flat_mask = {path: (path[-1] != "bias" and path[-2:] not in layer_norm_named_params) for path in flat_params}
    return traverse_util.unflatten_dict(flat_mask)


def build_train_state(model_args, training_args, config, plan, abstract=False):
    """The model and its train state (parameters, optimizer state, step) on the host, with the learning-rate
    schedule. abstract=True gives only the state's shapes, as a target to restore a checkpoint into.
    --dtype bfloat16 builds an f32 model whose dense layers compute in bf16 (see bf16_dense); float16 is
    upstream's model dtype."""
    dtype = jnp.float32 if model_args.dtype == "bfloat16" else getattr(jnp, model_args.dtype)
    # _do_init=False: the model object keeps no copy of the weights beside the train state's (at
    # roberta-base size that copy cost ~0.35 GB of peak memory, measured with benchmarks/run_benchmark.py).
    if model_args.model_name_or_path and not abstract:
        try:
            model, params = FlaxAutoModelForMaskedLM.from_pretrained(
                model_args.model_name_or_path, config=config, seed=training_args.seed, dtype=dtype, _do_init=False,
                cache_dir=model_args.cache_dir, token=model_args.token, trust_remote_code=model_args.trust_remote_code)
        except Exception as e:  # noqa: BLE001 - a missing, truncated or corrupt weights file becomes one line
            fail(f"cannot load the model {model_args.model_name_or_path!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                 "is its weights file complete?")
    else:
        model = FlaxAutoModelForMaskedLM.from_config(config, seed=training_args.seed, dtype=dtype, _do_init=False,
                                                     trust_remote_code=model_args.trust_remote_code)
        init = functools.partial(model.init_weights, model.key, model.input_shape)
        params = jax.eval_shape(init) if abstract else init()
    if training_args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    schedule = create_learning_rate_fn(max(plan.total_steps, 1), training_args.warmup_steps, training_args.learning_rate)
    if training_args.adafactor:
        # Upstream's choice: Adafactor with the same schedule, no decay mask.
        optimizer = optax.adafactor(learning_rate=schedule)
    else:
        optimizer = optax.adamw(learning_rate=schedule, b1=training_args.adam_beta1, b2=training_args.adam_beta2,
                                eps=training_args.adam_epsilon, weight_decay=training_args.weight_decay, mask=decay_mask_fn)
    create = functools.partial(train_state.TrainState.create, apply_fn=model.__call__, tx=optimizer)
    state = jax.eval_shape(create, params=params) if abstract else create(params=params)
    return model, state, schedule


# --- --dtype bfloat16 ------------------------------------------------------------------------------------------
# XLA:CPU computes a bf16 x bf16 -> bf16 product by converting it to f32 (slower than f32 itself), but a
# bf16 x bf16 product with an f32 result runs on a bf16 kernel, several times as fast as f32, on CPUs with bf16
# instructions (AMX-BF16, AVX-512 BF16; see benchmarks/README.md). Upstream's --dtype bfloat16 (the model's dtype)
# gets the slow kind. Here --dtype bfloat16 keeps the model in f32 (parameters, optimizer state,
# activations, softmax, layer norms, loss) and computes every dense layer, forward and backward, from
# bf16-rounded operands into f32 accumulators. A CPU without bf16 instructions (AVX2 only) computes even
# those in f32, so there bf16 only adds conversions: the script warns, and float32 is the faster choice.

def cpu_bf16(cpuinfo="/proc/cpuinfo"):
    """(CPU model, its bf16 support) from the flags in cpuinfo (Linux): "AMX-BF16" or "AVX-512 BF16" (bf16 products in
    hardware); "none, AVX2 only" or the like (bf16 is computed in f32 or emulated: no faster than float32, or slower);
    "unknown" (no cpuinfo: another OS). LM_CPU_BF16=1 or 0 overrides the flags, for tests and for CPUs not listed here."""
    try:
        with open(cpuinfo) as f:
            first_cpu = f.read().split("\n\n")[0]
    except OSError:
        first_cpu = ""
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first_cpu.splitlines())}
    flags = set(fields.get("flags", "").split())
    widest = "AVX-512F" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    support = ("AMX-BF16" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags
               else "unknown" if not flags else f"none, {widest} only" if widest else "none")
    override = os.environ.get("LM_CPU_BF16", "")
    if override not in ("", "0", "1"):
        fail(f"LM_CPU_BF16 must be 1 (this CPU has bf16 instructions) or 0 (it has none), got {override!r}")
    if override:
        support = "native, LM_CPU_BF16=1" if override == "1" else "none, LM_CPU_BF16=0"
    return fields.get("model name", "unknown CPU"), support


def warn_if_bf16_is_slow(flag, value):
    """One warning line when bfloat16 is asked for on a CPU without bf16 instructions; the run goes on as asked."""
    if value != "bfloat16" or jax.default_backend() != "cpu":
        return
    model, support = cpu_bf16()
    if support.startswith("none"):
        logger.warning(f"{flag} bfloat16: this CPU ({model}, bf16: {support}) has no bf16 instructions; XLA computes bf16 "
                       "products in f32 here, so float32 is as fast or faster. Going on as asked.")


def bf16_dot(a, b, contracting):
    return lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (contracting, ((), ())),
                           preferred_element_type=jnp.float32)


@jax.custom_vjp
def bf16_matmul(x, kernel):
    """x [..., in] @ kernel [in, out] (of one dtype) from bf16-rounded operands, accumulated in f32.
    Its two gradient products are bf16 products too (plain autodiff would compute them in f32)."""
    return bf16_dot(x, kernel, ((x.ndim - 1,), (0,)))


def _bf16_matmul_fwd(x, kernel):
    return bf16_matmul(x, kernel), (x.astype(jnp.bfloat16), kernel)


def _bf16_matmul_bwd(residuals, grad):
    x, kernel = residuals
    dx = bf16_dot(grad, kernel, ((grad.ndim - 1,), (1,)))
    # The kernel gradient x^T g sums over tokens, the leading axis of both. XLA:CPU's bf16 kernel (XNNPACK)
    # needs that axis last in its left operand, else XLA computes the product in f32. Where a kernel is used
    # transposed (a tied LM head's embedding.T, GPT-2's Conv1D) XLA swaps the product's operands; so both go
    # in as written-out transposes, where those pay.
    x, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1]).astype(jnp.bfloat16)
    if transposes_pay(x.shape[0], kernel.shape):
        dkernel = bf16_dot(written_out_transpose(x), written_out_transpose(grad), ((1,), (1,)))
    else:
        dkernel = bf16_dot(x, grad, ((0,), (0,)))
    return dx.astype(kernel.dtype), dkernel.astype(kernel.dtype)


def transposes_pay(tokens, kernel_shape):
    """Whether the kernel-gradient product of `tokens` rows is faster from written-out transposes: measured on
    CPU for up to 1,024 tokens and layer widths of 512-4,096 (2-2.7x at 768, benchmarks/README.md). Beyond
    that, XLA:CPU's transposes can cost more than they save; a CPU without bf16 instructions computes the product
    in f32 either way; other backends take transposed operands as they are."""
    return (jax.default_backend() == "cpu" and tokens <= 1024 and all(512 <= n <= 4096 for n in kernel_shape)
            and not cpu_bf16()[1].startswith("none"))


def written_out_transpose(a):
    """a.T of a 2-D bf16 array as a new row-major array. XLA folds a plain transpose, even one behind an
    optimization barrier, into the product that reads it (which then runs in f32 on CPU); one padded and
    sliced back is written out."""
    return jnp.pad(a.T, ((0, 0), (0, 1)))[:, :a.shape[0]]


bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def bf16_dense(next_fun, args, kwargs, context):
    """A flax method interceptor (nn.intercept_methods) that computes every nn.Dense with bf16_matmul:
    transformers' Flax models build their projections and their (tied) LM heads from nn.Dense."""
    module = context.module
    if context.method_name != "__call__" or not isinstance(module, nn.Dense):
        return next_fun(*args, **kwargs)
    kernel = module.get_variable("params", "kernel")
    y = bf16_matmul(jnp.asarray(args[0], kernel.dtype), kernel)
    if module.use_bias:
        y = y + module.get_variable("params", "bias")
    return y if module.dtype is None else y.astype(module.dtype)


# --- memory ----------------------------------------------------------------------------------------------------
# Autodiff keeps the outputs of the activations' transcendental functions for the backward pass (GELU's
# erfc, softmax's exp): at roberta-base, 0.4 GB of the step's peak memory. Recomputing them there costs a
# few elementwise passes: measured no slower, and 0.35 GB (9 %) less peak memory (benchmarks/README.md).
def save_all_but_transcendentals(primitive, *_, **__):
    """A jax.checkpoint policy: keep every intermediate value except those of erf, erfc, exp, tanh, logistic."""
    return primitive.name not in ("erf", "erfc", "exp", "tanh", "logistic")


# XLA's compiler frees its working memory when it is done, but glibc's allocator keeps those pages, and the
# train step's buffers then come on top: ~130 MB of the roberta-base step's peak RSS and ~210 MB (16 %) of
# the main job's (measured, benchmarks/README.md). Handing them back to the OS after every compilation
# costs 15-30 ms per large compile.
@functools.cache  # one listener per process, however often main() runs
def release_compiler_memory():
    """Call glibc's malloc_trim after every XLA compilation (a no-op where the C library is not glibc)."""
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return

    def after_compile(event, _duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            malloc_trim(0)

    jax.monitoring.register_event_duration_secs_listener(after_compile)


# --- the LM head at the masked positions only ------------------------------------------------------------------
# The projection onto the vocabulary is the largest product of the step (30 % of roberta-base's FLOPs at
# 50k tokens), yet only the ~15 % masked positions are scored. As Google's BERT code does with its
# masked_lm_positions, the head runs only at those positions: the loss and gradients are unchanged.

def gather_masked(batch, mlm_probability):
    """Replace `labels` [batch, length] by the labels at the masked positions, `labels` [batch, K] and
    `masked_positions` [batch, K] (unused slots: label -100). K is the batch's largest count of masked
    tokens in a row, rounded up to a multiple of 8 and at least a 4-sigma bound of that count, so that
    almost every batch has the same shape and the step compiles once."""
    labels = batch["labels"]
    length = labels.shape[1]
    bound = length * mlm_probability + 4 * math.sqrt(length * mlm_probability * (1 - mlm_probability))
    k = min(length, -(-max(int((labels != -100).sum(axis=1).max()), math.ceil(bound)) // 8) * 8)
    positions = np.argsort(labels == -100, axis=1, kind="stable")[:, :k]  # masked positions first, in order
    return {**batch, "labels": np.take_along_axis(labels, positions, axis=1), "masked_positions": positions.astype(np.int32)}


def lm_head_at(positions, vocab_size):
    """An interceptor that feeds the dense layer onto the vocabulary only the hidden states at
    `positions` [batch, K], so that the model returns logits [batch, K, vocab]."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, nn.Dense) and module.features == vocab_size:
            args = (jnp.take_along_axis(args[0], positions[..., None], axis=1), *args[1:])
        return next_fun(*args, **kwargs)

    return interceptor


def masked_lm_logits(apply_fn, batch, params, vocab_size, bf16, **kwargs):
    """The model's logits at batch["masked_positions"] only ([batch, K, vocab])."""
    batch = dict(batch)
    positions = batch.pop("masked_positions")
    with contextlib.ExitStack() as stack:
        stack.enter_context(nn.intercept_methods(lm_head_at(positions, vocab_size)))
        if bf16:
            stack.enter_context(nn.intercept_methods(bf16_dense))
        logits = apply_fn(**batch, params=params, **kwargs)[0]
    if logits.shape[1] != positions.shape[1]:  # a head that is not an nn.Dense (DistilBERT, ELECTRA)
        logits = jnp.take_along_axis(logits, positions[..., None], axis=1)
    return logits


# --- steps -----------------------------------------------------------------------------------------------------

SCORED_TOKENS = "masked_tokens"  # what the loss is averaged over, in the results' key names


def mlm_sums(logits, labels):
    """Summed cross-entropy and correct predictions over labelled (masked) positions, and their count."""
    label_mask = labels != -100
    safe_labels = jnp.where(label_mask, labels, 0)
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, safe_labels) * label_mask
    accuracy = (jnp.argmax(logits, axis=-1) == labels) * label_mask
    return loss.sum(), accuracy.sum(), label_mask.sum()


def make_train_step(model, config, schedule, bf16, seed):
    """The train step, compiled once for all local devices. Its batch holds one row of micro-batches per
    device (--gradient_accumulation_steps); the update follows the summed loss over every micro-batch
    of every device, divided by the number of masked tokens in the whole global batch ("the true
    loss"), which is what one batch of that size gives."""
    base_key = jax.random.PRNGKey(seed)

    def loss_fn(params, batch, dropout_rng):
        batch = dict(batch)
        labels = batch.pop("labels")
        logits = masked_lm_logits(model.__call__, batch, params, config.vocab_size, bf16, dropout_rng=dropout_rng, train=True)
        loss, _, count = mlm_sums(logits, labels)
        return loss, count

    grad_fn = jax.value_and_grad(jax.checkpoint(loss_fn, policy=save_all_but_transcendentals), has_aux=True)

    def train_step(state, batch):
        # Dropout keys from (seed, step, device, micro-batch): a resumed run draws what an uninterrupted one drew.
        step_key = jax.random.fold_in(jax.random.fold_in(base_key, state.step), lax.axis_index("batch"))

        def micro_step(totals, micro):
            index, micro_batch = micro
            (loss, count), grad = grad_fn(state.params, micro_batch, jax.random.fold_in(step_key, index))
            return jax.tree_util.tree_map(jnp.add, totals, (loss, count, grad)), None

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jax.tree_util.tree_map(jnp.zeros_like, state.params))
        micro_batches = jax.tree_util.tree_leaves(batch)[0].shape[0]
        (loss, count, grad), _ = lax.scan(micro_step, zeros, (jnp.arange(micro_batches), batch))
        count = jnp.maximum(lax.psum(count, "batch"), 1)
        grad = jax.tree_util.tree_map(lambda g: lax.psum(g, "batch") / count, grad)
        metrics = {"loss": lax.psum(loss, "batch") / count, "learning_rate": schedule(state.step), "grad_norm": optax.global_norm(grad)}
        return state.apply_gradients(grads=grad), metrics

    return jax.pmap(train_step, "batch", donate_argnums=(0,))


def make_eval_step(model, config, bf16):
    def eval_step(params, batch):
        batch = dict(batch)
        labels = batch.pop("labels")
        logits = masked_lm_logits(model.__call__, batch, params, config.vocab_size, bf16, train=False)
        loss, accuracy, count = mlm_sums(logits, labels)
        return lax.psum({"loss": loss, "accuracy": accuracy, "count": count}, "batch")

    return jax.pmap(eval_step, "batch")


# --- loop ------------------------------------------------------------------------------------------------------

def replicate(tree, local_devices):
    """One copy per local device, placed by a pmap so that it carries the train step's own sharding
    (placed otherwise, the step compiles a second time)."""
    return jax.pmap(lambda x: x, "batch")(jax.tree_util.tree_map(lambda x: np.broadcast_to(np.asarray(x), (local_devices, *np.shape(x))), tree))


def unreplicate(tree):
    """The first local replica of a pmapped value, on the host. Unlike flax's `jax_utils.unreplicate`
    (`x[0]`), it also works on multi-host runs, where the other replicas are not addressable here."""
    return jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_shards[0].data)[0], tree)


def device_batch(batch, plan, micro_batches=None):
    """This process's rows of a global batch (every process collates the same one), shaped
    [local devices, (micro-batches,) rows, ...]."""
    groups = (plan.local_devices,) if micro_batches is None else (plan.local_devices, micro_batches)
    rows = len(batch["input_ids"]) // jax.process_count()
    start = plan.process_index * rows
    return {k: v[start : start + rows].reshape(*groups, -1, *v.shape[1:]) for k, v in batch.items()}


@dataclass
class TrainingProgress:
    """Where training stands; saved in every checkpoint, so that a resumed run continues exactly."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # the next batch of `epoch` to train on
    log_window: list = field(default_factory=list)  # losses of the steps since the last log line
    last_checkpoint: Optional[str] = None


def stop_diverged(step, what, progress):
    last = f"the last good checkpoint is {progress.last_checkpoint}" if progress.last_checkpoint else "no checkpoint was written"
    fail(f"step {step}: {what}; training stopped and nothing from this step on was saved; {last}. Lower --learning_rate or "
         "raise --warmup_steps, then resume with --resume_from_checkpoint")


def fetch_metrics(pending, progress):
    """Bring the steps' metrics to the host, in order; stop at the first non-finite loss or gradient, before
    it can reach a checkpoint."""
    fetched = []
    for step, metrics in pending:
        metrics = {k: float(v) for k, v in unreplicate(metrics).items()}
        if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
            stop_diverged(step, f"the training loss is {metrics['loss']} (gradient norm {metrics['grad_norm']})", progress)
        fetched.append(metrics)
    pending.clear()
    progress.log_window.extend(m["loss"] for m in fetched)
    return fetched


class Window:
    """Wall time, steps and tokens since the last log line, with evaluation and checkpointing left out."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.start, self.excluded, self.steps, self.tokens = time.perf_counter(), 0.0, 0, 0

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        yield
        self.excluded += time.perf_counter() - start

    @property
    def seconds(self):
        return time.perf_counter() - self.start - self.excluded


def log_training(progress, metrics, plan, window, flops_per_step, peak_tflops, writer):
    """One line and TensorBoard scalars: the mean loss since the last line, and the throughput of the steps
    timed since then (none when the only one was the first, which compiles)."""
    loss, progress.log_window = float(np.mean(progress.log_window)), []
    scalars = {"loss": loss, "learning_rate": metrics["learning_rate"], "grad_norm": metrics["grad_norm"],
               "epoch": progress.global_step / plan.steps_per_epoch}
    line = (f"Step {progress.global_step}/{plan.total_steps} (epoch {scalars['epoch']:.2f}) | loss {loss:.4f} | lr {metrics['learning_rate']:.3e} "
            f"| grad norm {metrics['grad_norm']:.3f}")
    if window.steps:
        seconds = window.seconds / window.steps
        scalars.update(tokens_per_second=window.tokens / window.seconds, seconds_per_step=seconds)
        line += f" | {scalars['tokens_per_second']:,.0f} tokens/s | {seconds:.3f} s/step"
    if window.steps and flops_per_step:
        scalars["tflops"] = flops_per_step / seconds / 1e12
        line += f" | {scalars['tflops']:.3f} TFLOP/s"
        if peak_tflops:
            scalars["mfu"] = scalars["tflops"] / (peak_tflops * plan.num_devices)
            line += f" | MFU {100 * scalars['mfu']:.1f} %"
    tqdm.write(line)
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(f"train/{name}", value, progress.global_step)
    window.reset()
    return loss


def log_eval(metrics, step, writer):
    logger.info(f"Step {step}: eval loss {metrics['eval_loss']:.4f}, accuracy {metrics['eval_accuracy']:.4f}, "
                f"perplexity {metrics['eval_perplexity']:.2f}")
    if writer is not None:
        for name in ("loss", "accuracy", "perplexity"):
            writer.add_scalar(f"eval/{name}", metrics[f"eval_{name}"], step)


def step_flops(train_step, state, batch):
    """FLOPs of one train step on one device, as XLA counts them (forward, backward and optimizer), or None."""
    try:
        return float(train_step.lower(state, batch).cost_analysis()["flops"])
    except Exception:  # noqa: BLE001 - some backends count nothing; throughput is then logged without FLOPs
        return None


def train(state, train_step, dataset, make_batch, plan, training_args, progress, evaluate_fn, save_fn, writer):
    """Train the replicated `state` from `progress` to plan.total_steps, logging, evaluating and checkpointing on
    the way. Returns the parameters, the Trainer's train metrics and the last evaluation as (step, metrics)."""
    logger.info(f"***** Running training *****\n  Num examples = {plan.num_train_examples}\n  Num epochs = {plan.num_epochs}\n"
                f"  Global batch size = {plan.train_batch_size} ({plan.per_device_train_batch_size} per device x {plan.num_devices} "
                f"devices x {plan.gradient_accumulation_steps} accumulation steps)\n  Total optimization steps = {plan.total_steps}"
                + (f"\n  Resuming at step {progress.global_step} from {progress.last_checkpoint}" if progress.global_step else ""))
    first_step, started, pending, window, losses, tokens, flops, last_eval = progress.global_step, time.perf_counter(), [], Window(), [], 0, None, None
    # A context manager: the bar is closed before an error line, which then stands alone at the end.
    with tqdm(total=plan.total_steps, initial=first_step, desc="Training", disable=plan.process_index != 0, dynamic_ncols=True) as bar:
        for epoch in range(progress.epoch, plan.num_epochs):
            batches = epoch_batches(plan.num_train_examples, plan.train_batch_size, training_args.seed, epoch)
            for index in range(progress.batch_in_epoch, len(batches)):
                if progress.global_step >= plan.total_steps:
                    break
                rows = np.sort(batches[index])
                batch = make_batch(dataset[rows], (training_args.seed, epoch), rows, len(rows))
                window.tokens, window.steps = window.tokens + batch["input_ids"].size, window.steps + 1
                tokens += batch["input_ids"].size
                batch = device_batch(batch, plan, plan.gradient_accumulation_steps)
                if progress.global_step == first_step:
                    flops = step_flops(train_step, state, batch)
                    compile_start = time.perf_counter()
                    state, metrics = train_step(state, batch)
                    jax.block_until_ready(metrics)
                    logger.info(f"First step (compilation included): {time.perf_counter() - compile_start:.1f} s")
                    window.reset()
                else:
                    state, metrics = train_step(state, batch)
                progress.global_step += 1
                progress.epoch, progress.batch_in_epoch = (epoch, index + 1) if index + 1 < len(batches) else (epoch + 1, 0)
                pending.append((progress.global_step, metrics))
                bar.update(1)
                step, last = progress.global_step, progress.global_step == plan.total_steps
                if step % training_args.logging_steps == 0 or last:
                    fetched = fetch_metrics(pending, progress)
                    losses.extend(m["loss"] for m in fetched)
                    log_training(progress, fetched[-1], plan, window, flops and flops * plan.num_devices, training_args.peak_tflops, writer)
                due = step % training_args.eval_steps == 0 if training_args.eval_steps else index == len(batches) - 1 or last
                if evaluate_fn is not None and due:
                    with window.paused():
                        last_eval = (step, evaluate_fn(state.params))
                    log_eval(last_eval[1], step, writer)
                if step % training_args.save_steps == 0 or last:
                    with window.paused():
                        losses.extend(m["loss"] for m in fetch_metrics(pending, progress))
                        progress.last_checkpoint = save_fn(state, progress)
    runtime, steps = time.perf_counter() - started, progress.global_step - first_step
    metrics = {"train_loss": float(np.mean(losses)) if losses else float("nan"), "train_runtime": runtime,
               "train_samples_per_second": steps * plan.train_batch_size / runtime, "train_steps_per_second": steps / runtime,
               "train_tokens_per_second": tokens / runtime, "epoch": progress.global_step / plan.steps_per_epoch,
               "global_step": progress.global_step, "train_samples": plan.num_train_examples, "global_batch_size": plan.train_batch_size,
               "num_devices": plan.num_devices, "total_flos": flops * plan.num_devices * steps if flops else None}
    logger.info(f"Trained {steps} steps in {runtime:.1f} s ({metrics['train_tokens_per_second']:.0f} tokens/s)")
    return state.params, metrics, last_eval


def evaluate(params, eval_step, dataset, make_batch, plan, seed):
    """Loss, accuracy and perplexity over every example of `dataset`, with each example's noise drawn from
    (seed, index): the same at every evaluation, whatever the batch size or device count."""
    started, sums = time.perf_counter(), {"loss": 0.0, "accuracy": 0.0, "count": 0.0}
    batches = generate_batch_splits(np.arange(len(dataset)), plan.eval_batch_size, drop_last=False)
    for rows in tqdm(batches, desc="Evaluating", leave=False, disable=plan.process_index != 0):
        batch = make_batch(dataset[rows], (seed,), rows, plan.eval_batch_size)
        metrics = unreplicate(eval_step(params, device_batch(batch, plan)))
        for k in sums:
            sums[k] += float(metrics[k])
    runtime, count = time.perf_counter() - started, max(sums["count"], 1.0)
    loss = sums["loss"] / count
    return {"eval_loss": loss, "eval_accuracy": sums["accuracy"] / count, "eval_perplexity": math.exp(loss) if loss < 700 else float("inf"),
            f"eval_{SCORED_TOKENS}": int(sums["count"]), "eval_samples": len(dataset), "eval_runtime": runtime,
            "eval_samples_per_second": len(dataset) / runtime, "eval_steps_per_second": len(batches) / runtime}


# --- durability and results ------------------------------------------------------------------------------------

def list_checkpoints(output_dir):
    """(complete, incomplete) checkpoints in output_dir: complete ones as (step, path), oldest first. Orbax writes
    each into a temporary folder renamed when complete; a killed run can leave one behind."""
    complete, incomplete = [], []
    for path in Path(output_dir).glob("checkpoint-*") if os.path.isdir(output_dir) else []:
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and ocp.utils.is_checkpoint_finalized(path) and (path / "trainer_state").is_dir():
            complete.append((int(match.group(1)), str(path)))
        elif not ocp.utils.is_checkpoint_finalized(path):
            incomplete.append(str(path))
    return sorted(complete), incomplete


def find_checkpoint(training_args):
    """The checkpoint to resume from, with the Trainer's conventions, or None; refuses, before any long work,
    to train into an output_dir that holds another run's files."""
    output_dir, resume = training_args.output_dir, training_args.resume_from_checkpoint
    complete, incomplete = list_checkpoints(output_dir)
    for path in incomplete:
        logger.warning(f"skipping {path}: an incomplete checkpoint (a run was stopped while writing it)")
    if resume is not None and resume.lower() != "false":
        if not training_args.do_train:
            fail("--resume_from_checkpoint needs --do_train")
        if resume.lower() != "true":
            if not (os.path.isdir(os.path.join(resume, "trainer_state")) and ocp.utils.is_checkpoint_finalized(resume)):
                fail(f"--resume_from_checkpoint {resume} is not a complete checkpoint-N folder written by this script")
            return resume
        if not complete:
            fail(f"--resume_from_checkpoint: {output_dir} holds no complete checkpoint-N folder; drop the flag to start afresh")
        return complete[-1][1]
    if training_args.overwrite_output_dir or not os.path.isdir(output_dir):
        return None
    if training_args.do_train and set(os.listdir(output_dir)) - {".lock"}:
        if complete:
            fail(f"{output_dir} holds a run's checkpoints up to {complete[-1][1]}: add --resume_from_checkpoint to continue it, "
                 "or --overwrite_output_dir to start afresh")
        fail(f"output directory {output_dir} is not empty; pass --overwrite_output_dir to write into it")
    if os.path.exists(os.path.join(output_dir, "eval_results.json")):
        fail(f"{output_dir} already holds an eval_results.json; pass --overwrite_output_dir to replace it, or choose another --output_dir")
    return None


def clear_checkpoints(output_dir, fresh_start):
    """Remove incomplete checkpoints (they can never be completed) and, for a fresh run into a used output_dir
    (--overwrite_output_dir), the earlier run's checkpoints too, so that no later resume can pick one."""
    complete, incomplete = list_checkpoints(output_dir)
    for path in incomplete + ([path for _, path in complete] if fresh_start else []):
        logger.warning(f"removing {path} (incomplete)" if path in incomplete else f"--overwrite_output_dir: removing {path} of an earlier run")
        shutil.rmtree(path, ignore_errors=True)


def save_pretrained(model, params, tokenizer, output_dir):
    """The model and tokenizer in from_pretrained form, written into output_dir file by file through a
    temporary folder of this run's own, so that a crash mid-save leaves the previous files readable."""
    tmp_dir = tempfile.mkdtemp(prefix=".tmp-save-", dir=output_dir)
    model.save_pretrained(tmp_dir, params=params)
    tokenizer.save_pretrained(tmp_dir)
    for name in os.listdir(tmp_dir):
        os.replace(os.path.join(tmp_dir, name), os.path.join(output_dir, name))
    os.rmdir(tmp_dir)


def checkpoint_handler():
    """A checkpoint-N folder holds two Orbax items: the train state and the training progress (JSON)."""
    return ocp.CompositeCheckpointHandler(state=ocp.StandardCheckpointHandler(), trainer_state=ocp.JsonCheckpointHandler())


def save_checkpoint(state, progress, output_dir, model, tokenizer, save_total_limit, hub, plan, seed):
    """checkpoint-{step}: the train state and the data position as one Orbax checkpoint, written into a temporary
    folder and renamed when complete; then the model in from_pretrained form in output_dir, the oldest
    checkpoints beyond --save_total_limit removed, and the hub repository updated. Returns its path."""
    host_state = unreplicate({"step": state.step, "params": state.params, "opt_state": state.opt_state})
    if not all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(host_state["params"])):
        stop_diverged(progress.global_step, "the parameters are no longer finite", progress)
    path = os.path.join(output_dir, f"checkpoint-{progress.global_step}")
    last = f"the last complete checkpoint, {progress.last_checkpoint}, is intact" if progress.last_checkpoint else "no checkpoint is complete"
    # The checkpoint and the from_pretrained copy of the weights; checked first, because Orbax's writer threads do
    # not stop cleanly on a full disk.
    needed = sum(x.nbytes for x in jax.tree_util.tree_leaves(host_state)) + sum(x.nbytes for x in jax.tree_util.tree_leaves(host_state["params"]))
    free = shutil.disk_usage(output_dir).free
    if free < 1.1 * needed + (1 << 20):
        fail(f"cannot write {path}: it needs about {needed / 2**20:.1f} MB and the disk has {free / 2**20:.1f} MB free; {last}. "
             "Free some space (or use --save_total_limit), then resume with --resume_from_checkpoint")
    trainer_state = {**{k: v for k, v in vars(progress).items() if k != "last_checkpoint"}, "seed": seed,
                     "train_batch_size": plan.train_batch_size, "num_devices": plan.num_devices}
    try:
        with ocp.Checkpointer(checkpoint_handler()) as checkpointer:
            checkpointer.save(os.path.abspath(path), args=ocp.args.Composite(state=ocp.args.StandardSave(host_state),
                                                            trainer_state=ocp.args.JsonSave(trainer_state)), force=True)
        if jax.process_index() == 0:
            save_pretrained(model, host_state["params"], tokenizer, output_dir)
    except (OSError, ValueError) as e:  # a full disk (ENOSPC), a quota, a vanished folder; Orbax wraps some in ValueError
        advice = "Free some space, then resume" if "space" in str(e).lower() else "Fix that, then resume"
        fail(f"cannot write {path}: {str(e).splitlines()[0]}; {last}. {advice} with --resume_from_checkpoint")
    if jax.process_index() == 0:
        for _, old in list_checkpoints(output_dir)[0][: -save_total_limit if save_total_limit else 0]:
            shutil.rmtree(old, ignore_errors=True)
        if hub is not None:
            api, repo_id, token = hub
            api.upload_folder(commit_message=f"Saving weights and logs of step {progress.global_step}", folder_path=output_dir,
                              repo_id=repo_id, repo_type="model", token=token)
    return path


def restore_checkpoint(path, abstract_state, plan, seed):
    """The train state and training progress saved in `path`, checked against this run: the same model shapes,
    global batch and seed (the data order depends on both)."""
    path = os.path.abspath(path)  # Orbax takes absolute paths only
    with ocp.Checkpointer(checkpoint_handler()) as checkpointer:
        stored = dict(jax.tree_util.tree_flatten_with_path(checkpointer.metadata(path).item_metadata["state"]["params"])[0])
        for key, leaf in jax.tree_util.tree_flatten_with_path(abstract_state.params)[0]:
            if key not in stored or tuple(stored[key].shape) != tuple(leaf.shape):
                there = "missing" if key not in stored else tuple(stored[key].shape)
                fail(f"{path} holds a model of another shape: {jax.tree_util.keystr(key)} is {there} there and {tuple(leaf.shape)} "
                     "here; resume with the config that wrote it, or start afresh with --overwrite_output_dir")
        target = {"step": abstract_state.step, "params": abstract_state.params, "opt_state": abstract_state.opt_state}
        try:
            restored = checkpointer.restore(path, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                          trainer_state=ocp.args.JsonRestore()))
        except (ValueError, KeyError) as e:
            fail(f"cannot restore {path} (written with another optimizer?): {str(e).splitlines()[0]}")
    saved = restored["trainer_state"]
    for name, here in (("train_batch_size", plan.train_batch_size), ("seed", seed)):
        if saved[name] != here:
            fail(f"{path} was written with {name} {saved[name]} and this run has {here}; resume with the same seed and global batch "
                 "(--per_device_train_batch_size x devices x --gradient_accumulation_steps)")
    if saved["num_devices"] != plan.num_devices:
        logger.warning(f"{path} was written on {saved['num_devices']} devices and this run has {plan.num_devices}: the same batches "
                       "and updates, but dropout draws differ (they follow the device)")
    progress = TrainingProgress(**{k: saved[k] for k in ("global_step", "epoch", "batch_in_epoch", "log_window")}, last_checkpoint=path)
    return abstract_state.replace(**restored["state"]), progress


def write_json(path, obj):
    """Atomically; non-finite numbers become null (JSON has none)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in obj.items()}
    with open(f"{path}.tmp", "w") as f:
        json.dump(clean, f, indent=4, sort_keys=True)
    os.replace(f"{path}.tmp", path)


def write_results(output_dir, split, metrics):
    """{split}_results.json and the merged all_results.json, as the Trainer's save_metrics writes them."""
    if jax.process_index() != 0:
        return
    write_json(os.path.join(output_dir, f"{split}_results.json"), metrics)
    all_results = os.path.join(output_dir, "all_results.json")
    merged = json.loads(Path(all_results).read_text()) if os.path.exists(all_results) else {}
    write_json(all_results, {**merged, **metrics})


def open_summary_writer(training_args):
    """TensorBoard events in output_dir/runs/<date>_<host>, the Trainer's folder: a rerun never merges its curves
    into an earlier run's."""
    if training_args.report_to == "none" or jax.process_index() != 0:
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        logger.warning("tensorboardX is not installed: no TensorBoard logs (pip install -r requirements.txt)")
        return None
    run_name = f"{datetime.datetime.now():%b%d_%H-%M-%S}_{socket.gethostname()}"
    return SummaryWriter(logdir=os.path.join(training_args.output_dir, "runs", run_name))


def open_hub_repo(training_args):
    """(api, repo id, token) of the repository --push_to_hub uploads to (validate_args checked the hub is reachable)."""
    if not training_args.push_to_hub or jax.process_index() != 0:
        return None
    from huggingface_hub import HfApi

    repo_name = training_args.hub_model_id or Path(training_args.output_dir).absolute().name
    try:
        api = HfApi()
        return api, api.create_repo(repo_name, exist_ok=True, token=training_args.hub_token).repo_id, training_args.hub_token
    except Exception as e:  # noqa: BLE001
        fail(f"--push_to_hub: cannot create the hub repository {repo_name!r}: {str(e).splitlines()[0]}")


# --- main ------------------------------------------------------------------------------------------------------

def main(argv=None):
    model_args, data_args, training_args = parse_args(argv)
    setup_logging(training_args)
    validate_args(model_args, data_args, training_args)
    checkpoint = find_checkpoint(training_args)
    init_distributed()
    release_compiler_memory()
    warn_if_bf16_is_slow("--dtype", model_args.dtype)
    lock = lock_output_dir(training_args.output_dir) if jax.process_index() == 0 else None
    if jax.process_index() != 0:
        datasets.utils.logging.set_verbosity_error()
        logging.getLogger().setLevel(logging.WARNING)
    logger.info(f"Training/evaluation parameters {training_args}")
    set_seed(training_args.seed)

    raw_datasets = load_raw_datasets(model_args, data_args)
    config, tokenizer = load_config_and_tokenizer(model_args)
    max_seq_length = resolve_max_seq_length(data_args, config, tokenizer)
    dataset = preprocess(raw_datasets, data_args, tokenizer, max_seq_length)
    plan = plan_training(training_args, dataset, max_seq_length)  # from here on JAX runs threads: no more forking
    hub = open_hub_repo(training_args)

    model, state, schedule = build_train_state(model_args, training_args, config, plan, abstract=checkpoint is not None)
    progress = TrainingProgress()
    if checkpoint is not None:
        state, progress = restore_checkpoint(checkpoint, state, plan, training_args.seed)
    logger.info(f"Model: {config.model_type}, {sum(x.size for x in jax.tree_util.tree_leaves(state.params)):,} parameters, "
                f"{plan.num_devices} devices ({plan.local_devices} local), sequence length {max_seq_length}")
    bf16 = model_args.dtype == "bfloat16"
    collator = FlaxDataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=data_args.mlm_probability)
    make_batch = functools.partial(collate_batch, collator=collator, row_width=-(-max_seq_length // 16) * 16,
                                   mlm_probability=data_args.mlm_probability)
    evaluate_fn = None
    if training_args.do_eval:
        evaluate_fn = functools.partial(evaluate, eval_step=make_eval_step(model, config, bf16), dataset=dataset["validation"],
                                        make_batch=make_batch, plan=plan, seed=training_args.seed)
    os.makedirs(training_args.output_dir, exist_ok=True)
    writer = open_summary_writer(training_args)
    state = replicate(state, plan.local_devices)  # rebinding `state` frees the host copy

    last_eval = None
    if training_args.do_train:
        if jax.process_index() == 0:
            clear_checkpoints(training_args.output_dir, fresh_start=checkpoint is None)
        save_fn = functools.partial(save_checkpoint, output_dir=training_args.output_dir, model=model, tokenizer=tokenizer,
                                    save_total_limit=training_args.save_total_limit, hub=hub, plan=plan, seed=training_args.seed)
        train_step = make_train_step(model, config, schedule, bf16, training_args.seed)
        with logging_redirect_tqdm():  # log lines above the progress bar, not through it
            params, train_metrics, last_eval = train(state, train_step, dataset["train"], make_batch, plan, training_args, progress,
                                                     evaluate_fn, save_fn, writer)
        write_results(training_args.output_dir, "train", {**train_metrics, "max_seq_length": max_seq_length})
    else:
        params = state.params
    del state

    if training_args.do_eval:
        if last_eval is None or last_eval[0] != progress.global_step:
            last_eval = (progress.global_step, evaluate_fn(params))
            log_eval(last_eval[1], progress.global_step, writer)
        eval_metrics = {**last_eval[1], "epoch": progress.global_step / plan.steps_per_epoch if plan.steps_per_epoch else 0.0}
        write_results(training_args.output_dir, "eval", eval_metrics)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in eval_metrics.items()}))
    if writer is not None:
        writer.close()
    if lock is not None:
        lock.close()


if __name__ == "__main__":
    main()
