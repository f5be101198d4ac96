#!/usr/bin/env python
# Reproduction of Hugging Face's examples/flax/language-modeling/run_clm_flax.py (Apache-2.0 upstream),
# rewritten for transformers 4.57.6 / jax 0.9.2 / flax 0.12.6, offline by default.
"""Pretrain a causal language model (GPT-2, ...) with Flax over all devices.

Example (local files, see README.md):
  python flax/run_clm_flax.py --output_dir out/clm --model_type gpt2 --config_name out/gpt2 \
      --tokenizer_name out/gpt2 --train_file data/ptb/train.txt --validation_file data/ptb/validation.txt \
      --block_size 128 --per_device_train_batch_size 16 --learning_rate 1e-3 --warmup_steps 100 \
      --num_train_epochs 1 --do_train --do_eval

The objective (next-token loss) is one block below; the rest is the same in the four Flax training scripts.
Differs from upstream:
- The loss is the sum over every predicted token of the global batch over their count; padding (the last eval
  batch's) is masked out; next-token accuracy beside loss and perplexity; GPT-2's Conv1D computes in bf16 too.
  Logits larger than 4 GiB are computed a chunk of positions at a time with their gradient, never whole: GPT-2 at
  the original 64 x 512 tokens a device fits a TPU v3 core (14.5 of 16 GiB, by train_compile.py; whole: 21.9 GiB).
- Exact resume: `checkpoint-N` (Orbax) holds the train state and the data position; data order and dropout
  derive from (seed, epoch) and (seed, step). `--save_total_limit`, `--resume_from_checkpoint`.
  A resume on changed data is refused (`--ignore_data_skip` restarts the epoch); a damaged checkpoint is skipped;
  SIGTERM or Ctrl-C saves the current step and exits 143/130; a lost process of a multi-host run: one line, exit 75.
- A non-finite loss or gradient stops training before it reaches a checkpoint; bad input is one line, before work.
- `--gradient_accumulation_steps`; every mean (loss, accuracy) is exact over the global batch and over evaluation.
- `--dtype bfloat16`: bf16 products with f32 accumulation on an f32 model.
- Throughput, TFLOP/s and MFU (`--peak_tflops`) in the log; TensorBoard and results files with the Trainer's keys.
- One `jax.jit` step over a device mesh instead of `pmap`: data parallel, or with `--fsdp full_shard` (or
  `hybrid_shard`: within each process) parameters, gradients and Adam state sharded; checkpoints restore on any mesh.
- Multi-host over `JAX_COORDINATOR_ADDRESS`/`JAX_NUM_PROCESSES`/`JAX_PROCESS_ID`, SLURM, Open MPI or TPU pods.
- `--streaming`: the data read, tokenized and shuffled (windows of `--shuffle_buffer_size`) as training goes, each
  process its own share, on a thread beside the step; resumes exactly too.
- Will it fit? `flax/train_compile.py flax/run_clm_flax.py --topology v3-8 -- FLAGS` compiles its steps for a TPU
  slice or GPUs on this machine, without them: memory a device, FLOPs, XLA's time estimate.
"""

import atexit
import codecs
import collections
import concurrent.futures
import contextlib
import ctypes
import datetime
import difflib
import fcntl
import functools
import hashlib
import importlib.metadata
import inspect
import io
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

# This script never uses TensorFlow or PyTorch, but transformers imports whichever is installed (seconds of every
# start). USE_TF=1 or USE_TORCH=1 in the environment still overrides.
os.environ.setdefault("USE_TF", "0")
os.environ.setdefault("USE_TORCH", "0")
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
    jax = "jax==0.12.0.1 jaxlib==0.12.0.1 flax==0.12.12" if current else "jax==0.9.2 jaxlib==0.9.2 flax==0.12.6"
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


if (
    not sys.stderr.isatty()
):  # a captured log: a progress line every 30 s, not one every 0.1 s joined by carriage returns
    os.environ.setdefault("TQDM_MININTERVAL", "30")

import datasets
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import safetensors.numpy
import transformers
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from etils import epath
from flax import traverse_util
from flax.training import train_state
from jax import lax
from jax._src import xla_bridge  # backends_are_initialized: no public equivalent
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer, HfArgumentParser, set_seed
from transformers.models.gpt2.modeling_flax_gpt2 import FlaxConv1D

logger = logging.getLogger(__name__)

# The file in order: the arguments; the objective block, all that differs between the four Flax training scripts;
# main(), the run as a table of contents; the train state, its steps and the training loop; then the machinery they
# call: arguments and checks, processes and signals, data, model and plan, --dtype bfloat16, devices and the loop's
# bookkeeping, checkpoints and results. All but the block is the same text in the four (tests/test_layout.py).


def arg(default, help, **kwargs):
    """A dataclass field with its --help text, as HfArgumentParser reads it."""
    return field(default=default, metadata={"help": help, **kwargs.pop("metadata", {})}, **kwargs)


# --- arguments ---------------------------------------------------------------------------------------------------
# The three groups of upstream's script; the objective's own data arguments extend DataArguments in the block below.


@dataclass
class TrainingArguments:
    output_dir: str = field(metadata={"help": "Where the model, checkpoints, logs and results are written."})
    overwrite_output_dir: bool = arg(False, "Write into a non-empty output_dir (a training run then starts afresh).")
    do_train: bool = arg(False, "Whether to run training.")
    do_eval: bool = arg(False, "Whether to run eval on the dev set.")
    per_device_train_batch_size: int = arg(8, "Batch size per device for training.")
    per_device_eval_batch_size: int = arg(8, "Batch size per device for evaluation.")
    gradient_accumulation_steps: int = arg(1, "Micro-batches per update (global batch: per device x devices x this).")
    fsdp: str = arg("", "full_shard: params, gradients, Adam state sharded over all devices; hybrid_shard: per host.")
    learning_rate: float = arg(5e-5, "The initial learning rate for AdamW.")
    weight_decay: float = arg(0.0, "Weight decay for AdamW if we apply some.")
    adam_beta1: float = arg(0.9, "Beta1 for AdamW optimizer")
    adam_beta2: float = arg(0.999, "Beta2 for AdamW optimizer")
    adam_epsilon: float = arg(1e-8, "Epsilon for AdamW optimizer.")
    adafactor: bool = arg(False, "Whether or not to replace AdamW by Adafactor.")
    num_train_epochs: float = arg(3.0, "Total number of training epochs (may be fractional).")
    max_steps: int = arg(-1, "If > 0: total number of training steps; overrides num_train_epochs (-1: unset).")
    warmup_steps: int = arg(0, "Linear warmup over warmup_steps.")
    logging_steps: int = arg(500, "Log every X updates steps.")
    save_steps: int = arg(500, "Save a checkpoint every X updates steps.")
    save_total_limit: int | None = arg(None, "Keep only the newest N checkpoint-* folders (and the best one).")
    load_best_model_at_end: bool = arg(False, "Save, as the final model, the best checkpoint's (needs --eval_steps).")
    metric_for_best_model: str | None = arg(None, "With --load_best_model_at_end: an eval_<name> (default: loss).")
    greater_is_better: bool | None = arg(
        None, "Whether a larger --metric_for_best_model is better (default: not a loss)."
    )
    resume_from_checkpoint: str | None = arg(
        None,
        "Checkpoint to continue (with --do_eval alone: to evaluate); alone: the last saved in output_dir.",
        metadata={"nargs": "?", "const": "True"},
    )
    ignore_data_skip: bool = arg(False, "Resume on changed data from the start of the saved epoch, not refuse.")
    eval_steps: int | None = arg(None, "Run an evaluation every X steps (default: every epoch).")
    seed: int = arg(42, "Random seed that will be set at the beginning of training.")
    report_to: str = arg("tensorboard", "tensorboard (events under output_dir/runs; all: the same) or none.")
    log_level: str = arg("passive", "debug, info, warning, error, critical, or passive (info).")
    peak_tflops: float | None = arg(None, "Peak TFLOP/s of one device, to log the MFU.")
    heartbeat_timeout_seconds: int = arg(100, "Multi-host: stop this long after a process is lost (jax's default).")
    push_to_hub: bool = arg(False, "Whether or not to upload the trained model to the model hub after training.")
    hub_model_id: str = arg(None, "The name of the repository to keep in sync with the local `output_dir`.")
    hub_token: str = arg(None, "The token to use to push to the Model Hub.", repr=False)
    gradient_checkpointing: bool = arg(False, "Recompute activations in the backward pass to save memory.")

    def __post_init__(self):
        if self.output_dir is not None:
            self.output_dir = os.path.expanduser(self.output_dir)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = arg(None, "Weights to start from (leave out to train from scratch).")
    model_type: str | None = arg(None, "From scratch: a model type this script trains.")
    config_name: str | None = arg(None, "Pretrained config name or path if not the same as model_name")
    tokenizer_name: str | None = arg(None, "Pretrained tokenizer name or path if not the same as model_name")
    cache_dir: str | None = arg(None, "Where do you want to store the pretrained models downloaded from s3")
    use_fast_tokenizer: bool = arg(True, "Use a fast (Rust) tokenizer.")
    dtype: str | None = arg(
        "float32",
        "float32 or bfloat16 (bf16 products into f32 on an f32 model; float16, without loss scaling, underflows)",
    )
    token: str = arg(None, "The token to use as HTTP bearer authorization for remote files.", repr=False)
    trust_remote_code: bool = arg(False, "Run code from the Hub's datasets/models.")


@dataclass
class DataArguments:
    dataset_name: str | None = arg(None, "The name of the dataset to use (via the datasets library).")
    dataset_config_name: str | None = arg(None, "The configuration of --dataset_name.")
    train_file: str | None = arg(None, "The input training data file (a text, csv or json file).")
    validation_file: str | None = arg(None, "An evaluation data file (text, csv or json).")
    overwrite_cache: bool = arg(False, "Overwrite the cached training and evaluation sets")
    validation_split_percentage: int | None = arg(5, "Percent of train held out without a validation split.")
    preprocessing_num_workers: int | None = arg(None, "The number of processes to use for the preprocessing.")
    max_train_samples: int | None = arg(None, "Use at most this many training rows.")
    max_eval_samples: int | None = arg(None, "Use at most this many evaluation rows (streamed: 1000 by default).")
    streaming: bool = arg(False, "Read, tokenize and shuffle the data as training goes (needs --max_steps).")
    shuffle_buffer_size: int = arg(10000, "With --streaming: rows shuffled together, a window of this many at a time.")


# === the objective: causal language modelling =====================================================================
# Everything that differs between the four Flax training scripts is in this block, under the same names in each;
# the rest of the file is the same text in all four (tests/test_layout.py checks it). To train another objective,
# copy a script and change this block; README.md's block table says what each name gets and returns.
# When the machinery calls the block (README.md's block table has the shapes): once at start, in this order,
# validate_objective (with the argument checks, before any data is read), fit_objective, resolve_max_seq_length,
# preprocess, build_collator and resume_checks, build_model and init_objective_params; collate_batch for each global
# batch of training (this process's rows of all its micro-batches, on a thread ahead of the step, seed (--seed, epoch))
# and each evaluation batch (seed (--seed,)); loss_sums traced into the train step (each micro-batch, the rows of
# every device) and the eval step; save_model at each checkpoint and at the end (process 0, host arrays).
# What the machinery promises a block:
# - loss_sums' (sum, count) pairs are summed over micro-batches, devices, log windows and evaluation before any
#   division; training minimises the LOSS_TERMS-weighted means, each term's gradient over its own count; eval_loss
#   and perplexity are the first term's. A field <term>_weight of DataTrainingArguments (a flag, recorded in
#   checkpoints) sets that term's weight in place of LOSS_TERMS' (loss_weights): no global to rebind.
# - params["model"] is build_model's and params["objective"] init_objective_params': both are trained, sharded
#   (--fsdp), checkpointed and restored; save_model gets params["model"] alone.
# - Resumes are exact on any mesh: collate_batch draws its noise from (*seed, row id), and loss_sums' rng comes
#   from (--seed, step, micro-batch).
# A block may change the names in the table and add its own; of the machinery it calls fail, text_column,
# group_texts, bound_length, pad_rows, init_model, model_logits, model_outputs, objective_apply, capture_head and
# apply_head (the model's output layer, the same handle in the four scripts), token_sums, logger.

MODEL_CLASS = transformers.FlaxAutoModelForCausalLM
MODEL_TYPES = tuple(dict.fromkeys(config.model_type for config in transformers.FLAX_MODEL_FOR_CAUSAL_LM_MAPPING))
OBJECTIVE = "causal-LM"  # in messages
LENGTH_FLAG = "block_size"  # the argument that sets the sequence length
# each loss_sums pair's count, under the name it has in the results (here eval_predicted_tokens)
SCORED_TOKENS = {"loss": "predicted_tokens"}
# the loss trained on: these means of loss_sums, weighted (a <term>_weight argument wins)
LOSS_TERMS = {"loss": 1.0}
MIN_LENGTH = 2  # tokens a block needs: one to read, the next to predict


@dataclass
class DataTrainingArguments(DataArguments):
    block_size: int | None = arg(
        None, "Tokens per block (default: the tokenizer's maximum, within the model's positions)."
    )
    keep_linebreaks: bool = arg(True, "Whether to keep line breaks when using TXT files or not.")


def validate_objective(data_args):
    """Causal language modelling has no arguments of its own to check."""


def fit_objective(config, tokenizer, source):
    """The model decodes: encoder types (BERT, RoBERTa, ...) attend causally only with is_decoder set, else each
    position sees the token it predicts. Any tokenizer will do: the loss shifts the input ids. Runs before the
    vocabulary checks: an objective may add tokens here and raise config.vocab_size (a pretrained model's embeddings
    then grow to match)."""
    config.is_decoder = True


def resolve_max_seq_length(data_args, config, tokenizer):
    """The block size: the tokenizer's limit and the model's positions both bound it (bound_length)."""
    block_size = bound_length(data_args.block_size, config, tokenizer)
    if block_size < MIN_LENGTH:
        fail(f"--block_size must be at least {MIN_LENGTH}, got {block_size}")
    return block_size


def preprocess(raw_datasets, data_args, tokenizer, block_size):
    """Tokenize every text as is (with --keep_linebreaks its newline separates it from the next) and pack the token
    stream into blocks. Upstream also stores labels = input_ids; the loss shifts input_ids itself."""
    column_names = list(raw_datasets["train" if "train" in raw_datasets else "validation"].features)
    text_column_name = text_column(raw_datasets, data_args)
    map_kwargs = dict(num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache)
    tokenized = raw_datasets.map(
        lambda texts: tokenizer(texts),
        input_columns=[text_column_name],
        batched=True,
        remove_columns=column_names,
        desc="Running tokenizer on dataset",
        **map_kwargs,
    )
    return tokenized.map(
        group_texts,
        batched=True,
        fn_kwargs={"block_size": block_size},
        desc=f"Grouping texts in chunks of {block_size}",
        **map_kwargs,
    )


@dataclass
class CausalLMCollator:
    """Causal language modelling draws no noise: the collator only pads (the last eval batch's rows)."""

    pad_token_id: int


def build_collator(data_args, config, tokenizer, block_size, dataset):
    """The collator collate_batch gets. `dataset`: the rows to be trained on and evaluated (an IterableDataset when
    streamed), for an objective that needs them."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return CausalLMCollator(pad)


def resume_checks(collator):
    """What a resume must find unchanged besides the data (JSON values; a hash of large ones): a checkpoint written
    with other values is refused, as one of other data is. Causal language modelling derives nothing from the data."""
    return {}


def collate_batch(collator, examples, seed, row_ids, num_rows, train=True):
    """The model's batch of `num_rows` rows: the blocks, padded (padding and extra rows carry attention 0, so no
    loss). `seed` ((--seed, epoch) in training, a streamed pass being an epoch; (--seed,) in evaluation, train=False)
    and `row_ids` are unused: there is no noise to draw."""
    length = max(len(ids) for ids in examples["input_ids"])
    batch = {"input_ids": np.full((num_rows, length), collator.pad_token_id, dtype=np.int32)}
    batch["attention_mask"] = np.zeros_like(batch["input_ids"])
    for row, ids in enumerate(examples["input_ids"]):
        batch["input_ids"][row, : len(ids)] = ids
        batch["attention_mask"][row, : len(ids)] = 1
    return batch


def build_model(model_args, training_args, config, abstract):
    """The model and its parameters, from --model_name_or_path or new from the config (see init_model)."""
    return init_model(MODEL_CLASS, config, model_args.model_name_or_path, model_args, training_args, abstract)


def init_objective_params(config, rng):
    """Parameters of the objective's own beside the model's (none here): what this returns is params["objective"],
    trained, sharded, checkpointed and restored with params["model"]; save_model never sees it."""
    return {}


def save_model(model, params, output_dir):
    """The model in from_pretrained form; `params` is params["model"]."""
    model.save_pretrained(output_dir, params=params)


def loss_sums(model, params, batch, rng, train, bf16):
    """Named (sum, count) pairs of next-token cross-entropy and correct predictions (shifted_token_sums, shift 1)."""
    head = {}
    interceptors = [capture_head(head, model.config.vocab_size)]
    logits = model_logits(model, params["model"], batch, bf16, interceptors, dropout_rng=rng, train=train)
    head = (
        head if head.get("logits") is logits else {"logits": logits}
    )  # an output layer capture_head misses or adds to
    loss, correct, count = shifted_token_sums(head, batch, bf16, shift=1)
    return {"loss": (loss, count), "accuracy": (correct, count)}


HEAD_CHUNK = 2**26  # logits a device computed at once by head_token_sums: 256 MiB in f32


def shifted_token_sums(head, batch, bf16, shift, scored=None):
    """token_sums of position t predicting token t + shift wherever both are real (not padding) and token t + shift
    is `scored` ([rows, length], 1 where a token counts; default: every real one), from the logits of `head`
    (capture_head's record, or a copy with other inputs and their logits, apply_head's). Logits of more than
    16 * HEAD_CHUNK numbers a device (4 GiB in f32; GPT-2's at 64 x 512 tokens are 6.6 GB) are never whole: where
    the head's input is recorded, the head and the loss go a chunk at a time (head_token_sums)."""
    labels, real, logits = batch["input_ids"][:, shift:], batch["attention_mask"], head["logits"]
    mask = (real if scored is None else scored * real)[:, shift:] * real[:, :-shift]
    devices = max(jax.typeof(logits).sharding.mesh.size, 1)  # the batch's rows are split over all the devices
    if "inputs" in head and logits.size > 16 * HEAD_CHUNK * devices:
        return head_token_sums(head, labels, mask, bf16, devices, shift)
    return token_sums(logits[:, :-shift], labels, mask)


def head_token_sums(head, labels, mask, bf16, devices, shift):
    """token_sums of the head's logits for its inputs but the last `shift` positions, computed again a chunk of
    positions at a time (HEAD_CHUNK logits a device), with the head as the model computes it (apply_head). A chunk's
    gradients are computed with its logits, in the same pass (head_sums' VJP): no chunk is computed twice, and none
    is kept. Those the model computed go unused: XLA drops them."""
    x, (rows, length), vocab = head["inputs"][:, :-shift], labels.shape, head["kernel"].shape[1]
    size = min(length, max(1, HEAD_CHUNK * devices // (rows * vocab)))  # positions a chunk, in every row
    chunks = -(-length // size)

    def split(a):  # [rows, length, ...] -> [chunks, rows, size, ...]: the rows stay split over the devices
        a = jnp.pad(a, [(0, 0), (0, chunks * size - length)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(rows, chunks, size, *a.shape[2:]), 1, 0)

    bias = jnp.broadcast_to(jnp.asarray(head["bias"], head["kernel"].dtype), (vocab,))
    return head_sums(split(x), head["kernel"], bias, split(labels), split(mask), bf16, head["dtype"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def head_sums(x, kernel, bias, labels, mask, bf16, dtype):
    """(loss, correct, count) over chunks of x [chunks, rows, size, width], a loop over the chunks."""
    return head_sums_fwd(x, kernel, bias, labels, mask, bf16, dtype, grads=False)[0]


def head_sums_fwd(x, kernel, bias, labels, mask, bf16, dtype, grads=True):
    """head_sums' sums and, with grads, the gradient of the loss sum for x, kernel and bias, chunk by chunk."""

    def chunk(totals, xs):
        x, labels, mask = xs
        logits = apply_head(dict(kernel=kernel, bias=bias, dtype=dtype), x, bf16)
        sums = token_sums(logits, labels, mask)
        if not grads:
            return jax.tree.map(jnp.add, totals, sums), None
        # d loss / d logits: softmax less the label's one-hot, where the mask is set
        dlogits = jax.nn.softmax(logits.astype(jnp.float32)) - jax.nn.one_hot(
            jnp.where(mask, labels, 0), logits.shape[-1]
        )
        dlogits = (dlogits * mask[..., None]).astype(logits.dtype).astype(kernel.dtype)
        if bf16:
            dx, dkernel = _bf16_matmul_bwd((x.astype(jnp.bfloat16), kernel), dlogits)
        else:
            dx, dkernel = dlogits @ kernel.T, jnp.einsum("rsi,rso->io", x, dlogits)
        grads_sum = (dkernel, dlogits.sum((0, 1)))
        return jax.tree.map(jnp.add, totals, (sums, grads_sum)), dx.astype(x.dtype)

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), mask.dtype))
    if not grads:
        return lax.scan(chunk, zeros, (x, labels, mask))[0], None
    start = (zeros, (jnp.zeros_like(kernel), jnp.zeros_like(bias)))
    (sums, (dkernel, dbias)), dx = lax.scan(chunk, start, (x, labels, mask))
    return sums, (dx, dkernel, dbias)


def head_sums_bwd(bf16, dtype, residuals, cotangents):
    dx, dkernel, dbias = residuals
    scale = cotangents[0]  # the loss sum's: correct predictions and counts have no gradient
    return scale * dx, scale * dkernel, scale * dbias, None, None


head_sums.defvjp(head_sums_fwd, head_sums_bwd)


# === end of the objective ==========================================================================================


# --- main: the run in order ------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(argv)
    setup_logging(training_args.log_level)
    validate_args(model_args, data_args, training_args)
    checkpoints = find_checkpoint(training_args, model_args)
    lock = start_process(model_args, training_args)

    raw_datasets = load_raw_datasets(model_args, data_args)
    config, tokenizer = load_config_and_tokenizer(model_args, training_args.gradient_checkpointing)
    max_seq_length = resolve_max_seq_length(data_args, config, tokenizer)
    fit_attention(config, max_seq_length)
    dataset = select_samples(preprocess(raw_datasets, data_args, tokenizer, max_seq_length), data_args)
    plan = plan_training(training_args, dataset, max_seq_length)  # from here on JAX runs threads: no more forking
    collator = build_collator(data_args, config, tokenizer, max_seq_length, dataset)

    hub = open_hub_repo(training_args)
    model, state, schedule = build_train_state(model_args, training_args, config, plan, abstract=bool(checkpoints))
    bf16 = model_args.dtype == "bfloat16"
    eval_step = make_eval_step(model, bf16, training_args.seed) if training_args.do_eval else None
    data = data_fingerprint(data_args, tokenizer, dataset, max_seq_length, plan, training_args.seed, collator)
    run = Run(
        training_args, plan, model, tokenizer, collator, dataset, hub, eval_step, objective_settings(data_args), data
    )
    run.weights = loss_weights(data_args)
    state, progress = restore_checkpoint(checkpoints, state, run) if checkpoints else (state, TrainingProgress())
    log_model(config, state, plan, max_seq_length)
    run.writer = open_summary_writer(training_args)

    last_eval = None
    if training_args.do_train:
        run.checkpoints = open_checkpoints(run, state, progress, fresh_start=not checkpoints)
        train_step = make_train_step(model, schedule, bf16, training_args.seed, state, run.weights)
        with logging_redirect_tqdm():  # log lines above the progress bar, not through it
            state, train_metrics, last_eval = train(state, train_step, run, progress)
        write_results(training_args.output_dir, "train", {**train_metrics, LENGTH_FLAG: max_seq_length})
        run.checkpoints.close()
        if training_args.load_best_model_at_end:
            state, last_eval = load_best_model(state, run, progress, last_eval)
    params = state.params
    del state  # evaluation needs no optimizer state
    if training_args.do_eval:
        evaluate_and_write_results(params, run, progress, last_eval)
    for resource in (run.writer, lock):
        if resource is not None:
            resource.close()


# --- the train state, its steps, the training and evaluation loop ----------------------------------------------------


def build_train_state(model_args, args, config, plan, abstract=False):
    """The model (build_model), its train state placed on plan.mesh as state_shardings says, and the learning-rate
    schedule; abstract=True gives only the state's shapes and shardings, a target to restore a checkpoint into. The
    parameters are {"model": the model's (build_model), "objective": the block's own (init_objective_params)}."""
    model, model_params = build_model(model_args, args, config, abstract)
    params = {"model": model_params, "objective": objective_params(config, args.seed, abstract)}
    schedule = create_learning_rate_fn(max(plan.total_steps, 1), args.warmup_steps, args.learning_rate)
    if args.adafactor:  # upstream's choice: the same schedule, no decay mask
        optimizer = optax.adafactor(learning_rate=schedule)
    else:
        adam = (args.adam_beta1, args.adam_beta2, args.adam_epsilon)
        optimizer = optax.adamw(schedule, *adam, weight_decay=args.weight_decay, mask=decay_mask_fn)

    def create(params):  # the step a strong int32, as restored: a resumed run compiles the fresh run's step program
        return train_state.TrainState.create(apply_fn=None, params=params, tx=optimizer).replace(step=jnp.int32(0))

    shapes = jax.eval_shape(create, params=params)
    shardings = state_shardings(shapes, plan.mesh, args.fsdp)
    if abstract:
        shapes = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
        return model, shapes, schedule
    # New or loaded, the parameters are on the host: placed shard by shard, no device holding more than its share.
    place = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: np.asarray(x[index]))  # noqa: E731
    params = jax.tree.map(place, params, shardings.params)
    return model, jax.jit(create, out_shardings=shardings)(params=params), schedule


def make_train_step(model, schedule, bf16, seed, state, weights=None):
    """The train step, one jit over plan.mesh that keeps `state`'s shardings; its batch holds micro-batches of rows
    sharded over every device. loss_sums' sums and counts are added over every micro-batch before any division, so
    every mean is exact over the global batch, and each loss term's gradient is divided by its own count and weighted
    (`weights`, loss_weights'; LOSS_TERMS' by default): one batch of that size would give the same update. In a
    multi-process run it also takes every process's vote (ProcessAgreement) and returns their largest, replicated."""
    base_key, shardings = jax.random.PRNGKey(seed), jax.tree.map(lambda x: x.sharding, state)
    weights = weights or LOSS_TERMS
    replicated = NamedSharding(jax.tree.leaves(shardings)[0].mesh, PartitionSpec())

    def loss_fn(params, batch, dropout_rng):
        sums = loss_sums(model, params, batch, dropout_rng, train=True, bf16=bf16)
        return {name: sums[name][0] for name in weights}, sums

    if next(iter(jax.tree.leaves(state)[0].sharding.device_set)).platform == "cpu":  # measured there; else as upstream
        loss_fn = jax.checkpoint(loss_fn, policy=save_all_but_transcendentals)

    def grads_fn(params, batch, rng):
        """loss_sums' sums, and the gradient of each loss term's sum (one forward pass, one backward pass a term)."""
        params = as_sharded(params, shardings.params, whole=True)  # --fsdp: gathered for both passes
        terms, vjp_fn, sums = jax.vjp(lambda p: loss_fn(p, batch, rng), params, has_aux=True)
        basis = {name: {other: jnp.ones_like(v) * (other == name) for other, v in terms.items()} for name in terms}
        return sums, {name: as_sharded(vjp_fn(cotangent)[0], shardings.params) for name, cotangent in basis.items()}

    def train_step(state, batch, votes=None):
        # Dropout keys from (seed, step, micro-batch), drawn for the global batch whatever the device count: a resumed
        # run draws what an uninterrupted one drew, on any mesh.
        step_key = jax.random.fold_in(base_key, state.step)

        def micro_step(totals, micro):
            index, micro_batch = micro
            return jax.tree_util.tree_map(
                jnp.add, totals, grads_fn(state.params, micro_batch, jax.random.fold_in(step_key, index))
            ), None

        first = jax.tree_util.tree_map(lambda x: x[0], batch)
        zeros = jax.tree_util.tree_map(
            lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(grads_fn, state.params, first, step_key)
        )
        micro_batches = jax.tree_util.tree_leaves(batch)[0].shape[0]
        (sums, grads), _ = lax.scan(micro_step, zeros, (jnp.arange(micro_batches), batch))
        scaled = [
            jax.tree_util.tree_map(lambda g, w=weight, n=sums[name][1]: w * g / jnp.maximum(n, 1), grads[name])
            for name, weight in weights.items()
        ]
        grad = functools.reduce(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b), scaled)
        metrics = dict(sums=sums, learning_rate=schedule(state.step), grad_norm=optax.tree.norm(grad))
        if votes is not None:
            metrics["agreed"] = lax.with_sharding_constraint(jnp.max(votes, axis=0), replicated)
        return state.apply_gradients(grads=grad), metrics

    return jax.jit(train_step, out_shardings=(shardings, None), donate_argnums=(0,))


def make_eval_step(model, bf16, seed):
    """loss_sums' sums and counts of a batch sharded over every device; the rng follows (seed, batch index), so an
    objective that samples evaluates the same way every time."""

    def eval_step(params, batch, index):
        rng = jax.random.fold_in(jax.random.PRNGKey(seed), index)
        return loss_sums(model, params, batch, rng, train=False, bf16=bf16)

    return jax.jit(eval_step)


@dataclass
class Run:
    """What training and evaluation need besides the train state, set up once by main()."""

    args: TrainingArguments
    plan: Any  # TrainingPlan
    model: Any  # build_model's: a model, or several (the block says)
    tokenizer: transformers.PreTrainedTokenizerBase
    collator: Any  # build_collator's, handed to collate_batch
    dataset: dict  # "train" and "validation": datasets.Dataset, or IterableDataset when streamed
    hub: tuple | None  # (HfApi, repo id, token) with --push_to_hub
    eval_step: Any  # make_eval_step's jitted step; None without --do_eval
    objective: dict  # the objective's own arguments, recorded in checkpoints
    data: dict  # what the data position depends on (data_fingerprint), recorded in checkpoints
    weights: dict | None = None  # loss_weights': the loss terms' weights, from the objective's arguments
    writer: Any = None  # tensorboardX's SummaryWriter; None with --report_to none
    checkpoints: ocp.CheckpointManager | None = None  # while training


def log_model(config, state, plan, max_seq_length):
    """One line: the model, its parameters, the devices and the train state's bytes on each (--fsdp divides them)."""
    leaves = jax.tree_util.tree_leaves(state)
    total = sum(x.size * x.dtype.itemsize for x in leaves) / 2**20
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves) / 2**20
    sizes = {part: sum(x.size for x in jax.tree_util.tree_leaves(tree)) for part, tree in state.params.items()}
    own = f" (and {sizes['objective']:,} of the objective's own)" if sizes["objective"] else ""
    logger.info(
        f"Model: {config.model_type}, {sizes['model']:,} parameters{own}, "
        f"{plan.num_devices} devices ({plan.local_devices} local), train state {per_device:.1f} MB per device "
        f"({total:.1f} MB in all), --{LENGTH_FLAG} {max_seq_length}"
    )


def train(state, train_step, run, progress):
    """Train `state` from `progress` to plan.total_steps, logging, evaluating and saving as due
    (after_step). Returns the state, the Trainer's train metrics and the last evaluation as (step, metrics)."""
    plan, args = run.plan, run.args
    loop = Loop(first_step=progress.global_step)
    bar = tqdm(total=plan.total_steps, initial=loop.first_step, desc="Training", disable=plan.process_index != 0)
    PROCESS.training = True
    PROCESS.progress = progress
    agreement = ProcessAgreement(local_batches(run, progress), run.tokenizer.pad_token_id, plan)
    with bar:  # closed before an error line
        for batch, position, end_of_epoch, votes in agreement:
            batch = global_batch(batch, plan, args.gradient_accumulation_steps)
            state, metrics = timed_step(train_step, state, batch, loop, votes)
            agreement.read(metrics)
            progress.global_step += 1
            progress.epoch, progress.batch_in_epoch, progress.stream = position
            loop.pending.append((progress.global_step, metrics))
            bar.update(1)
            logged = after_step(state, run, progress, loop, end_of_epoch, agreement)
            if logged:
                bar.set_postfix({name: f"{value:.4g}" for name, value in logged.items()})
            if progress.global_step >= plan.total_steps:
                break
    PROCESS.training = False
    return state, train_summary(plan, progress, loop), loop.last_eval


def after_step(state, run, progress, loop, end_of_epoch, agreement):
    """A log line every --logging_steps, an evaluation every --eval_steps (default: each epoch) and a checkpoint
    every --save_steps, each also after the last step, and after a step that `agreement` says to stop after.
    Returns the logged means, if any."""
    args, step, logged = run.args, progress.global_step, None
    last = step == run.plan.total_steps
    if step % args.logging_steps == 0 or last:
        logged = log_training(progress, fetch_metrics(loop, progress), run, loop)
    if run.eval_step is not None and (step % args.eval_steps == 0 if args.eval_steps else end_of_epoch or last):
        with loop.paused():
            loop.last_eval = (step, evaluate(state.params, run, step))
    stop = agreement.stop()
    if step % args.save_steps == 0 or last or stop:
        with loop.paused():
            fetch_metrics(loop, progress)
            progress.last_checkpoint = save_checkpoint(state, progress, run, loop.last_eval)
    if stop:
        where = f"stopped at step {step} on {signal.Signals(stop).name}; {progress.last_checkpoint} saved"
        tqdm.write(f"{where}; rerun with --resume_from_checkpoint", file=sys.stderr)
        raise SystemExit(128 + stop)
    return logged


def load_best_model(state, run, progress, last_eval):
    """--load_best_model_at_end: the best checkpoint's parameters in place of the last step's, its model output_dir's;
    returns the state and the evaluation of its parameters, under the best checkpoint's step in the log."""
    best, (metric, _) = progress.best_model_checkpoint, best_metric(run.args)
    if best is None:
        logger.warning("--load_best_model_at_end: no checkpoint was evaluated; the last step's model stays")
        return state, last_eval
    logger.info(f"The best checkpoint: {best} ({metric} {progress.best_metric:.6g}); its model is output_dir's")
    if os.path.abspath(best) == os.path.abspath(progress.last_checkpoint):
        return state, last_eval
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params)
    try:
        arrays, _ = read_checkpoint(best, {"params": abstract})
    except ValueError as e:
        fail(f"--load_best_model_at_end: {best} is damaged ({e}); output_dir keeps the last step's model")
    export_model(stage_model(arrays["params"]["model"], run), run)
    step = int(Path(best).name.split("-")[1])
    return state.replace(params=arrays["params"]), (progress.global_step, evaluate(arrays["params"], run, step))


def evaluate_and_write_results(params, run, progress, last_eval):
    """eval_results.json from the evaluation at the last step, run now if training did not end with one."""
    if last_eval is None or last_eval[0] != progress.global_step:
        last_eval = (progress.global_step, evaluate(params, run, progress.global_step))
    epoch = progress.global_step / run.plan.steps_per_epoch if run.plan.steps_per_epoch else 0.0
    eval_metrics = {**last_eval[1], "epoch": epoch}
    # An evaluation of another model (--overwrite_output_dir) replaces all_results.json instead of joining it.
    merge = run.args.do_train or not run.args.overwrite_output_dir
    write_results(run.args.output_dir, "eval", eval_metrics, merge)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in eval_metrics.items()}))


def evaluate(params, run, step):
    """Every named mean of loss_sums over the whole validation set, and the perplexity, logged as of `step`; each
    example's noise comes from (seed, index), so every evaluation scores the same tokens, whatever the batch size or
    device count."""
    plan, dataset, started, totals = run.plan, run.dataset["validation"], time.perf_counter(), {}
    batches = generate_batch_splits(np.arange(len(dataset)), plan.eval_batch_size, drop_last=False)
    for index, rows in enumerate(tqdm(batches, desc="Evaluating", leave=False, disable=plan.process_index != 0)):
        batch = collate_batch(run.collator, dataset[rows], (run.args.seed,), rows, plan.eval_batch_size, train=False)
        sums = run.eval_step(params, global_batch(batch, plan), np.int32(index))
        for name, (total, count) in sums.items():
            previous = totals.get(name, (0.0, 0.0))
            totals[name] = (previous[0] + float(total), previous[1] + float(count))
    means = objective_means(totals, run.weights)
    means["perplexity"] = math.exp(means["loss"]) if means["loss"] < 700 else float("inf")
    logger.info(f"Step {step}: " + ", ".join(f"eval {name} {value:.4f}" for name, value in means.items()))
    for name, value in means.items() if run.writer is not None else ():
        run.writer.add_scalar(f"eval/{name}", value, step)
    runtime = time.perf_counter() - started
    return {
        **{f"eval_{name}": value for name, value in means.items()},
        **{f"eval_{key}": int(totals[name][1]) for name, key in SCORED_TOKENS.items()},
        "eval_samples": len(dataset),
        "eval_runtime": runtime,
        "eval_samples_per_second": len(dataset) / runtime,
        "eval_steps_per_second": len(batches) / runtime,
    }


# === the machinery main() and the loop call ==========================================================================
# --- arguments and checks ----------------------------------------------------------------------------------------


def fail(message):
    """One line on stderr naming what is wrong and what to do, and a non-zero exit."""
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def first_line(error):
    return str(error).splitlines()[0] if str(error) else ""


def fail_not_utf8(source, where, then="and resume"):
    fail(f"{source} is not UTF-8 text ({where}); convert it (e.g. iconv -f latin1 -t utf-8) {then}")


def hub_reachable(timeout=5.0):
    """Whether the Hugging Face Hub answers; None (not asked) with HF_HUB_OFFLINE=1, which asks for the local cache."""
    import requests
    from huggingface_hub import constants

    try:
        return None if constants.HF_HUB_OFFLINE else requests.head(constants.ENDPOINT, timeout=timeout) is not None
    except requests.RequestException:
        return False


def parse_args(argv=None):
    """The argument groups from the command line or a JSON file, checked (RANGES, CHOICES); bad input: one line."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    parser.error = fail
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        if not os.path.isfile(argv[0]):
            fail(f"arguments file {argv[0]} does not exist")
        try:
            groups = parser.parse_json_file(json_file=os.path.abspath(argv[0]))
        except ValueError as e:  # also malformed JSON
            fail(f"arguments file {argv[0]}: {first_line(e)}")
    else:
        *groups, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        if unknown:
            flag = next((arg for arg in unknown if arg.startswith("-")), unknown[0]).split("=")[0]
            options = [option.lstrip("-") for action in parser._actions for option in action.option_strings]
            close = difflib.get_close_matches(flag.lstrip("-"), options, n=1)  # without "--", --lr is not near --help
            fail(f"unknown argument {flag}" + (f"; did you mean --{close[0]}?" if close else "; see --help"))
    values = {name: value for group in groups for name, value in vars(group).items()}
    for test, what, names in RANGES:
        for name in names.split():
            if values[name] is not None and not test(values[name]):
                fail(f"--{name} must be {what}, got {values[name]}")
    for name, words in CHOICES.items():
        if values[name] not in words:
            fail(f"--{name} must be one of {', '.join(map(repr, words))}, got {values[name]!r}")
    return groups


# What each numeric argument must be, and the words an argument takes: checked before any work.
POSITIVE = (
    "per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps logging_steps save_steps\n"
    "eval_steps save_total_limit peak_tflops learning_rate adam_epsilon max_train_samples max_eval_samples "
    "shuffle_buffer_size"
)
RANGES = (
    (lambda value: value > 0, "positive", POSITIVE),
    (lambda value: value >= 0, "non-negative", "weight_decay warmup_steps"),
    (lambda value: 0 <= value < 1, "in [0, 1)", "adam_beta1 adam_beta2"),
)
CHOICES = {
    "dtype": ("float32", "bfloat16"),
    "report_to": ("tensorboard", "none", "all"),
    "log_level": ("debug", "info", "warning", "error", "critical", "passive"),
    "fsdp": ("", "full_shard", "hybrid_shard"),
}
# Flags that do nothing with --streaming, without it, without --do_eval, and upstream's that do nothing here.
IN_MEMORY_ONLY = ("--preprocessing_num_workers", "--overwrite_cache", "--validation_split_percentage")
STREAM_ONLY = ("--shuffle_buffer_size",)
EVAL_ONLY = ("--eval_steps", "--per_device_eval_batch_size", "--max_eval_samples")
UPSTREAM_ONLY = ("--train_ref_file", "--validation_ref_file")
BEST_ONLY = ("--metric_for_best_model", "--greater_is_better")
WEIGHTS = ("flax_model.msgpack", "pytorch_model.bin", "model.safetensors")  # each whole, or sharded with an index


def setup_logging(log_level):
    level = logging.INFO if log_level == "passive" else getattr(logging, log_level.upper())
    form = "%(asctime)s - %(levelname)s - %(name)s - %(message)s"
    logging.basicConfig(format=form, level=level, datefmt="[%X]", force=True)
    datasets.utils.logging.set_verbosity(max(level, logging.WARNING))
    logging.getLogger("absl").setLevel(max(level, logging.WARNING))  # Orbax logs every file it writes at INFO
    logging.getLogger(xla_bridge.__name__).setLevel(max(level, logging.WARNING))  # "Unable to initialize ... 'tpu'"
    # transformers 4.57.6 is pinned on purpose, the last release with Flax models: its warning that they go in v5 is
    # no news to a run of this script.
    for name in ("modeling_flax_utils", "tokenization_utils_base"):
        logging.getLogger(f"transformers.{name}").addFilter(lambda record: DEPRECATED not in record.getMessage())
    # A damaged checkpoint's reads, abandoned when Orbax's restore fails, are each reported again when collected.
    logging.getLogger("asyncio").filters = [lambda record: "exception was never retrieved" not in record.getMessage()]
    sys.unraisablehook = lambda u: "while reading array index" in str(u.exc_value) or sys.__unraisablehook__(u)


DEPRECATED = "TensorFlow and JAX classes are deprecated and will be removed in Transformers v5"


def validate_args(model_args, data_args, training_args):
    """Everything that can be checked before any work: files, combinations of arguments, names on the hub."""
    files = {"--train_file": data_args.train_file, "--validation_file": data_args.validation_file}
    for flag, path in files.items():
        if path is not None:
            check_data_file(flag, path, whole=not data_args.streaming)
    args, data, kind, streamed = training_args, data_args, model_args.model_type, data_args.streaming
    extensions = sorted({os.path.splitext(p)[1] for p in files.values() if p})
    for refused, message in (
        (not (data.dataset_name or any(files.values())), "need --dataset_name or --train_file/--validation_file"),
        (len(extensions) > 1, f"--train_file and --validation_file need the same extension, got {extensions}"),
        (streamed and args.do_train and args.max_steps <= 0, "--streaming needs --max_steps: a stream has no length"),
        (
            streamed and args.do_eval and data.train_file and not data.validation_file,
            "--streaming with --do_eval needs --validation_file: a stream cannot be split by percentage",
        ),
        (not args.do_train and not args.do_eval, "nothing to do: pass --do_train and/or --do_eval"),
        (not 0 < (data.validation_split_percentage or 0) < 100, "--validation_split_percentage: between 0 and 100"),
        (max(args.max_steps, args.num_train_epochs) <= 0, "--num_train_epochs must be positive, or give --max_steps"),
        (args.max_steps == 0 or args.max_steps < -1, f"--max_steps {args.max_steps}: positive, or -1 (unset: epochs)"),
        (
            args.load_best_model_at_end and not (args.do_train and args.do_eval),
            "--load_best_model_at_end needs --do_train and --do_eval",
        ),
        (
            args.load_best_model_at_end and not (args.eval_steps and args.save_steps % args.eval_steps == 0),
            "--load_best_model_at_end needs --eval_steps, and --save_steps a round multiple of it (as the Trainer)",
        ),
        (os.path.isfile(args.output_dir), f"--output_dir {args.output_dir} exists and is not a directory"),
        (args.push_to_hub and not hub_reachable(), "--push_to_hub: the Hugging Face Hub is unreachable (offline?)"),
        (kind not in (None, *MODEL_TYPES), f"--model_type {kind!r}: choose one of {', '.join(MODEL_TYPES)}"),
        (args.heartbeat_timeout_seconds < 1, "--heartbeat_timeout_seconds: at least 1 (a lost process's grace)"),
    ):
        if refused:
            fail(message)
    validate_objective(data_args)
    given = [f"--{f.name}" for group in (data, args) for f in fields(group) if getattr(group, f.name) != f.default]
    for names, why in (  # flags given that do nothing here, in one line each
        (IN_MEMORY_ONLY if streamed else STREAM_ONLY, f"no effect {'with' if streamed else 'without'} --streaming"),
        (EVAL_ONLY * (not args.do_eval), "no effect without --do_eval (no evaluation will run)"),
        (UPSTREAM_ONLY, "accepted as upstream, not used (no whole-word masking by reference file)"),
        (BEST_ONLY * (not args.load_best_model_at_end), "no effect without --load_best_model_at_end"),
    ):
        if unused := [flag for flag in given if flag in names]:
            logger.warning(f"{', '.join(unused)}: {why}")
    tokenizer_flag = "tokenizer_name" if model_args.tokenizer_name else "model_name_or_path"
    if missing := missing_tokenizer_files(getattr(model_args, tokenizer_flag) or ""):
        fail(
            f"--{tokenizer_flag} {getattr(model_args, tokenizer_flag)} holds no complete tokenizer: it lacks "
            f"{', '.join(missing)}; write one with tokenizers/train_tokenizer.py, or pass the folder that holds one"
        )
    for flag in ("model_name_or_path", "config_name", "tokenizer_name", "dataset_name"):
        path = getattr(model_args, flag, None) or getattr(data_args, flag, None)
        # Not a local path: a hub id (HF_HUB_OFFLINE=1: one missing from the local cache fails where it is loaded).
        if path is not None and not os.path.exists(path) and hub_reachable() is False:
            fail(
                f"--{flag} {path!r} is not a local path and the Hugging Face Hub is unreachable (offline?); pass "
                "local files instead (--train_file/--validation_file for data, a folder for models/tokenizers; "
                "see tokenizers/prepare_corpus.py), or set HF_HUB_OFFLINE=1 to use a copy in the local cache"
            )
        if flag in ("config_name", "model_name_or_path") and path and os.path.isdir(path):
            checkpoint = os.path.isdir(os.path.join(path, "trainer_state"))
            if checkpoint and not os.path.isfile(os.path.join(path, "config.json")):
                fail(
                    f"--{flag} {path} is a training checkpoint of an earlier release, which held no model: "
                    f"evaluate it with --do_eval --resume_from_checkpoint {path}, continue its run with --output_dir "
                    f"{os.path.dirname(os.path.abspath(path))} --resume_from_checkpoint {path}, or start from the "
                    "model that run saved in that folder"
                )
            if checkpoint and flag == "model_name_or_path" and training_args.do_train:
                logger.warning(
                    f"--{flag} {path}: a new run from the model of that checkpoint, with a fresh optimizer, schedule "
                    f"and data order (--resume_from_checkpoint {path} would continue its run instead)"
                )
            if not os.path.isfile(os.path.join(path, "config.json")):
                fail(f"--{flag} {path} holds no config.json; write one with tokenizers/create_config.py")
            if flag == "model_name_or_path" and not any(name.startswith(WEIGHTS) for name in os.listdir(path)):
                fail(f"--{flag} {path} holds no {' or '.join(WEIGHTS)}: for a new model, use --config_name")


# Where a local folder has no tokenizer.json and tokenizer_config.json names no class known here: any of these is a
# vocabulary some tokenizer class reads.
VOCABULARY_FILES = ("vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")


def missing_tokenizer_files(path):
    """The files a local tokenizer folder lacks, [] where it is whole (or not a folder): tokenizer.json, or every
    vocabulary file of the class its tokenizer_config.json names (transformers' slow classes open a missing one as
    None: a TypeError)."""
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


def check_data_file(flag, path, whole=True):
    """A file (not a folder) of a supported extension, not empty, and UTF-8 text (else the datasets loader says
    only that generating the dataset failed); streamed (not whole): its first MiB, the rest as it is read."""
    extension = path.split(".")[-1]
    if os.path.isdir(path):
        fail(f"{flag} {path} is a directory; pass a .txt, .csv or .json file")
    if extension not in ("csv", "json", "txt"):
        fail(f"{flag} {path}: unsupported extension .{extension}; use a .txt, .csv or .json file")
    if not os.path.isfile(path):
        fail(f"{flag} {path} does not exist (relative paths are read from {os.getcwd()})")
    decoder, line, empty = codecs.getincrementaldecoder("utf-8")(), 1, True
    with open(path, "rb") as f:
        for chunk in itertools.islice(iter(lambda: f.read(1 << 20), b""), None if whole else 1):
            empty = empty and not chunk.strip()
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                where = line + chunk.count(b"\n", 0, e.start)
                fail_not_utf8(f"{flag} {path}", f"byte 0x{chunk[e.start]:02x} on line {where}", then="first")
            line += chunk.count(b"\n")
    if empty:
        fail(f"{flag} {path} is empty")


# --- processes and signals: one process or many, a lost host, SIGTERM ------------------------------------------------


def start_process(model_args, training_args):
    """Join a multi-host run and set this process up; returns output_dir's lock (process 0's),
    to hold while it runs."""
    init_distributed(training_args.heartbeat_timeout_seconds)
    if jax.process_count() > 1:
        watch_processes(training_args.output_dir, training_args.heartbeat_timeout_seconds)
    release_compiler_memory()
    PROCESS.signal = 0
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    warn_if_bf16_is_slow("--dtype", model_args.dtype)
    lock = lock_output_dir(training_args.output_dir) if jax.process_index() == 0 else None
    if jax.process_index() != 0:
        datasets.utils.logging.set_verbosity_error()
        logging.getLogger().setLevel(logging.WARNING)
    logger.info(f"Training/evaluation parameters {training_args}")
    set_seed(training_args.seed)
    return lock


def lock_output_dir(output_dir):
    """An flock on output_dir/.lock while this process runs (released however it ends): a second run is refused."""
    if not os.path.isdir(output_dir):  # made here: removed again if the run stops before writing into it
        atexit.register(
            lambda: os.path.isdir(output_dir) and os.listdir(output_dir) == [".lock"] and shutil.rmtree(output_dir)
        )
    try:
        os.makedirs(output_dir, exist_ok=True)
        lock = open(os.path.join(output_dir, ".lock"), "a+", buffering=1)  # line-buffered: each line written at once
    except OSError as e:
        fail(f"--output_dir {output_dir} cannot be written ({e.strerror}); choose another folder")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        fail(
            f"another run ({lock.read().strip() or 'unknown'}) is writing into {output_dir}; "
            "wait for it to end, or choose another --output_dir"
        )
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started {datetime.datetime.now():%Y-%m-%d %H:%M:%S}\n")
    return lock


def init_distributed(heartbeat_timeout_seconds):
    """Join the other processes of a multi-host run before any JAX computation: from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID, else wherever JAX finds a cluster (TPU pod slices, SLURM, Open MPI), once."""
    if xla_bridge.backends_are_initialized():
        return
    kwargs, env = dict(heartbeat_timeout_seconds=heartbeat_timeout_seconds), os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        try:
            kwargs.update(num_processes=int(env["JAX_NUM_PROCESSES"]), process_id=int(env["JAX_PROCESS_ID"]))
        except (KeyError, ValueError) as e:
            fail(f"JAX_COORDINATOR_ADDRESS is set, so JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers too ({e})")
        jax.distributed.initialize(**kwargs)
        return
    with contextlib.suppress(ValueError):  # no cluster found: a single process
        jax.distributed.initialize(**kwargs)


# A lost process: JAX's distributed runtime aborts every process of a multi-host run once one has sent no heartbeat for
# --heartbeat_timeout_seconds, and at once when the coordinator (process 0) is gone. Each process writes the runtime's
# own output (C++: XLA, gloo, the coordination service; Orbax's log) to output_dir/process-N.log, and turns the abort
# into one line on the terminal and exit code 75 (EX_TEMPFAIL: resume and try again).
@dataclass
class LostProcessWatch:
    """What on_abort needs to name a lost process in one line; watch_processes sets it, in multi-host runs only."""

    log: str  # this process's log, where the runtime writes
    start: int  # the log's size when this run began: on_abort reads from there
    terminal: io.TextIOBase  # the terminal (sys.stderr, while fd 2 goes to the log)
    hosts: list  # every process's host name, in process order
    timeout: float  # --heartbeat_timeout_seconds
    handler: Any  # on_abort as a C function, kept referenced while it is the SIGABRT handler


@dataclass
class ProcessState:
    """What the signal handlers read, set by start_process and the loop: one object for the process's life."""

    signal: int = 0  # SIGTERM or SIGINT once received: training stops after the current step
    training: bool = False  # whether the loop runs; outside it, a signal stops the run at once
    progress: Any = None  # TrainingProgress, while training: where on_abort's line says it stopped
    lost: LostProcessWatch | None = None  # a multi-host run's


PROCESS = ProcessState()


def watch_processes(output_dir, heartbeat_timeout_seconds):
    log_path = os.path.join(output_dir, f"process-{jax.process_index()}.log")
    os.makedirs(output_dir, exist_ok=True)
    terminal = sys.stderr = open(os.dup(2), "w", buffering=1)  # Python's output; C++'s fd 2: the log
    os.dup2(log := os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    start = os.lseek(log, 0, os.SEEK_END)
    logging.root.handlers[0].setStream(sys.stderr)
    logging.getLogger("absl").handlers = [logging.FileHandler(log_path)]
    logging.getLogger("absl").propagate = False
    handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(on_abort)
    hosts = gather_json(socket.gethostname())
    PROCESS.lost = LostProcessWatch(log_path, start, terminal, hosts, heartbeat_timeout_seconds, handler)
    ctypes.CDLL(None).signal(signal.SIGABRT, handler)
    sys.excepthook = log_and_wait


def runtime_failed(error):
    """Whether `error` is the runtime's (its status first: UNKNOWN: Gloo AllGather failed...) in a multi-host run."""
    return (
        PROCESS.lost is not None
        and isinstance(error, (RuntimeError, ValueError))
        and bool(re.match(r"[A-Z_]{5,}: ", str(error)))
    )


def log_and_wait(kind, error, trace):
    """sys.excepthook: the runtime's error (a collective that lost a process) goes to the log, on_abort is awaited."""
    if runtime_failed(error):
        traceback.print_exception(kind, error, trace, file=sys.__stderr__)
        time.sleep(PROCESS.lost.timeout + 30)
    sys.__excepthook__(kind, error, trace)


def on_abort(_signum):
    """SIGABRT, in the runtime's thread (the main one waits on a collective): the lost process named from the log."""
    watch, progress = PROCESS.lost, PROCESS.progress or TrainingProgress()
    text = Path(watch.log).read_bytes()[watch.start :].decode(errors="replace")
    dead = re.search(r"Task (\d+) heartbeat timeout|heartbeats\):\n(\d+)|()Service/(Heartbeat|Poll)", text)
    what = "JAX's distributed runtime aborted"  # a lost process it did not name, or a failure of its own
    if dead:
        lost = int(dead[1] or dead[2] or 0)
        what = f"process {lost} (host {watch.hosts[lost]}{', the coordinator' * (lost == 0)}) was lost"
    last = progress.last_checkpoint
    resume = f"resume from {last} with --resume_from_checkpoint" if last else "no checkpoint to resume from"
    where = f"after step {progress.global_step}, so this process stopped; {resume} (log: {watch.log})"
    watch.terminal.write(f"\n{os.path.basename(__file__)}: {what} {where}\n")  # under a progress bar
    os._exit(75)


# SIGTERM (a preemption, a batch scheduler) and SIGINT (Ctrl-C) stop training after the current step, with a
# checkpoint (after_step); a second signal ends the run at once, the last complete checkpoint intact.
def on_signal(signum, _frame):
    if PROCESS.signal:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    PROCESS.signal = signum
    if not PROCESS.training:
        name = signal.Signals(signum).name
        print(f"{os.path.basename(__file__)}: stopped on {name}, outside training: nothing to save", file=sys.stderr)
        raise SystemExit(128 + signum)


# --- data --------------------------------------------------------------------------------------------------------


def load_raw_datasets(model_args, data_args):
    """The train and validation splits (else --validation_split_percentage of train); streamed: this process's."""
    kwargs = dict(cache_dir=model_args.cache_dir, token=model_args.token, streaming=data_args.streaming)
    source = data_args.dataset_name or data_args.train_file or data_args.validation_file
    if data_args.dataset_name is not None:
        kwargs["trust_remote_code"] = model_args.trust_remote_code
        load = functools.partial(load_dataset, source, data_args.dataset_config_name, **kwargs)
    else:
        files = {"train": data_args.train_file, "validation": data_args.validation_file}
        extension = {"txt": "text"}.get(source.split(".")[-1], source.split(".")[-1])
        if extension == "text" and hasattr(data_args, "keep_linebreaks"):
            kwargs["keep_linebreaks"] = data_args.keep_linebreaks
        load = functools.partial(load_dataset, extension, data_files={k: v for k, v in files.items() if v}, **kwargs)
    pct = data_args.validation_split_percentage
    try:
        raw = load()
        if data_args.streaming:  # the features a stream leaves unknown are read from its first rows
            if data_args.dataset_name is None and extension == "text" and data_args.train_file:
                raw["train"] = text_file_stream(data_args.train_file, kwargs.get("keep_linebreaks", False))
            raw = StreamingSplits({name: split._resolve_features() for name, split in raw.items()})
            if "train" in raw:
                if raw["train"].num_shards % jax.process_count():
                    logger.warning(
                        f"the training stream has {raw['train'].num_shards} file(s), not a multiple of the "
                        f"{jax.process_count()} processes: each process reads all of it to keep its rows"
                    )
                raw["train"] = split_dataset_by_node(raw["train"], jax.process_index(), jax.process_count())
        elif "validation" not in raw.keys() and "train" in raw.keys():
            if round(len(raw["train"]) * pct / 100) == 0:
                fail(
                    f"{source} is too short to split {pct} % off for validation (it has "
                    f"{len(raw['train'])} examples); give --validation_file, or more text"
                )
            raw["validation"], raw["train"] = load(split=f"train[:{pct}%]"), load(split=f"train[{pct}%:]")
    except Exception as e:  # noqa: BLE001 - a dataset that cannot be read becomes one line
        fail(f"cannot load dataset {source!r}: {type(e).__name__}: {first_line(e)}")
    return raw


def text_file_stream(path, keep_linebreaks, shard_bytes=64 << 20):
    """A text file streamed a row a line, as datasets' text loader reads it, in byte ranges of about shard_bytes,
    a multiple of the process count: each process reads only its own, and a resume re-reads at most one."""
    size, processes = os.path.getsize(path), jax.process_count()
    count, starts = processes * max(1, round(size / (shard_bytes * processes))), [0]
    with open(path, "rb") as f:
        for i in range(1, count):
            f.seek(size * i // count - 1)
            f.readline()  # a range starts where a line does
            starts.append(max(f.tell(), starts[-1]))

    def read_lines(ranges):  # the lines that start in the byte `ranges`, a MiB read at a time
        with open(path, "rb") as f:
            for start, end in ranges:
                f.seek(start)
                while start < end:
                    block = f.read(min(1 << 20, end - start))
                    block += f.readline() if start + len(block) < end else b""
                    start += len(block)
                    try:
                        text = block.decode().replace("\r\n", "\n").replace("\r", "\n")
                    except UnicodeDecodeError as e:
                        where = f"byte 0x{block[e.start]:02x} at offset {start - len(block) + e.start}"
                        fail_not_utf8(f"--train_file {path}", where)
                    for line in text.splitlines(keep_linebreaks):
                        yield {"text": line}

    ranges, features = list(zip(starts, [*starts[1:], size])), datasets.Features({"text": datasets.Value("string")})
    return datasets.IterableDataset.from_generator(read_lines, features=features, gen_kwargs={"ranges": ranges})


class StreamingSplits(dict):
    """Streamed splits under the calls preprocess() makes: map() leaves out what only works in memory."""

    def map(self, function, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("desc", "num_proc", "load_from_cache_file")}
        return StreamingSplits({name: split.map(function, **kwargs) for name, split in self.items()})


def text_column(raw_datasets, data_args):
    """The column that holds the text: `text`, else (as upstream) the first column, if it holds strings."""
    features = raw_datasets["train" if "train" in raw_datasets else "validation"].features
    if "text" in (columns := list(features)):
        return "text"
    if getattr(features[columns[0]], "dtype", None) in ("string", "large_string"):
        logger.warning(f"no column named 'text': taking the text from the first column, {columns[0]!r}")
        return columns[0]
    source = data_args.dataset_name or data_args.train_file or data_args.validation_file
    fail(
        f"{source} has no column named 'text' (its columns: {', '.join(columns)}); "
        "name the column that holds the text 'text'"
    )


def group_texts(examples, block_size):
    """The texts concatenated and cut into blocks of block_size, as upstream: the rest dropped, a short batch kept."""
    concatenated = {k: list(itertools.chain.from_iterable(examples[k])) for k in examples.keys()}
    total_length = len(concatenated[list(examples.keys())[0]])
    total_length -= total_length % block_size if total_length >= block_size else 0
    return {k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}


def objective_settings(data_args):
    """The objective's own arguments (what DataTrainingArguments adds to DataArguments), as checkpoints record them."""
    shared = {f.name for f in fields(DataArguments)}
    return {f.name: getattr(data_args, f.name) for f in fields(data_args) if f.name not in shared}


def data_fingerprint(data_args, tokenizer, dataset, max_seq_length, plan, seed, collator):
    """What a saved data position means, as checkpoints record it (train files: size, hash of first and last MiB)."""
    files = {}
    for path in [data_args.train_file] if data_args.train_file else []:
        with open(path, "rb") as f:
            size, head = os.path.getsize(path), f.read(1 << 20)
            f.seek(max(size - (1 << 20), len(head)))
            files[os.path.basename(path)] = f"{size} bytes, {hashlib.sha256(head + f.read()).hexdigest()[:12]}"
    backend, streamed = getattr(tokenizer, "backend_tokenizer", None), data_args.streaming and "train" in dataset
    vocabulary = backend.to_str() if backend else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    if "train" in dataset and not data_args.streaming and len(dataset["train"]):
        check_noise_is_pure(collator, dataset["train"], seed)
    return {
        "train_files": files,
        "dataset": f"{data_args.dataset_name} {data_args.dataset_config_name}" if data_args.dataset_name else None,
        "tokenizer": hashlib.sha256(vocabulary.encode()).hexdigest()[:12],
        LENGTH_FLAG: max_seq_length,
        "train_rows": data_args.max_train_samples if data_args.streaming else plan.num_train_examples,
        "streams": [jax.process_count(), dataset["train"].num_shards] if streamed else None,  # processes, shards each
        "shuffle_buffer_size": data_args.shuffle_buffer_size if data_args.streaming else None,
        "seed": seed,
        "train_batch_size": plan.train_batch_size,
        "resume_checks": resume_checks(collator),
    }


def check_noise_is_pure(collator, dataset, seed):
    """A resume replays batches exactly only if collate_batch draws its noise from (*seed, row id) and the rows alone:
    the first rows, collated twice, must come out the same (noise from a global or stateful generator differs)."""
    ids = np.arange(min(2, len(dataset)))
    first, again = (collate_batch(collator, dataset[ids], (seed, 0), ids, len(ids)) for _ in range(2))
    if any(not np.array_equal(first[key], again[key]) for key in first):
        fail(
            "collate_batch noised the same rows differently when called again: draw the noise from (*seed, row id) "
            "alone (numpy.random.default_rng([*seed, row_id])), or a resume cannot be exact"
        )


def select_samples(dataset, data_args):
    """At most --max_train_samples / --max_eval_samples rows of each split. Streamed: this process's share of
    --max_train_samples, and the first --max_eval_samples (1000) evaluation rows, read now: the same every time."""
    if data_args.streaming:
        if "train" in dataset and data_args.max_train_samples:
            dataset["train"] = dataset["train"].take(data_args.max_train_samples // jax.process_count())
        if "validation" in dataset:
            rows = itertools.islice(dataset["validation"], data_args.max_eval_samples or 1000)
            dataset["validation"] = datasets.Dataset.from_list(list(rows))
        return dataset
    for split, limit in (("train", data_args.max_train_samples), ("validation", data_args.max_eval_samples)):
        if limit is not None and split in dataset:
            dataset[split] = dataset[split].select(range(min(limit, len(dataset[split]))))
    return dataset


def pad_rows(batch, num_rows, fill):
    """The batch padded to `num_rows` rows of `fill` (else 0) carrying no label or attention: every device's full."""
    extra = num_rows - len(next(iter(batch.values())))
    pad = lambda k, v: np.full((extra,) + v.shape[1:], fill.get(k, 0), dtype=v.dtype)  # noqa: E731
    return {k: np.concatenate([v, pad(k, v)]) for k, v in batch.items()} if extra else batch


def generate_batch_splits(samples_idx, batch_size, drop_last=True):
    """Batches of batch_size indices, in order: without drop_last, the last may be shorter."""
    if drop_last:
        full = len(samples_idx) // batch_size
        return np.split(samples_idx[: full * batch_size], full) if full else []
    return np.array_split(samples_idx, math.ceil(len(samples_idx) / batch_size))


def epoch_batches(num_examples, batch_size, seed, epoch):
    """The example indices of every full batch of an epoch: a permutation drawn from (seed, epoch) alone."""
    return generate_batch_splits(np.random.default_rng([seed, epoch]).permutation(num_examples), batch_size)


def epoch_rows(run, progress):
    """In memory: this process's rows of each global batch from `progress` on, each epoch's a permutation drawn
    from (seed, epoch): (examples, noise seed, row ids, the position after the batch, whether it ends its epoch)."""
    plan, seed, micro_batches = run.plan, run.args.seed, run.args.gradient_accumulation_steps
    for epoch in range(progress.epoch, plan.num_epochs):
        batches = epoch_batches(plan.num_train_examples, plan.train_batch_size, seed, epoch)
        for index in range(progress.batch_in_epoch if epoch == progress.epoch else 0, len(batches)):
            rows, last = np.sort(batches[index]), index + 1 == len(batches)
            rows = rows.reshape(micro_batches, jax.process_count(), -1)[:, plan.process_index].reshape(-1)
            yield run.dataset["train"][rows], (seed, epoch), rows, (epoch + last, 0 if last else index + 1, None), last


def stream_rows(run, progress):
    """Streamed: this process's rows of each global batch from `progress` on, read ahead on a thread, as
    epoch_rows gives them; the position: (pass, 0, the window, the stream's state at its start, rows taken from it)."""
    plan, args, processes, dataset = run.plan, run.args, jax.process_count(), run.dataset["train"]
    need, size = plan.train_batch_size // processes, run.data["shuffle_buffer_size"]
    position = progress.stream or {"pass": 0, "window": 0, "state": None, "taken": 0}

    def windows():  # pass after pass, windows of `size` rows shuffled by (seed, pass, window), each with its start
        epoch, index, state = position["pass"], position["window"], position["state"]
        while True:  # a window is rebuilt from the stream's state before it: state_dict keeps no shuffle buffer
            dataset.load_state_dict(state)  # None: from the start
            rows, count = iter(dataset), 0
            try:
                while window := list(itertools.islice(rows, size)):
                    order = np.random.default_rng([args.seed, epoch, index]).permutation(len(window))
                    yield [window[i] for i in order], {"pass": epoch, "window": index, "state": state}
                    index, state, count = index + 1, dataset.state_dict(), index * size + len(window)
            except UnicodeDecodeError as e:
                fail_not_utf8("the training stream", e)
            yield None, {"pass": epoch, "rows": count}
            epoch, index, state = epoch + 1, 0, None

    taken, examples, ids = position["taken"], [], []
    for window, start in read_ahead(windows()):
        if window is None:  # the pass ended after start["rows"] rows
            if start["rows"] < need:
                fail(f"the training stream has {start['rows']} rows, fewer than this process's {need} of one batch")
            limit = run.data["train_rows"]
            short = f", fewer than --max_train_samples {limit}" if limit and start["rows"] * processes < limit else ""
            logger.warning(
                f"pass {start['pass'] + 1} over the training stream ended after {start['rows']} rows{short}; "
                f"--max_steps {args.max_steps} goes on with pass {start['pass'] + 2}: the same rows in a new order"
            )
            examples, ids = [], []
            continue
        for taken in range(taken, len(window)):
            examples.append(window[taken])
            ids.append((start["window"] * size + taken) * processes + plan.process_index)
            if len(examples) == need:
                where = {**start, "taken": taken + 1}
                batch = {k: [example[k] for example in examples] for k in examples[0]}
                yield batch, (args.seed, start["pass"]), np.array(ids), (start["pass"], 0, where), False
                examples, ids = [], []
        taken = 0


def read_ahead(iterator):
    """`iterator`'s items, each made on a thread while the one before is used; an error there is raised here.
    Closed, it ends the thread once the item in the making is done (native code running at exit would abort)."""
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        ahead = thread.submit(next, iterator, StopIteration)
        while (item := ahead.result()) is not StopIteration:
            ahead = thread.submit(next, iterator, StopIteration)
            yield item


def local_batches(run, progress):
    """This process's batches from `progress` on, collated: (batch, the data position after it, whether it ends its
    epoch)."""
    streamed = isinstance(run.dataset["train"], datasets.IterableDataset)
    for examples, seed, rows, position, end_of_epoch in (stream_rows if streamed else epoch_rows)(run, progress):
        yield collate_batch(run.collator, examples, seed, rows, len(rows)), position, end_of_epoch


class ProcessAgreement:
    """What the processes of a multi-process run agree on with no host collective but at the start, so that no
    process waits for its devices between steps: each batch's shapes (every process pads its rows to the largest)
    and the step to stop after. Each train step takes this process's vote, the shapes of the batch two ahead and the
    signal received (0 if none), and returns every process's largest; that is read while the next step runs, so
    batches are collated three ahead and every process stops after the same step. A single process agrees with
    itself: its batches as collated, its own signal when asked."""

    def __init__(self, batches, pad_token_id, plan):
        self.batches, self.pad_token_id, self.plan = batches, pad_token_id, plan
        self.multi = jax.process_count() > 1
        self.ahead = collections.deque(itertools.islice(batches, 3) if self.multi else ())
        self.agreed = collections.deque(largest_shapes([batch for batch, *_ in list(self.ahead)[:2]]))
        self.voted = None  # the last step's result, read once the step after it runs
        self.signal = 0

    def __iter__(self):
        if not self.multi:
            yield from ((*item, None) for item in self.batches)
            return
        rows = NamedSharding(self.plan.mesh, PartitionSpec(("replica", "fsdp")))
        width = len(shape_vector(self.ahead[0][0]))
        while self.ahead:
            batch, position, end_of_epoch = self.ahead.popleft()
            shapes = shape_vector(self.ahead[1][0]) if len(self.ahead) > 1 else np.zeros(width, np.int32)
            local = np.tile(np.append(shapes, np.int32(PROCESS.signal)), (self.plan.local_devices, 1))
            votes = jax.make_array_from_process_local_data(rows, local, (self.plan.num_devices, width + 1))
            yield pad_to(batch, self.agreed.popleft(), self.pad_token_id), position, end_of_epoch, votes
            self.ahead.extend(itertools.islice(self.batches, 1))

    def read(self, metrics):
        """Takes the step's result out of its metrics, and reads the step before's: shapes and signal."""
        voted, self.voted = self.voted, metrics.pop("agreed", None)
        if voted is not None:
            voted = np.asarray(voted)  # the step before's, done (or all but) while this one waits to run
            self.agreed.append(voted[:-1])
            self.signal = int(voted[-1])

    def stop(self):
        """The signal to stop on after this step, or 0: in a multi-process run the same in every process."""
        return self.signal if self.multi else PROCESS.signal


def shape_vector(batch):
    return np.concatenate([np.asarray(value.shape[1:], np.int32) for value in batch.values()])


def largest_shapes(batches):
    """Each batch's largest shape_vector over every process, with one collective for them all."""
    if jax.process_count() == 1 or not batches:
        return [shape_vector(batch) for batch in batches]
    return list(np.max(multihost_utils.process_allgather(np.stack([shape_vector(b) for b in batches])), axis=0))


def pad_to(batch, dims, pad_token_id):
    """Every array of `batch` padded to `dims` (shape_vector's order): labels -100, ids the pad token, others 0."""
    padded, dims = {}, list(dims)
    for name, value in batch.items():
        target, dims = dims[: value.ndim - 1], dims[value.ndim - 1 :]
        fill = -100 if name == "labels" else (pad_token_id or 0) if name.endswith("input_ids") else 0
        widths = [(0, 0)] + [(0, int(t) - d) for t, d in zip(target, value.shape[1:], strict=True)]
        padded[name] = np.pad(value, widths, constant_values=fill)
    return padded


# --- model and plan ----------------------------------------------------------------------------------------------


def load_config_and_tokenizer(model_args, gradient_checkpointing=False):
    """The config (--config_name, --model_name_or_path or a new one of --model_type) and the tokenizer, fitted to the
    objective (fit_objective), then checked against each other and against --gradient_checkpointing."""
    args = model_args
    hub = dict(cache_dir=args.cache_dir, token=args.token, trust_remote_code=args.trust_remote_code)
    config_path = args.config_name or args.model_name_or_path
    tokenizer_source = args.tokenizer_name or args.model_name_or_path
    if config_path is None and args.model_type is None:
        fail("need --config_name, --model_name_or_path or --model_type to know which model to train")
    if tokenizer_source is None:
        fail("this script trains no tokenizer: make one with tokenizers/train_tokenizer.py, pass --tokenizer_name")
    try:
        config = AutoConfig.from_pretrained(config_path, **hub) if config_path else CONFIG_MAPPING[args.model_type]()
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, use_fast=args.use_fast_tokenizer, **hub)
    except (OSError, ValueError) as e:
        names = f"{config_path or 'a new ' + args.model_type}, {tokenizer_source}"
        fail(f"cannot load the config or tokenizer ({names}): {first_line(e)}")
    if args.model_type not in (None, config.model_type):
        fail(f"--model_type {args.model_type}, but {config_path} holds a {config.model_type} config; drop one")
    if config_path is None:  # upstream's "new config instance from scratch", with its sizes
        sizes = f"hidden size {config.hidden_size}, {config.num_hidden_layers} layers, vocab_size {config.vocab_size}"
        logger.warning(f"no --config_name: the default {args.model_type} config ({sizes}); see create_config.py")
    fit_objective(config, tokenizer, tokenizer_source)  # may add tokens and grow config.vocab_size first
    if args.model_name_or_path:  # pretrained embeddings grow to a larger tokenizer, as resize_token_embeddings does
        config.vocab_size = max(config.vocab_size, len(tokenizer))
    heads = [getattr(config, name, 0) for name in ("num_attention_heads", "decoder_attention_heads")]
    uneven = [n for n in heads if n and config.model_type != "t5" and config.hidden_size % n]  # T5: heads of d_kv
    flax_class = MODEL_CLASS._model_mapping[type(config)] if type(config) in MODEL_CLASS._model_mapping else None
    remat = getattr(flax_class, "enable_gradient_checkpointing", None)  # not every Flax model overrides it
    if config.model_type not in MODEL_TYPES:
        fail(
            f"config model_type {config.model_type!r} has no Flax {OBJECTIVE} model; "
            f"choose one of {', '.join(MODEL_TYPES)}"
        )
    if config.vocab_size < len(tokenizer):
        fail(
            f"the config's vocab_size ({config.vocab_size}) is smaller than the tokenizer's {len(tokenizer)} tokens; "
            "rebuild the config with tokenizers/create_config.py --tokenizer_name ..."
        )
    if uneven:
        fail(
            f"the config's hidden size {config.hidden_size} is not divisible by its {uneven[0]} attention heads; "
            "fix it (tokenizers/create_config.py --config_overrides)"
        )
    if gradient_checkpointing and remat is transformers.FlaxPreTrainedModel.enable_gradient_checkpointing:
        fail(
            f"--gradient_checkpointing: transformers' Flax {config.model_type} model cannot recompute its "
            "activations; drop the flag, "
            "or save memory with --fsdp full_shard or a smaller batch and --gradient_accumulation_steps"
        )
    return config, tokenizer


def init_model(model_class, config, path, model_args, training_args, abstract):
    """A model and its parameters on the host, loaded from `path` or new from `config` by XLA:CPU (XLA:GPU compiles
    T5's draws for minutes; abstract: shapes only); --dtype bfloat16: an f32 model computing in bf16 (bf16_dense)."""
    dtype = jnp.float32 if model_args.dtype == "bfloat16" else getattr(jnp, model_args.dtype)
    kwargs = dict(seed=training_args.seed, dtype=dtype, _do_init=False, trust_remote_code=model_args.trust_remote_code)
    with jax.default_device(host_device()):
        if path and not abstract:
            model, params = load_pretrained(model_class, config, path, model_args, training_args, kwargs)
        else:
            model = model_class.from_config(config, **kwargs)
            init = functools.partial(model.init_weights, model.key, model.input_shape)
            params = jax.eval_shape(init) if abstract else jax.tree.map(np.asarray, jax.jit(init)())
    if training_args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model, params


def host_device():
    """Where parameters are drawn and loaded: the host's CPU (None, the default, where jax_platforms leaves it out)."""
    return jax.local_devices(backend="cpu")[0] if "cpu" in (jax.config.jax_platforms or "cpu") else None


def objective_params(config, seed, abstract):
    """The block's own parameters (init_objective_params), drawn on the host from (--seed, 1); abstract: shapes."""
    init = functools.partial(init_objective_params, config, jax.random.fold_in(jax.random.PRNGKey(seed), 1))
    with jax.default_device(host_device()):
        return jax.eval_shape(init) if abstract else jax.tree.map(np.asarray, jax.jit(init)())


def load_pretrained(model_class, config, path, model_args, training_args, kwargs):
    """A pretrained model from `path`: its Flax weights, else its PyTorch ones converted; a vocabulary grown to fit."""
    hub = dict(cache_dir=model_args.cache_dir, token=model_args.token)
    names = [name for weights in WEIGHTS for name in (weights, f"{weights}.index.json")]
    maybe = dict(_raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)
    found = [name for name in names if transformers.utils.cached_file(path, name, **hub, **maybe)]
    if not found:
        fail(f"cannot load the model {path!r}: it holds no weights file (looked for {', '.join(names)})")
    try:
        saved = AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code, **hub).vocab_size
    except (OSError, ValueError):  # weights without a config of their own: loaded at the config's size
        saved = config.vocab_size
    loaded = type(config).from_dict({**config.to_dict(), "vocab_size": saved}) if saved < config.vocab_size else config
    try:
        if found[0].startswith("flax_model"):
            logger.info(f"loading the Flax weights of {path} ({found[0]})")
            model, params = model_class.from_pretrained(path, config=loaded, **hub, **kwargs)
        else:  # transformers converts PyTorch weights only into a model that holds initialised parameters
            logger.info(f"{path} has no Flax weights: converting its PyTorch weights ({found[0]})")
            eager = {**kwargs, "_do_init": True}
            with whole_safetensors(path, found[0], hub) as source:
                pretrained = model_class.from_pretrained(source, config=loaded, from_pt=True, **hub, **eager)
            model, params = model_class.from_config(loaded, **kwargs), pretrained.params
    except ImportError as e:
        fail(f"cannot load the model {path!r}: its {found[0]} needs PyTorch to convert ({e}); pip install torch")
    except Exception as e:  # noqa: BLE001 - a missing, truncated or corrupt weights file becomes one line
        fail(f"cannot load the model {path!r} ({type(e).__name__}: {first_line(e)}); is its weights file complete?")
    if loaded is not config:  # grown as resize_token_embeddings grows them: the new rows are a new model's
        model, fresh = init_model(model_class, config, None, model_args, training_args, abstract=False)
        fresh, params = traverse_util.flatten_dict(fresh), traverse_util.flatten_dict(params)
        for name, old in params.items():  # every array with an axis of the old vocabulary (embeddings, head, bias)
            for d in [d for d in range(old.ndim) if fresh[name].shape[d] != old.shape[d]][:1]:
                params[name] = np.concatenate([old, np.split(fresh[name], [old.shape[d]], axis=d)[1]], axis=d)
        params = traverse_util.unflatten_dict(params)
        logger.info(f"the vocabulary grew from {saved} to {config.vocab_size} tokens: new embedding rows initialised")
    return model, params


@contextlib.contextmanager
def whole_safetensors(path, weights, hub):
    """`path`, or a temporary folder with its sharded model.safetensors written whole (Flax loads only a whole one)."""
    if weights != "model.safetensors.index.json":
        yield path
        return
    tensors = {}
    with open(transformers.utils.cached_file(path, weights, **hub)) as f:
        for shard in sorted(set(json.load(f)["weight_map"].values())):
            tensors.update(safetensors.numpy.load_file(transformers.utils.cached_file(path, shard, **hub)))
    with tempfile.TemporaryDirectory() as folder:
        safetensors.numpy.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        del tensors
        yield folder


@dataclass
class TrainingPlan:
    """Devices, batch sizes and step counts, settled before any long work starts."""

    mesh: Any
    num_devices: int
    local_devices: int
    process_index: int
    train_batch_size: int  # per device x devices x accumulation steps
    eval_batch_size: int
    num_train_examples: int = 0
    steps_per_epoch: int = 0
    total_steps: int = 0
    num_epochs: int = 0


def plan_training(training_args, dataset, max_seq_length):
    args, devices, accumulation = training_args, jax.device_count(), training_args.gradient_accumulation_steps
    batch = f"{args.per_device_train_batch_size} per device x {devices} devices x {accumulation} accumulation steps"
    rows = (args.per_device_train_batch_size * devices * accumulation, args.per_device_eval_batch_size * devices)
    plan = TrainingPlan(make_mesh(args.fsdp), devices, jax.local_device_count(), jax.process_index(), *rows)
    if args.fsdp and plan.mesh.shape["fsdp"] == 1:
        logger.warning(f"--fsdp {args.fsdp} over one device: nothing to shard, each device holds the whole state")
    for split, flag in (("train", "--do_train"), ("validation", "--do_eval")):
        if getattr(args, flag[2:]) and split not in dataset:
            fail(f"{flag} needs a {split} split and the data has none; give --{split}_file")
    if args.do_eval and len(dataset["validation"]) == 0:
        fail("the validation set is empty after tokenization; give a longer --validation_file")
    if not args.do_train:
        return plan
    streamed = isinstance(dataset["train"], datasets.IterableDataset)
    plan.num_train_examples = 0 if streamed else len(dataset["train"])
    # A stream has no length: its epoch, as the Trainer counts one, is the share of --max_steps done.
    plan.steps_per_epoch = args.max_steps if streamed else plan.num_train_examples // plan.train_batch_size
    if plan.steps_per_epoch == 0:
        fail(
            f"the train set has {plan.num_train_examples} rows of up to {max_seq_length} tokens, fewer than one "
            f"global batch of {plan.train_batch_size} ({batch}); "
            f"use more text or a smaller --per_device_train_batch_size/--gradient_accumulation_steps/--{LENGTH_FLAG}"
        )
    plan.total_steps = args.max_steps if args.max_steps > 0 else int(plan.steps_per_epoch * args.num_train_epochs)
    plan.num_epochs = math.ceil(plan.total_steps / plan.steps_per_epoch)
    if plan.total_steps <= 0:
        fail(
            "no training step to run: "
            f"--num_train_epochs {args.num_train_epochs} x {plan.steps_per_epoch} steps per epoch"
        )
    if args.warmup_steps >= plan.total_steps:  # the last step's rate is the schedule's at step total_steps - 1
        logger.warning(
            f"--warmup_steps {args.warmup_steps} is not less than the {plan.total_steps} training steps: the learning "
            f"rate only reaches {args.learning_rate * (plan.total_steps - 1) / args.warmup_steps:.3g}, "
            f"not --learning_rate {args.learning_rate:g}"
        )
    overridden = f" (--max_steps {args.max_steps}: --num_train_epochs is unused)" if args.max_steps > 0 else ""
    logger.info(
        f"***** Running training *****\n  Num examples = {plan.num_train_examples or 'streamed'}\n"
        f"  Num epochs = {plan.num_epochs}{overridden}\n"
        f"  Global batch size = {plan.train_batch_size} ({batch})\n  Total optimization steps = {plan.total_steps}"
    )
    return plan


def create_learning_rate_fn(num_train_steps, num_warmup_steps, learning_rate):
    """Linear warm-up from 0 to learning_rate, then linear decay to 0 at num_train_steps."""
    warmup_fn = optax.linear_schedule(0.0, learning_rate, transition_steps=max(num_warmup_steps, 1))
    decay_fn = optax.linear_schedule(learning_rate, 0, transition_steps=max(num_train_steps - num_warmup_steps, 1))
    return optax.join_schedules(schedules=[warmup_fn, decay_fn], boundaries=[num_warmup_steps])


# A norm's module: its own name has "layernorm", "layer_norm" or "ln" as a whole word (LayerNorm, ln_f,
# final_layer_norm, layernorm_embedding). Whole words of the parameter's own module, so that a name merely holding
# "ln" (kiln), or a module below one named ln_head, keeps its weight decay (upstream's substring test of the whole
# path did not).
NORM_MODULE = re.compile(r"(.+_)?(layer_?norm|ln)(_.+)?")


def decay_mask_fn(params):
    """True for the weights AdamW decays: every parameter but biases and the scales of norms (NORM_MODULE)."""

    def decays(path, _):
        names = [str(key.key) for key in path]
        return names[-1] != "bias" and not (len(names) > 1 and NORM_MODULE.fullmatch(names[-2].lower()))

    return jax.tree_util.tree_map_with_path(decays, params)


def objective_means(sums, weights=None):
    """Each (sum, count) pair's mean (over at least 1). `loss`, what eval_loss and perplexity report, is the
    objective's first term: its pair named "loss", else LOSS_TERMS' first; where training minimises more than that
    term alone, `trained_loss` is the sum of the means weighted by `weights` (loss_weights'; LOSS_TERMS' by
    default)."""
    weights = weights or LOSS_TERMS
    means = {name: total / (count + (count == 0)) for name, (total, count) in sums.items()}
    means.setdefault("loss", means[next(iter(weights))])
    if weights != {"loss": 1.0}:
        means["trained_loss"] = sum(weight * means[name] for name, weight in weights.items())
    return means


def loss_weights(data_args):
    """LOSS_TERMS' weights, each taken from the objective's argument `<term>_weight` where DataTrainingArguments has
    one: a block weights a term by a flag by adding that field (--aux_loss_weight for a term aux_loss), recorded in
    checkpoints with its other arguments (a resume with another weight warns)."""
    return {name: float(getattr(data_args, f"{name}_weight", weight)) for name, weight in LOSS_TERMS.items()}


def token_sums(logits, labels, mask):
    """The summed cross-entropy and the number of correct predictions where `mask` is set, and those tokens' count."""
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0)) * mask
    return loss.sum(), ((jnp.argmax(logits, axis=-1) == labels) * mask).sum(), mask.sum()


def fit_attention(config, length):
    """BigBird's block-sparse attention takes rows of a multiple of block_size tokens; rows of at most (5 + 2 *
    num_random_blocks) blocks, and a decoder's (not causal), attend in full, as PyTorch's BigBird does."""
    if getattr(config, "attention_type", None) != "block_sparse":
        return
    block = config.block_size
    if length <= (5 + 2 * config.num_random_blocks) * block or config.is_decoder:
        why = "block-sparse attention is not causal" if config.is_decoder else f"--{LENGTH_FLAG} {length} is too short"
        logger.warning(f"{why}: attending in full (attention_type original_full)")
        config.attention_type = "original_full"
    elif length % block:
        fail(
            f"--{LENGTH_FLAG} {length} is not a multiple of {block}, the block size of the model's "
            f"block-sparse attention: pass {length - length % block} or {length - length % block + block}"
        )


# These models number positions from pad_token_id + 1, so they fit max_position_embeddings - pad - 1 tokens.
OFFSET_POSITION_MODELS = ("roberta", "roberta-prelayernorm", "xlm-roberta")


def bound_length(requested, config, tokenizer):
    """`requested` or the model's positions, cut to the tokenizer's maximum (warned); beyond the positions: refused."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and config.model_type in OFFSET_POSITION_MODELS:
        positions -= (config.pad_token_id or 0) + 1
    most = tokenizer.model_max_length
    length = min(requested if requested is not None else positions or most, most)
    if positions is not None and length > positions:  # named by the value typed, not the tokenizer's cut of it
        fail(f"--{LENGTH_FLAG} {requested} is longer than the model's {positions} positions")
    if requested is not None and requested > most:
        logger.warning(f"--{LENGTH_FLAG} {requested} is larger than the tokenizer's maximum ({most}); using {most}.")
    return length


def model_logits(model, params, batch, bf16, interceptors=(), dropout_rng=None, train=False):
    """The model's logits (model_outputs')."""
    return model_outputs(model, params, batch, bf16, interceptors, dropout_rng, train).logits


class ModelStates(NamedTuple):
    """What model_outputs gives a block, by name."""

    logits: Any  # [batch, length, vocab]: the head's output
    hidden: (
        Any  # [batch, length, hidden]: the last layer's output (the decoder's in an encoder-decoder), the head's input
    )
    encoder_hidden: Any = None  # [batch, source length, hidden]: an encoder-decoder's encoder output (T5, BART)


def model_outputs(model, params, batch, bf16, interceptors=(), dropout_rng=None, train=False):
    """The model's ModelStates (logits, final hidden states, an encoder's too) under `interceptors` (and bf16_dense
    with --dtype bfloat16), from the batch's keys its __call__ names, dropout as it takes it (`train` or
    `deterministic`), BigBird's random blocks from dropout_rng."""
    takes = inspect.signature(model.__call__).parameters
    inputs = {name: value for name, value in batch.items() if name in takes}
    mode = {"train": train} if "train" in takes else {"deterministic": not train}
    if "indices_rng" in takes and dropout_rng is not None:
        mode["indices_rng"] = jax.random.fold_in(dropout_rng, 1)
    with contextlib.ExitStack() as stack:
        for interceptor in [*interceptors, *([bf16_dense] if bf16 else [])]:
            stack.enter_context(nn.intercept_methods(interceptor))
        outputs = model(**inputs, params=params, dropout_rng=dropout_rng, output_hidden_states=True, **mode)
    hidden = outputs.get("decoder_hidden_states") or outputs["hidden_states"]
    return ModelStates(outputs["logits"], hidden[-1], outputs.get("encoder_last_hidden_state"))


def objective_apply(module, params, *args, bf16=False):
    """A block's own flax module on its parameters (a part of params["objective"]), its dense layers computed as the
    model's are (bf16_dense with --dtype bfloat16)."""
    with nn.intercept_methods(bf16_dense) if bf16 else contextlib.nullcontext():
        return module.apply({"params": params}, *args)


def capture_head(head, vocab_size, positions=None):
    """An interceptor on the model's output layer, its projection onto the vocabulary (the nn.Dense of vocab_size
    features, or a tied output embedding: the nn.Embed whose attend it calls), that records in `head` the layer's
    "inputs", "kernel" [hidden, vocab], "bias", "dtype" and "logits" (its output), for apply_head. With `positions`
    [batch, K] the layer reads only the inputs at those positions, so the model's logits are [batch, K, vocab]. A
    model may add to the layer's output (BERT's and RoBERTa's bias apart, BART's final_logits_bias): the model's
    logits are the layer's own where `head["logits"] is logits`. A head computed otherwise (DistilBERT's, ELECTRA's)
    leaves `head` empty."""

    def interceptor(next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        dense = method == "__call__" and isinstance(module, nn.Dense) and module.features == vocab_size
        tied = method == "attend" and isinstance(module, nn.Embed) and module.num_embeddings == vocab_size
        if not (dense or tied):
            return next_fun(*args, **kwargs)
        if positions is not None:
            args = (jnp.take_along_axis(args[0], positions[..., None], axis=1), *args[1:])
        if dense:
            bias = module.get_variable("params", "bias") if module.use_bias else 0.0
            head.update(kernel=module.get_variable("params", "kernel"), bias=bias)
        else:
            head.update(kernel=module.get_variable("params", "embedding").T, bias=0.0)
        head.update(dtype=module.dtype, inputs=args[0], logits=next_fun(*args, **kwargs))
        return head["logits"]

    return interceptor


def apply_head(head, x, bf16):
    """The logits of the output layer capture_head recorded in `head`, for other inputs x [..., hidden], as the
    model computes them (bf16_matmul with --dtype bfloat16)."""
    kernel = head["kernel"]
    logits = (bf16_matmul(x.astype(kernel.dtype), kernel) if bf16 else x @ kernel) + head["bias"]
    return logits if head["dtype"] is None else logits.astype(head["dtype"])


# --- --dtype bfloat16 ------------------------------------------------------------------------------------------
# XLA:CPU runs a bf16 x bf16 product with an f32 result on a bf16 kernel where the CPU has bf16 instructions
# (AMX-BF16, AVX-512 BF16), but converts a bf16 x bf16 -> bf16 product (upstream's bf16 model dtype) to f32.
# So --dtype bfloat16 keeps the model, its optimizer state, softmax, layer norms and loss in f32 and computes every
# dense layer, forward and backward, from bf16-rounded operands into f32. Without bf16 instructions (AVX2 only)
# those are computed in f32 too: bf16 only adds conversions there, and the script says so.


def cpu_bf16(cpuinfo="/proc/cpuinfo"):
    """(CPU model, its bf16 support) from cpuinfo's flags (Linux): "AMX-BF16" or "AVX-512 BF16" (bf16 products in
    hardware), "none, AVX2 only" or the like (bf16 computed in f32 or emulated: no faster than float32, or slower),
    "unknown" (no cpuinfo). LM_CPU_BF16=1 or 0 overrides the flags, for tests and for CPUs not listed here."""
    first_cpu = ""
    with contextlib.suppress(OSError), open(cpuinfo) as f:
        first_cpu = f.read().split("\n\n")[0]
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first_cpu.splitlines())}
    flags = set(fields.get("flags", "").split())
    widest = next((f", {name} only" for name in ("AVX-512F", "AVX2") if name.lower().replace("-", "") in flags), "")
    support = "AMX-BF16" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else f"none{widest}"
    override = os.environ.get("LM_CPU_BF16", "")
    if override not in ("", "0", "1"):
        fail(f"LM_CPU_BF16 must be 1 (this CPU has bf16 instructions) or 0 (it has none), got {override!r}")
    overrides = {"": support if flags else "unknown", "1": "native, LM_CPU_BF16=1", "0": "none, LM_CPU_BF16=0"}
    return fields.get("model name", "unknown CPU"), overrides[override]


def warn_if_bf16_is_slow(flag, value):
    """One warning line when bfloat16 is asked for on a CPU without bf16 instructions; the run goes on as asked."""
    if value != "bfloat16" or jax.default_backend() != "cpu":
        return
    model, support = cpu_bf16()
    if support.startswith("none"):
        logger.warning(
            f"{flag} bfloat16: this CPU ({model}, bf16: {support}) has no bf16 instructions; XLA computes bf16 "
            "products in f32 here, so float32 is as fast or faster. Going on as asked."
        )


def bf16_dot(a, b, contracting):
    return lax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (contracting, ((), ())), preferred_element_type=jnp.float32
    )


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
    """Whether the kernel-gradient product of `tokens` rows is faster from written-out transposes: on CPU, for up to
    1,024 tokens and layer widths of 512-4,096, as measured (benchmarks/README.md); a CPU without bf16 instructions
    computes the product in f32 either way; other backends take transposed operands as they are."""
    return (
        jax.default_backend() == "cpu"
        and tokens <= 1024
        and all(512 <= n <= 4096 for n in kernel_shape)
        and not cpu_bf16()[1].startswith("none")
    )


def written_out_transpose(a):
    """a.T of a 2-D bf16 array as a new row-major array. XLA folds a plain transpose, even one behind an
    optimization barrier, into the product that reads it (which then runs in f32 on CPU); one padded and
    sliced back is written out."""
    return jnp.pad(a.T, ((0, 0), (0, 1)))[:, : a.shape[0]]


bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def bf16_dense(next_fun, args, kwargs, context):
    """A flax method interceptor (nn.intercept_methods) that computes every nn.Dense with bf16_matmul:
    transformers' Flax models build their projections and their (tied) LM heads from nn.Dense, except
    GPT-2, whose FlaxConv1D is a dense layer with its kernel stored [out, in], and T5, whose tied LM head is its
    shared nn.Embed's attend."""
    module, method = context.module, context.method_name
    if method == "attend" and isinstance(module, nn.Embed):
        embedding = module.get_variable("params", "embedding")
        y = bf16_matmul(jnp.asarray(args[0], embedding.dtype), embedding.T)
        return y if module.dtype is None else y.astype(module.dtype)
    if method != "__call__" or not isinstance(module, (nn.Dense, FlaxConv1D)):
        return next_fun(*args, **kwargs)
    kernel = module.get_variable("params", "kernel")
    if isinstance(module, FlaxConv1D):
        kernel = kernel.T
    y = bf16_matmul(jnp.asarray(args[0], kernel.dtype), kernel)
    if module.use_bias:
        y = y + module.get_variable("params", "bias")
    return y if module.dtype is None else y.astype(module.dtype)


# --- memory, devices, the loop's bookkeeping and logs ------------------------------------------------------------


def save_all_but_transcendentals(primitive, *_, **__):
    """A jax.checkpoint policy: keep every value but those of erf, erfc, exp, tanh, logistic (recomputed backward)."""
    return primitive.name not in ("erf", "erfc", "exp", "tanh", "logistic")


def as_sharded(tree, shardings, whole=False):
    """`tree` as `shardings` say, or (whole=True) each split array whole on every device. --fsdp's step gathers the
    parameters for its passes and splits each gradient back: left to itself, XLA split some products along the
    model's width and held the global batch's activations on every device, which is what --fsdp is there to avoid."""

    def constrain(x, sharding):
        if sharding.is_fully_replicated:
            return x
        return lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, PartitionSpec()) if whole else sharding)

    return jax.tree.map(constrain, tree, shardings)


@functools.cache  # one listener per process, however often main() runs
def release_compiler_memory():
    """glibc's malloc_trim after each XLA compilation: the compiler's freed memory goes back to the OS."""
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: event == "/jax/core/compile/backend_compile_duration" and malloc_trim(0)
    )


def make_mesh(fsdp, devices=None):
    """The devices (jax.devices()) as a ("replica", "fsdp") mesh, a process's devices side by side: all on "replica"
    for data parallelism, all on "fsdp" for --fsdp full_shard, a process's on "fsdp" for hybrid_shard."""
    devices = sorted(devices or jax.devices(), key=lambda d: (d.process_index, d.id))
    local = sum(d.process_index == devices[0].process_index for d in devices)
    shape = {"": (len(devices), 1), "full_shard": (1, len(devices)), "hybrid_shard": (len(devices) // local, local)}
    auto = (jax.sharding.AxisType.Auto,) * 2  # transformers' Flax models do not annotate shardings
    return jax.sharding.Mesh(np.array(devices).reshape(shape[fsdp]), ("replica", "fsdp"), axis_types=auto)


def state_shardings(state, mesh, fsdp):
    """Where each array of `state` lives: replicated, or with --fsdp an array of more than 2**14 elements split over
    "fsdp" along its largest dimension that the axis divides (replicated if none does)."""

    def rule(x):
        fits = [d for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]) if x.shape[d] % mesh.shape["fsdp"] == 0]
        split = fits[0] if fsdp and fits and x.size > 2**14 else None
        return NamedSharding(mesh, PartitionSpec(*("fsdp" if d == split else None for d in range(x.ndim))))

    return jax.tree.map(rule, state)


def global_batch(batch, plan, micro_batches=None):
    """A global batch sharded by rows over every device, each process placing only its own rows: in training
    (micro_batches) those it collated, each micro-batch's in one block a process; in evaluation its share of all."""
    rows, processes = PartitionSpec(("replica", "fsdp")), jax.process_count()
    sharding = NamedSharding(plan.mesh, PartitionSpec(None, *rows) if micro_batches else rows)
    if micro_batches:
        local = {name: value.reshape(micro_batches, -1, *value.shape[1:]) for name, value in batch.items()}
        shape = lambda x: (micro_batches, x.shape[1] * processes, *x.shape[2:])  # noqa: E731
        return {k: jax.make_array_from_process_local_data(sharding, x, shape(x)) for k, x in local.items()}
    share = len(next(iter(batch.values()))) // processes
    mine = slice(plan.process_index * share, (plan.process_index + 1) * share)
    return {k: jax.make_array_from_process_local_data(sharding, x[mine], x.shape) for k, x in batch.items()}


@dataclass
class TrainingProgress:
    """Where training stands; saved in every checkpoint, so that a resumed run continues exactly."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # the next batch of `epoch` to train on
    log_window: list = field(default_factory=list)  # loss_sums' [sum, count] pairs of each step since the last log
    loss_sum: float = 0.0  # the training losses of every step so far, for train_loss
    stream: dict | None = None  # streamed: where this process is in its share (see stream_rows)
    best_metric: float | None = None  # --load_best_model_at_end: the best evaluation's --metric_for_best_model
    best_model_checkpoint: str | None = None  # and its checkpoint
    last_checkpoint: str | None = None


@dataclass
class LogWindow:
    """The steps timed since the last log line: when the window began (evaluating and saving paused out), steps and
    this process's tokens."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0


@dataclass
class Loop:
    """The loop's bookkeeping, not saved."""

    first_step: int
    started: float = field(default_factory=time.perf_counter)
    pending: list = field(default_factory=list)  # the steps' metrics, not yet fetched
    tokens: int = 0  # this process's
    flops: float | None = None
    shapes: list = field(default_factory=list)  # the batch shapes the step was compiled for
    last_eval: tuple | None = None
    window: LogWindow = field(default_factory=LogWindow)

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        yield
        self.window.start += time.perf_counter() - start


def timed_step(train_step, state, batch, loop, votes=None):
    """One train step, its tokens counted; the first also counts its FLOPs and logs its time; a recompile is logged."""
    shapes, tokens = {name: value.shape for name, value in batch.items()}, batch["input_ids"].size
    loop.tokens += tokens
    loop.window.steps += 1
    loop.window.tokens += tokens
    if loop.shapes:
        if shapes not in loop.shapes:
            changed = ", ".join(f"{k} {loop.shapes[0][k]} -> {v}" for k, v in shapes.items() if v != loop.shapes[0][k])
            logger.info(f"the train step compiles again, for new batch shapes: {changed}")
            loop.shapes.append(shapes)
        return train_step(state, batch, votes)
    loop.shapes.append(shapes)
    loop.flops = matmul_flops(train_step.trace(state, batch, votes).jaxpr.jaxpr)  # one step's, over all devices
    started = time.perf_counter()
    state, metrics = jax.block_until_ready(train_step(state, batch, votes))
    logger.info(f"First step (compilation included): {time.perf_counter() - started:.1f} s")
    loop.window = LogWindow()
    return state, metrics


def matmul_flops(jaxpr, loops=True):
    """The FLOPs of a jaxpr's used matrix products (two a multiply-add), a scan's body times its length; loops=False
    counts a loop's body once, as XLA's cost analysis does (its estimate misses micro-batches and CLM's chunks)."""
    total, used = 0, {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if not (eqn.effects or used.intersection(eqn.outvars)):
            continue  # XLA drops what nothing uses (CLM's model computes logits that its chunked head does not use)
        used.update(v for v in eqn.invars if isinstance(v, jax.extend.core.Var))
        if eqn.primitive.name == "dot_general":
            (axes, _), _ = eqn.params["dimension_numbers"]  # the left operand's contracted axes
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(eqn.invars[0].aval.shape[d] for d in axes)
        times = eqn.params["length"] if loops and eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple) else (value,):
                if isinstance(inner, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    total += times * matmul_flops(getattr(inner, "jaxpr", inner), loops)
    return total


def fetch_metrics(loop, progress):
    """The pending steps' metrics into the log window, in order (a non-finite loss stops); the last step's means."""
    metrics = None
    for step, step_metrics in loop.pending:
        step_metrics = jax.tree.map(float, step_metrics)
        sums = {name: list(pair) for name, pair in step_metrics.pop("sums").items()}
        metrics = {**objective_means(sums), **step_metrics}
        loss, norm = metrics.get("trained_loss", metrics["loss"]), metrics["grad_norm"]
        if not (math.isfinite(loss) and math.isfinite(norm)):
            stop_diverged(step, f"the training loss is {loss} (gradient norm {norm})", progress, loop.first_step)
        progress.log_window.append(sums)
        progress.loss_sum += loss
    loop.pending.clear()
    return metrics


def stop_diverged(step, what, progress, first_step=0):
    last = progress.last_checkpoint and f"the last good checkpoint is {progress.last_checkpoint}"
    if first_step and step == first_step + 1:  # a resumed run's first step
        fail(
            f"step {step}: {what} at the first step after resuming from {progress.last_checkpoint}; nothing was "
            "saved. That checkpoint matched its digest, so it holds the state as it was saved: resume from an "
            "earlier checkpoint-N with --resume_from_checkpoint PATH, or start afresh in another --output_dir"
        )
    fail(
        f"step {step}: {what}; training stopped and nothing from this step on was saved; "
        f"{last or 'no checkpoint was written'}. Lower --learning_rate or raise --warmup_steps, "
        "then resume with --resume_from_checkpoint"
    )


def log_training(progress, metrics, run, loop):
    """One line and TensorBoard scalars: the objective's means over the tokens since the last line, the last
    step's learning rate and gradient norm, and the throughput of the steps timed since (none if only one compiled)."""
    plan, writer = run.plan, run.writer
    window, progress.log_window = progress.log_window, []
    sums = {name: [sum(step[name][i] for step in window) for i in (0, 1)] for name in window[0]}
    means = objective_means(sums, run.weights)
    epoch = progress.global_step / plan.steps_per_epoch
    scalars = {**means, "learning_rate": metrics["learning_rate"], "grad_norm": metrics["grad_norm"], "epoch": epoch}
    line = f"Step {progress.global_step}/{plan.total_steps} (epoch {epoch:.2f}) | loss {means['loss']:.4f} | "
    line += "".join(f"{name} {value:.4f} | " for name, value in means.items() if name != "loss")
    line += f"lr {metrics['learning_rate']:.3e} | grad norm {metrics['grad_norm']:.3f}"
    steps = loop.window.steps
    if steps:
        seconds = time.perf_counter() - loop.window.start
        scalars.update(tokens_per_second=loop.window.tokens / seconds, seconds_per_step=seconds / steps)
        line += f" | {scalars['tokens_per_second']:,.0f} tokens/s | {seconds / steps:.3f} s/step"
    if steps and loop.flops:
        scalars["tflops"] = loop.flops * steps / seconds / 1e12
        line += f" | {scalars['tflops']:.3f} TFLOP/s"
        if run.args.peak_tflops:
            scalars["mfu"] = scalars["tflops"] / (run.args.peak_tflops * plan.num_devices)
            line += f" | MFU {100 * scalars['mfu']:.1f} %"
    tqdm.write(line)
    for name, value in scalars.items() if writer is not None else ():
        writer.add_scalar(f"train/{name}", value, progress.global_step)
    loop.window = LogWindow()
    return means


def train_summary(plan, progress, loop):
    """The Trainer's train metrics: loss and FLOPs of every step since the run began, this process's speeds."""
    runtime, steps = time.perf_counter() - loop.started, progress.global_step - loop.first_step
    metrics = {
        "train_loss": progress.loss_sum / progress.global_step if steps else float("nan"),
        "train_runtime": runtime,
        "train_samples_per_second": steps * plan.train_batch_size / runtime,
        "train_steps_per_second": steps / runtime,
        "train_tokens_per_second": loop.tokens / runtime,
        "epoch": progress.global_step / plan.steps_per_epoch,
        "global_step": progress.global_step,
        "train_samples": plan.num_train_examples or None,  # None: a stream has no length
        "global_batch_size": plan.train_batch_size,
        "num_devices": plan.num_devices,
        "total_flos": loop.flops * progress.global_step if loop.flops else None,
    }
    speed = f"{metrics['train_tokens_per_second']:.0f} tokens/s, compiling and evaluating included"
    logger.info(f"Trained {steps} steps in {runtime:.1f} s ({speed})")
    return metrics


# --- checkpoints and results -------------------------------------------------------------------------------------
# A checkpoint-N folder is a model, as the Trainer's: config.json, the weights and the tokenizer in from_pretrained
# form (save_model's: what from_pretrained, --model_name_or_path and flax/export_to_pytorch.py read), beside Orbax's
# items: state (step, params, opt_state) and trainer_state (JSON: the progress, what a resume checks against, the best
# checkpoint so far, the format, and a digest of the arrays, the JSON and the model's files). Format 1 (an earlier
# release) held neither digest nor model, format 2 no model: both still resume, and evaluate.
CHECKPOINT_FORMAT = 3


class CheckpointNames(ocp.step.NameFormat):
    """Orbax's step folders under the Trainer's name, checkpoint-N; only complete ones (renamed when done) found."""

    def build_name(self, step):
        return f"checkpoint-{step}"

    def find_all(self, base_path):
        for path in Path(base_path).glob("checkpoint-*") if os.path.isdir(base_path) else []:
            if re.fullmatch(r"checkpoint-\d+", path.name) and complete_checkpoint(path):
                yield ocp.step.Metadata(step=int(path.name.split("-")[1]), path=epath.Path(path))

    def find_step(self, base_path, step):
        path = Path(base_path) / self.build_name(step)
        if not complete_checkpoint(path):
            raise ValueError(f"{path} is not a complete checkpoint")
        return ocp.step.Metadata(step=step, path=epath.Path(path))


def complete_checkpoint(path):
    return ocp.utils.is_checkpoint_finalized(path) and os.path.isdir(os.path.join(path, "trainer_state"))


def last_saved_first(directory):
    """The complete checkpoint-N folders of `directory`, the last saved first (by Orbax's commit time): after a branch
    from an earlier checkpoint, the branch's own, whatever their numbers."""

    def saved_at(path):
        with contextlib.suppress(OSError, ValueError):
            return json.loads((path / "_CHECKPOINT_METADATA").read_text())["commit_timestamp_nsecs"]
        return (path / "_CHECKPOINT_METADATA").stat().st_mtime_ns

    found = [Path(m.path) for m in CheckpointNames().find_all(directory)]
    return [str(path) for path in sorted(found, key=lambda path: (saved_at(path), path.name), reverse=True)]


def checkpoint_manager(directory, writes=False):
    """Orbax's CheckpointManager of the checkpoint-N folders of `directory` (train state, progress as JSON); one
    that writes first removes what a killed run left incomplete. It deletes nothing itself: drop_old_checkpoints."""
    handlers = {"state": ocp.StandardCheckpointHandler(), "trainer_state": ocp.JsonCheckpointHandler()}
    options = dict(step_name_format=CheckpointNames(), create=writes, cleanup_tmp_directories=writes)
    options = ocp.CheckpointManagerOptions(**options, enable_async_checkpointing=False, save_root_metadata=False)
    return ocp.CheckpointManager(os.path.abspath(directory), item_handlers=handlers, options=options)  # absolute only


def find_checkpoint(training_args, model_args):
    """The checkpoints to resume from (with --do_eval alone: to evaluate), the last saved first, or None; refuses an
    output_dir that holds another run's files."""
    output_dir, resume = training_args.output_dir, (training_args.resume_from_checkpoint or "false").lower()
    complete = last_saved_first(output_dir)
    for path in Path(output_dir).glob("checkpoint-*") if os.path.isdir(output_dir) else []:
        if not ocp.utils.is_checkpoint_finalized(path):
            logger.warning(f"skipping {path}: an incomplete checkpoint (a run was stopped while writing it)")
    checkpoints = None
    if resume not in ("true", "false"):
        path = training_args.resume_from_checkpoint
        if not (re.fullmatch(r"checkpoint-\d+", Path(path).name) and complete_checkpoint(path)):
            if inside := last_saved_first(path):  # a run's own folder, given where one of its checkpoints is meant
                fail(
                    f"--resume_from_checkpoint {path} is a run's folder: name one of its checkpoints ({inside[0]}), "
                    f"or pass the flag alone with --output_dir {path}"
                )
            fail(f"--resume_from_checkpoint {path} is not a complete checkpoint-N folder written by this script")
        checkpoints = [path]
    elif resume == "true":
        checkpoints = complete or fail(
            f"--resume_from_checkpoint: {output_dir} holds no complete checkpoint-N folder; "
            "drop the flag to start afresh"
        )
    if (checkpoints and training_args.do_train) or training_args.overwrite_output_dir or not os.path.isdir(output_dir):
        return checkpoints
    if training_args.do_train and complete:
        fail(
            f"{output_dir} holds a run's checkpoints, the last saved {complete[0]}: add --resume_from_checkpoint to "
            "continue it, or start afresh in another --output_dir"
        )
    if training_args.do_train and set(os.listdir(output_dir)) - {".lock", "noised_examples.jsonl"}:
        fail(f"output directory {output_dir} is not empty; pass --overwrite_output_dir to write into it")
    results = [name for name in ("eval_results.json", "train_results.json") if os.path.exists(f"{output_dir}/{name}")]
    model = model_args.model_name_or_path
    own_model = model is not None and os.path.realpath(model) == os.path.realpath(output_dir)
    if results and (results[0] == "eval_results.json" or not own_model):
        fail(
            f"{output_dir} already holds another evaluation's or model's results ({results[0]}); pass "
            "--overwrite_output_dir to replace those files (an evaluation deletes nothing else), or choose another "
            "--output_dir"
        )
    return checkpoints


def open_checkpoints(run, state, progress, fresh_start):
    """The manager this run saves with, once the disk has room for its first checkpoint (checked before Orbax's
    threads start: a refusal leaves none behind). A fresh run into a used output_dir (--overwrite_output_dir) first
    removes the earlier run's checkpoints and results, so that no later resume can pick one and no result file mixes
    two runs; a run resumed from before output_dir's last checkpoints sets those apart (set_aside)."""
    training_args = run.args
    first = min(
        run.plan.total_steps, (progress.global_step // training_args.save_steps + 1) * training_args.save_steps
    )
    earlier = Path(training_args.output_dir).glob("checkpoint-*/**/*") if fresh_start else ()  # removed below
    path = os.path.join(training_args.output_dir, f"checkpoint-{first}")
    check_free_space(state, progress, run, path, sum(f.stat().st_size for f in earlier if f.is_file()))
    if not fresh_start:
        set_aside(training_args.output_dir, progress.global_step)
    manager = checkpoint_manager(training_args.output_dir, writes=True)
    for leftover in Path(training_args.output_dir).glob(".tmp-save-*"):  # from a save killed midway
        shutil.rmtree(leftover)
    for step in manager.all_steps() if fresh_start else []:
        logger.warning(f"--overwrite_output_dir: removing checkpoint-{step} of an earlier run")
        manager.delete(step)
    for name in ("train_results.json", "eval_results.json", "all_results.json") if fresh_start else ():
        with contextlib.suppress(FileNotFoundError):  # an earlier run's: they would merge into this run's
            os.remove(os.path.join(training_args.output_dir, name))
    return manager


def set_aside(output_dir, step):
    """A run resumed at `step`, before checkpoints of output_dir with later steps (a branch from an earlier
    checkpoint), moves those whole into a folder of their own: each is still a model, and resumable by its path. Left
    in place, the branch would replace them as it passed their steps, and --save_total_limit would count them."""
    later = sorted((int(Path(path).name.split("-")[1]), path) for path in last_saved_first(output_dir))
    later = [path for saved_step, path in later if saved_step > step]
    if not later:
        return
    if jax.process_index() == 0:
        aside = tempfile.mkdtemp(prefix=f"set-aside-{datetime.datetime.now():%Y%m%d-%H%M%S}-", dir=output_dir)
        for path in later:
            os.replace(path, os.path.join(aside, os.path.basename(path)))
        names = ", ".join(os.path.basename(path) for path in later)
        logger.warning(f"resuming at step {step}, before {names} of the run it left: those moved, whole, to {aside}")
    multihost_utils.sync_global_devices("set_aside")


def save_checkpoint(state, progress, run, last_eval=None):
    """checkpoint-{step} (train state, data position, the model in from_pretrained form), the model in output_dir and
    the hub repository updated, then the checkpoints beyond --save_total_limit dropped (never the best); returns its
    path. `last_eval` ((step, metrics), the latest evaluation) names the best checkpoint, --load_best_model_at_end."""
    path = os.path.join(run.args.output_dir, f"checkpoint-{progress.global_step}")
    track_best(progress, path, run.args, last_eval)
    try:
        check_savable(state, progress, run, path)
        staged = stage_model(state.params["model"], run)
        write_checkpoint(state, progress, run, staged)
        export_model(staged, run)
    except (OSError, ValueError) as e:  # a full disk, a quota, a vanished folder; Orbax wraps some in ValueError
        if runtime_failed(e):
            raise
        advice = "Free some space, then resume" if "space" in str(e).lower() else "Fix that, then resume"
        fail(f"cannot write {path}: {first_line(e)}; {last_intact(progress)}. {advice} with --resume_from_checkpoint")
    if jax.process_index() == 0 and run.hub is not None:
        api, repo_id, token = run.hub
        message = f"Saving weights and logs of step {progress.global_step}"
        api.upload_folder(repo_id=repo_id, folder_path=run.args.output_dir, commit_message=message, token=token)
    drop_old_checkpoints(run, progress, path)
    return path


def track_best(progress, path, args, last_eval):
    """With --load_best_model_at_end: `path` becomes progress's best checkpoint (the Trainer's best_metric and
    best_model_checkpoint, saved in trainer_state) where the evaluation at its step is better than the best so far."""
    if not args.load_best_model_at_end or last_eval is None or last_eval[0] != progress.global_step:
        return
    metric, greater = best_metric(args)
    if metric not in last_eval[1]:
        fail(
            f"--metric_for_best_model {args.metric_for_best_model}: the evaluation has no {metric}; choose one of "
            + ", ".join(name for name in last_eval[1] if name.startswith("eval_"))
        )
    value, best = last_eval[1][metric], progress.best_metric
    if best is None or (value > best if greater else value < best):
        progress.best_metric, progress.best_model_checkpoint = value, path


def best_metric(args):
    """--metric_for_best_model as its key in the evaluation's results (the Trainer's default: loss), and whether a
    larger value is better (the Trainer's default: unless it is a loss)."""
    name = args.metric_for_best_model or "loss"
    name = name if name.startswith("eval_") else f"eval_{name}"
    return name, args.greater_is_better if args.greater_is_better is not None else not name.endswith("loss")


def drop_old_checkpoints(run, progress, path):
    """Removes the checkpoints beyond the newest --save_total_limit, but the best; a removal that fails warns (the new
    checkpoint is whole), and training goes on."""
    limit, best = run.args.save_total_limit, progress.best_model_checkpoint
    for step in sorted(run.checkpoints.all_steps())[:-limit] if limit else []:
        old = os.path.join(run.args.output_dir, f"checkpoint-{step}")
        if best is None or os.path.abspath(old) != os.path.abspath(best):
            try:
                run.checkpoints.delete(step)
            except OSError as e:
                logger.warning(
                    f"{path} is saved; removing {old}, beyond --save_total_limit {limit}, failed: {first_line(e)}"
                )


def last_intact(progress):
    last = progress.last_checkpoint
    if last and complete_checkpoint(last):
        return f"the last complete checkpoint, {last}, is intact"
    return "no checkpoint of this run is left complete"


def check_savable(state, progress, run, path):
    """Stops before writing a non-finite state or onto a disk without room for the checkpoint and the model's weights
    (Orbax's writer threads do not stop on a full disk); drops a damaged checkpoint of this step, skipped on resume."""
    if progress.global_step in run.checkpoints.all_steps():
        run.checkpoints.delete(progress.global_step)
    if not all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(state.params)):
        stop_diverged(progress.global_step, "the parameters are no longer finite", progress)
    check_free_space(state, progress, run, path)


def check_free_space(state, progress, run, path, freed=0):
    """Stops where the disk lacks room for checkpoint `path` (the model's weights twice: in it and in output_dir),
    before training (with `freed` bytes about to be removed) and before each save (Orbax's writer threads do not stop
    on a full disk)."""
    model = state.params["model"]
    needed = sum(x.nbytes for x in jax.tree_util.tree_leaves((state.params, state.opt_state, model, model)))
    if (free := shutil.disk_usage(run.args.output_dir).free + freed) < 1.1 * needed + (1 << 20):
        fail(
            f"cannot write {path}: it needs about {needed / 2**20:.1f} MB and the disk has {free / 2**20:.1f} MB "
            f"free; {last_intact(progress)}. Free some space (or use --save_total_limit), then "
            + ("resume with --resume_from_checkpoint" if progress.last_checkpoint else "run again")
        )


def write_checkpoint(state, progress, run, staged):
    """Orbax's checkpoint-{step}: the train state, and as JSON the progress, what a resume checks against and a digest
    of it all; then the model's files (`staged`, stage_model's folder: process 0's) copied in beside them."""
    trainer_state = {k: v for k, v in vars(progress).items() if k != "last_checkpoint"}
    trainer_state.update(stream=progress.stream and gather_json(progress.stream), objective=run.objective)
    trainer_state.update(data=run.data, schedule=[run.plan.total_steps, run.args.warmup_steps, run.args.learning_rate])
    trainer_state["format"] = CHECKPOINT_FORMAT
    arrays = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
    model = {name: file_digest(os.path.join(staged, name)) for name in files_under(staged)} if staged else {}
    trainer_state["digest"] = {"state": state_digest(arrays), "model": model}
    trainer_state["digest"]["trainer_state"] = json_digest(trainer_state)
    save = ocp.args.Composite(state=ocp.args.StandardSave(arrays), trainer_state=ocp.args.JsonSave(trainer_state))
    run.checkpoints.save(progress.global_step, args=save, force=True)
    if staged:
        copy_model(staged, os.path.join(run.args.output_dir, f"checkpoint-{progress.global_step}"))


def copy_model(staged, path):
    """stage_model's files copied into checkpoint `path`, each under its own name only once whole: a run stopped
    between Orbax's save and the last file leaves files missing, which a resume writes again (restore_checkpoint).
    Copies, not links: a model written over output_dir's in place must not change the checkpoint's."""

    def whole(source, target):
        shutil.copy2(source, f"{target}.tmp")
        os.replace(f"{target}.tmp", target)

    shutil.copytree(staged, path, copy_function=whole, dirs_exist_ok=True)


def files_under(folder):
    return sorted(str(path.relative_to(folder)) for path in Path(folder).rglob("*") if path.is_file())


def file_digest(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def state_digest(arrays):
    """{path: 16 hex digits} for every array of the train state: two sums of its bits times odd weights of their
    positions, modulo 2**32 (exact, so the same on any mesh and process count), computed where the arrays are. Any
    one flipped bit changes both; a file changed after its save is found on resume."""
    leaves = jax.tree_util.tree_flatten_with_path(arrays)[0]
    sums = np.asarray(bit_sums([leaf for _, leaf in leaves]).addressable_data(0))
    return {jax.tree_util.keystr(key): f"{a:08x}{b:08x}" for (key, _), (a, b) in zip(leaves, sums.tolist())}


@jax.jit
def bit_sums(leaves):
    def sums(x):
        bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}")).astype(jnp.uint32).ravel()
        position = jnp.arange(bits.size, dtype=jnp.uint32)
        weights = [2 * position * jnp.uint32(weight) + 1 for weight in (0x9E3779B1, 0x85EBCA77)]
        return jnp.stack([jnp.sum(bits * weight) for weight in weights])

    return jnp.stack([sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def json_digest(trainer_state):
    """sha256 of the trainer state (the data position, progress and settings; from format 3 the digests of the arrays
    and the model's files too), all but this digest itself."""
    kept = {k: v for k, v in trainer_state.items() if k != "digest"}
    if trainer_state.get("format", 2) >= 3:
        kept["digest"] = {k: v for k, v in trainer_state["digest"].items() if k != "trainer_state"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def check_digest(restored, path):
    """ValueError naming the first part of a restored checkpoint that differs from the digest written with it. One of
    an earlier release without a digest (format 1) is read with a warning: only what stops its reading is found."""
    trainer_state = restored["trainer_state"]
    saved = trainer_state.get("digest")
    version = trainer_state.get("format", 1 if saved is None else 2)
    if version > CHECKPOINT_FORMAT:
        fail(
            f"{path} was written by a later release of this script (checkpoint format {version}; this copy reads up "
            f"to {CHECKPOINT_FORMAT}): update the script to use it"
        )
    if saved is None:
        logger.warning(f"{path} was written by an earlier release, without a digest: it is read unverified")
        return
    if json_digest(trainer_state) != saved["trainer_state"]:
        raise ValueError("trainer_state differs from the digest written with it: the file changed after the save")
    # A namedtuple's field (an optimizer state's, as training holds it) and a dict's key (as read without a target)
    # are the same array: one name for both, [0].count as [0]['count'].
    canonical = functools.partial(re.sub, r"\.(\w+)", r"['\1']")
    expected = {canonical(name): digest for name, digest in saved["state"].items()}
    for name, digest in state_digest(restored["state"]).items():
        if expected.get(canonical(name)) != digest:
            raise ValueError(f"state{name} differs from the digest written with it: the file changed after the save")
    for name, digest in saved.get("model", {}).items():  # a missing one is written again: restore_checkpoint
        if os.path.isfile(os.path.join(path, name)) and file_digest(os.path.join(path, name)) != digest:
            raise ValueError(f"the model's {name} differs from the digest written with it: it changed after the save")


def stage_model(params, run):
    """The model (save_model) and tokenizer in from_pretrained form, in a folder of this run's own in output_dir, for
    the checkpoint and export_model; process 0's (None on the others), every process taking part in the gather."""
    params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() != 0:
        return None
    staged = tempfile.mkdtemp(prefix=".tmp-save-", dir=run.args.output_dir)
    save_model(run.model, params, staged)
    run.tokenizer.save_pretrained(staged)
    return staged


def export_model(staged, run):
    """stage_model's files moved into output_dir, so that a crash mid-save leaves the last export whole."""
    if staged is None:
        return
    output_dir = run.args.output_dir
    for name in os.listdir(staged):
        if os.path.isdir(os.path.join(output_dir, name)):  # a folder of an earlier save (a second model's)
            shutil.rmtree(os.path.join(output_dir, name))
        os.replace(os.path.join(staged, name), os.path.join(output_dir, name))
    os.rmdir(staged)


def gather_json(value):
    """Every process's `value` (JSON-serialisable), in process order."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    size = int(np.max(multihost_utils.process_allgather(np.int32(len(data)))))
    rows = multihost_utils.process_allgather(np.pad(data, (0, size - len(data)), constant_values=ord(" ")))
    return [json.loads(bytes(row)) for row in rows]


def restore_checkpoint(paths, abstract_state, run):
    """The state and progress of the first of `paths` that restores (a damaged one is skipped, unless named): to
    resume, checked against this run (check_resume); with --do_eval alone, its parameters only, to evaluate."""
    target = {"params": abstract_state.params}
    if run.args.do_train:
        target.update(step=abstract_state.step, opt_state=abstract_state.opt_state)
    for path in paths:
        try:
            arrays, saved = read_checkpoint(path, target)
            break
        except ValueError as e:
            if len(paths) == 1 and (run.args.resume_from_checkpoint or "").lower() != "true":
                fail(f"--resume_from_checkpoint {path} is damaged: {e}; name another checkpoint, or start afresh")
            logger.warning(f"skipping {path}: damaged ({e})")
    else:
        fail(
            f"no checkpoint in {run.args.output_dir} can be restored (each is damaged, above); start afresh in "
            "another --output_dir, or with --overwrite_output_dir, which removes them"
        )
    if missing := [name for name in saved.get("digest", {}).get("model", {}) if not os.path.exists(f"{path}/{name}")]:
        logger.warning(f"{path}: the run stopped before its model was whole ({missing[0]}): written from its state")
        rewrite_model(arrays["params"]["model"], path, run)
    names = ("global_step", "epoch", "batch_in_epoch", "log_window", "loss_sum", "stream")
    progress = TrainingProgress(**{k: saved[k] for k in names}, last_checkpoint=path)
    progress.best_metric, progress.best_model_checkpoint = saved.get("best_metric"), saved.get("best_model_checkpoint")
    if not run.args.do_train:
        logger.info(f"Evaluating the model of step {progress.global_step} from {path}")
        return abstract_state.replace(params=arrays["params"]), progress
    check_resume(path, saved, progress, run)
    return abstract_state.replace(**arrays), progress


def rewrite_model(params, path, run):
    """The model's files of checkpoint `path` written again from its parameters (its digest already checked them)."""
    staged = stage_model(params, run)
    if staged is not None:
        copy_model(staged, path)
        shutil.rmtree(staged)


def check_resume(path, saved, progress, run):
    """A resume of checkpoint `path` is refused where its data position means nothing here (unless
    --ignore_data_skip) or it has nothing left to train; other objective settings or schedule warn."""
    plan = run.plan
    progress.stream = progress.stream and progress.stream[plan.process_index]  # every process's position is saved
    changed = ", ".join(f"{k} {v} -> {run.data.get(k)}" for k, v in saved["data"].items() if run.data.get(k) != v)
    if changed and not run.args.ignore_data_skip:
        fail(
            f"{path} was written for other data ({changed}), so its data position means nothing here; resume with the "
            "data, tokenizer, length, seed, global batch and resume_checks that wrote it, "
            "or add --ignore_data_skip to start its epoch afresh"
        )
    if changed:
        logger.warning(f"--ignore_data_skip: {path} was written for other data ({changed}); starting its epoch afresh")
        progress.batch_in_epoch, progress.stream = 0, None
    objective = run.objective
    if changed := [f"--{k} {v} -> {objective.get(k)}" for k, v in saved["objective"].items() if objective.get(k) != v]:
        logger.warning(
            f"{path} was written with other objective settings; going on with this run's: {', '.join(changed)}"
        )
    schedule = [plan.total_steps, run.args.warmup_steps, run.args.learning_rate]
    if saved["schedule"] != schedule:
        logger.warning(
            f"{path} was written for another learning-rate schedule (steps, warm-up steps, peak: "
            f"{saved['schedule']} -> {schedule}): the rate at step {progress.global_step} changes at once"
        )
    if progress.global_step >= plan.total_steps:
        fail(
            f"{path} is at step {progress.global_step} and this run ends at step {plan.total_steps}: "
            "nothing left to train, every file left as it was; raise --max_steps or --num_train_epochs to train on, "
            f"or evaluate it with --do_eval alone"
        )
    logger.info(f"Resuming at step {progress.global_step} from {path}")


def read_checkpoint(path, target=None):
    """The arrays of checkpoint `path` ({"step", "params", "opt_state"}) and its trainer state, checked against its
    digest: what a resume, an evaluation, a copy or a notebook reads (flax/compare_checkpoints.py compares two). Any of
    the three in `target` (shapes with shardings, as build_train_state(abstract=True) gives) is placed so, on any mesh;
    the others, or all without it, each whole on this process's first device (a laptop's one CPU). ValueError names a
    damaged part; parameters of other shapes than target's are refused."""
    manager, step = checkpoint_manager(os.path.dirname(os.path.abspath(path))), int(Path(path).name.split("-")[1])
    parts = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt", "trainer_state/metadata")
    if missing := [part for part in parts if not os.path.isfile(os.path.join(path, part))]:
        raise ValueError(f"{missing[0]} is missing")
    try:
        with quiet_closed_loop_tracebacks(), contextlib.closing(manager):
            stored = manager.item_metadata(step)["state"]
            if target and "params" in target:
                check_shapes(path, stored["params"], target["params"])
            whole = functools.partial(jax.ShapeDtypeStruct, sharding=SingleDeviceSharding(jax.local_devices()[0]))
            target = {
                name: target[name]
                if target and name in target
                else jax.tree.map(lambda m: whole(m.shape, m.dtype), tree)
                for name, tree in stored.items()
            }
            restore = ocp.args.Composite(state=ocp.args.StandardRestore(target), trainer_state=ocp.args.JsonRestore())
            restored = manager.restore(step, args=restore)
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many kinds on damaged files
        raise ValueError(f"{type(e).__name__}: {first_line(e)}") from None
    check_digest(restored, path)
    return restored["state"], restored["trainer_state"]


def check_shapes(path, stored, params):
    """Refuses a checkpoint whose parameters (`stored`, Orbax's metadata) have other names or shapes than `params`."""
    stored = dict(jax.tree_util.tree_flatten_with_path(stored)[0])
    for key, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if key not in stored or tuple(stored[key].shape) != tuple(leaf.shape):
            there = "missing" if key not in stored else tuple(stored[key].shape)
            fail(
                f"{path} holds a model of another shape: {jax.tree_util.keystr(key)} is {there} there and "
                f"{tuple(leaf.shape)} here; use the config that wrote it, or start afresh in another --output_dir"
            )


@contextlib.contextmanager
def quiet_closed_loop_tracebacks():
    """Holds sys.stderr back while a checkpoint is read, then passes it on without the tracebacks TensorStore prints
    when a damaged file stops Orbax's restore: each read still in flight reports into Orbax's closed event loop."""
    real, sys.stderr, size = sys.stderr, io.StringIO(), -1
    try:
        yield
    except Exception:
        while size != len(sys.stderr.getvalue()):  # until the late ones stop: half a second without one
            size = len(sys.stderr.getvalue())
            time.sleep(0.5)
        raise
    finally:
        held, sys.stderr = sys.stderr.getvalue().splitlines(keepends=True), real
        noise = re.compile(r"Traceback \(most recent call last\)|asyncio|_check_closed|Event loop is closed|^\s*$")
        real.write("".join(line for line in held if not noise.search(line)))


def write_results(output_dir, split, metrics, merge=True):
    """{split}_results.json and all_results.json as the Trainer writes them: atomically, non-finite as null."""
    all_results = os.path.join(output_dir, "all_results.json")
    merged = json.loads(Path(all_results).read_text()) if merge and os.path.exists(all_results) else {}
    for path, values in ((f"{output_dir}/{split}_results.json", metrics), (all_results, {**merged, **metrics})):
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
        if jax.process_index() == 0:
            Path(f"{path}.tmp").write_text(json.dumps(clean, indent=4, sort_keys=True))
            os.replace(f"{path}.tmp", path)


def open_summary_writer(training_args):
    """TensorBoard events in output_dir/runs/<date>_<host>, the Trainer's folder: a rerun never merges into another."""
    if training_args.report_to == "none" or jax.process_index() != 0:
        return None
    hidden = sys.modules.setdefault("torch", None) is None  # tensorboardX imports torch (1 s) only for its tensors
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        logger.warning("tensorboardX is not installed: no TensorBoard logs (pip install -r requirements.txt)")
        return None
    finally:
        if hidden:
            del sys.modules["torch"]
    run_name = f"{datetime.datetime.now():%b%d_%H-%M-%S}_{socket.gethostname()}"
    return SummaryWriter(logdir=os.path.join(training_args.output_dir, "runs", run_name))


def open_hub_repo(training_args):
    """(api, repo id, token) of the repository --push_to_hub uploads to (validate_args checked the hub answers)."""
    if not training_args.push_to_hub or jax.process_index() != 0:
        return None
    from huggingface_hub import HfApi

    repo_name = training_args.hub_model_id or Path(training_args.output_dir).absolute().name
    try:
        repo_id = HfApi().create_repo(repo_name, exist_ok=True, token=training_args.hub_token).repo_id
    except Exception as e:  # noqa: BLE001
        fail(f"--push_to_hub: cannot create the hub repository {repo_name!r}: {first_line(e)}")
    return HfApi(), repo_id, training_args.hub_token


if __name__ == "__main__":
    main()
