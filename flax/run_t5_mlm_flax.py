#!/usr/bin/env python
# Reproduction of Hugging Face's examples/flax/language-modeling/run_t5_mlm_flax.py (Apache-2.0 upstream),
# rewritten for transformers 4.57.6 / jax 0.9.2 / flax 0.12.6, offline by default.
"""Pretrain T5 with span corruption (the T5 paper's denoising objective) in Flax, data parallel.

Span corruption as T5: texts are packed into blocks of the "expanded" length that, after corruption,
gives exactly --max_seq_length input tokens (compute_input_and_target_lengths); in each block
--mlm_probability of the tokens (the noise density) are chosen as random spans of mean length
--mean_noise_span_length; every span is replaced by one sentinel in the input, the target lists the
spans behind their sentinels; sentinel ids count down from len(tokenizer) - 1; EOS ends both; decoder
inputs are the targets shifted right. Reports loss and token accuracy.

Differences from upstream, all fixes (the same as run_mlm_flax.py where they apply): working
defaults for --eval_steps (every epoch) and --max_seq_length (the tokenizer's maximum, 512 for T5);
no training loop without --do_train; multi-host feeds each process its own slice of the global batch
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); evaluation covers every example and
draws each example's spans from (seed, index), so it is the same whatever the batching; linear-time
group_texts; hub names only when given, failing at once offline; atomic checkpoints; TensorBoard via
tensorboardX; --max_steps and fractional epochs. The tokenizer of tokenizers/train_tokenizer.py
--tokenizer_type unigram carries 100 sentinel tokens above its vocabulary, so sentinels never
overwrite real words (upstream's README tokenizer has none, and its sentinel ids are real pieces).

``--dtype bfloat16`` computes every dense layer, forward and backward, as a bf16 x bf16 product with f32
accumulation on an f32 model: upstream's bf16 model dtype is slower than f32 on CPUs (see bf16_dense).
The backward pass recomputes the activations' transcendental functions instead of storing them.

Example (local files, see README.md):
  python flax/run_t5_mlm_flax.py --output_dir out/t5/run --model_type t5 --config_name out/t5 \
      --tokenizer_name out/t5 --train_file data/ptb/train.txt --validation_file data/ptb/validation.txt \
      --max_seq_length 128 --per_device_train_batch_size 16 --adafactor --learning_rate 5e-3 \
      --warmup_steps 100 --num_train_epochs 1 --do_train --do_eval
"""

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from itertools import chain
from pathlib import Path
from typing import Optional

# This script never uses TensorFlow, but transformers imports it (about 3 s) to test whether a
# tensor is a TF tensor when both are installed. USE_TF=1 in the environment still overrides.
os.environ.setdefault("USE_TF", "0")

import numpy as np
from tqdm import tqdm

import datasets
from datasets import load_dataset

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import jax_utils, traverse_util
from flax.training import train_state
from flax.training.common_utils import shard
from jax import lax
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoTokenizer,
    FlaxT5ForConditionalGeneration,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    set_seed,
)

logger = logging.getLogger(__name__)

MODEL_TYPES = ("t5",)


@dataclass
class TrainingArguments:
    output_dir: str = field(metadata={"help": "Where the model, checkpoints, logs and results are written."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Write into a non-empty output_dir."})
    do_train: bool = field(default=False, metadata={"help": "Whether to run training."})
    do_eval: bool = field(default=False, metadata={"help": "Whether to run eval on the dev set."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Batch size per device for training."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Batch size per device for evaluation."})
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
    save_steps: int = field(default=500, metadata={"help": "Save checkpoint every X updates steps."})
    eval_steps: Optional[int] = field(default=None, metadata={"help": "Run an evaluation every X steps (default: every epoch)."})
    seed: int = field(default=42, metadata={"help": "Random seed that will be set at the beginning of training."})
    push_to_hub: bool = field(default=False, metadata={"help": "Whether or not to upload the trained model to the model hub after training."})
    hub_model_id: str = field(default=None, metadata={"help": "The name of the repository to keep in sync with the local `output_dir`."})
    hub_token: str = field(default=None, metadata={"help": "The token to use to push to the Model Hub."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Use gradient checkpointing to save memory at the expense of slower backward pass."})

    def __post_init__(self):
        if self.output_dir is not None:
            self.output_dir = os.path.expanduser(self.output_dir)

    def to_dict(self):
        """Serializes this instance, replacing Enums by their values and hiding tokens."""
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, Enum):
                d[k] = v.value
            if k.endswith("_token"):
                d[k] = f"<{k.upper()}>"
        return d


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "The model checkpoint for weights initialization. Don't set if you want to train a model from scratch."})
    model_type: Optional[str] = field(default=None, metadata={"help": "If training from scratch, pass a model type from the list: " + ", ".join(MODEL_TYPES)})
    config_name: Optional[str] = field(default=None, metadata={"help": "Pretrained config name or path if not the same as model_name"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Pretrained tokenizer name or path if not the same as model_name"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Where do you want to store the pretrained models downloaded from s3"})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Whether to use one of the fast tokenizer (backed by the tokenizers library) or not."})
    dtype: Optional[str] = field(default="float32", metadata={"help": "Floating-point format in which the model weights should be initialized and trained. Choose one of `[float32, float16, bfloat16]`."})
    token: str = field(default=None, metadata={"help": "The token to use as HTTP bearer authorization for remote files."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Whether to trust the execution of code from datasets/models defined on the Hub."})


@dataclass
class DataTrainingArguments:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "The name of the dataset to use (via the datasets library)."})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "The configuration name of the dataset to use (via the datasets library)."})
    train_file: Optional[str] = field(default=None, metadata={"help": "The input training data file (a text, csv or json file)."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "An optional input evaluation data file to evaluate the perplexity on (a text file)."})
    train_ref_file: Optional[str] = field(default=None, metadata={"help": "Accepted as upstream; not used."})
    validation_ref_file: Optional[str] = field(default=None, metadata={"help": "Accepted as upstream; not used."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Overwrite the cached training and evaluation sets"})
    validation_split_percentage: Optional[int] = field(default=5, metadata={"help": "The percentage of the train set used as validation set in case there's no validation split"})
    max_seq_length: Optional[int] = field(default=None, metadata={"help": "The input length after span corruption (default: the tokenizer's maximum)."})
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={"help": "The number of processes to use for the preprocessing."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Ratio of tokens to mask for span masked language modeling loss"})
    mean_noise_span_length: float = field(default=3.0, metadata={"help": "Mean span length of masked tokens"})


def fail(message):
    """One line on stderr naming what is wrong and what to do, and a non-zero exit."""
    sys.exit(f"run_t5_mlm_flax.py: error: {message}")


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


def validate_args(model_args, data_args, training_args):
    if data_args.dataset_name is None and data_args.train_file is None and data_args.validation_file is None:
        fail("need --dataset_name or --train_file/--validation_file")
    for flag, path in (("--train_file", data_args.train_file), ("--validation_file", data_args.validation_file)):
        if path is None:
            continue
        extension = path.split(".")[-1]
        if extension not in ("csv", "json", "txt"):
            fail(f"{flag} {path}: unsupported extension .{extension}; use a .txt, .csv or .json file")
        if not os.path.isfile(path):
            fail(f"{flag} {path} does not exist")
        with open(path, "rb") as f:
            if not f.read(1 << 20).strip():
                fail(f"{flag} {path} is empty")
    if data_args.train_file and data_args.validation_file:
        extensions = {path.split(".")[-1] for path in (data_args.train_file, data_args.validation_file)}
        if len(extensions) > 1:
            fail(f"--train_file and --validation_file must have the same extension (one loader reads both), got {sorted(extensions)}")
    if not 0.0 < data_args.mlm_probability < 1.0:
        fail(f"--mlm_probability (the noise density) must be in (0, 1), got {data_args.mlm_probability}")
    if data_args.mean_noise_span_length < 1.0:
        fail(f"--mean_noise_span_length must be at least 1, got {data_args.mean_noise_span_length}")
    if not training_args.do_train and not training_args.do_eval:
        fail("nothing to do: pass --do_train and/or --do_eval")
    for flag in ("per_device_train_batch_size", "per_device_eval_batch_size", "logging_steps", "save_steps"):
        if getattr(training_args, flag) <= 0:
            fail(f"--{flag} must be a positive integer, got {getattr(training_args, flag)}")
    if training_args.eval_steps is not None and training_args.eval_steps <= 0:
        fail(f"--eval_steps must be a positive integer, got {training_args.eval_steps}")
    if model_args.dtype not in ("float32", "float16", "bfloat16"):
        fail(f"--dtype must be one of float32, float16, bfloat16, got {model_args.dtype!r}")
    if model_args.model_type is not None and model_args.model_type not in MODEL_TYPES:
        fail(f"--model_type {model_args.model_type!r} is not t5: this script trains T5")
    output_dir = training_args.output_dir
    if os.path.isdir(output_dir) and os.listdir(output_dir) and training_args.do_train and not training_args.overwrite_output_dir:
        fail(f"output directory {output_dir} is not empty; pass --overwrite_output_dir to write into it")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        fail(f"--output_dir {output_dir} exists and is not a directory")
    if training_args.push_to_hub and not hub_reachable():
        fail(f"--push_to_hub: the Hugging Face Hub is unreachable (offline?); drop --push_to_hub and upload "
             f"{output_dir} later")
    check_hub_name("--dataset_name", data_args.dataset_name)
    for flag in ("model_name_or_path", "config_name", "tokenizer_name"):
        check_hub_name(f"--{flag}", getattr(model_args, flag))


def compute_input_and_target_lengths(inputs_length, noise_density, mean_noise_span_length):
    """The token count to cut blocks at so that, after span corruption, the inputs have exactly
    inputs_length tokens; and the resulting targets length. As T5's random_spans_helper."""

    def _tokens_length_to_inputs_length_targets_length(tokens_length):
        num_noise_tokens = int(round(tokens_length * noise_density))
        num_nonnoise_tokens = tokens_length - num_noise_tokens
        # as random_spans_noise_mask counts them (the same as T5's for densities up to 0.5)
        num_noise_spans = max(int(round(min(num_noise_tokens, num_nonnoise_tokens) / mean_noise_span_length)), 1)
        # inputs: all non-noise tokens, a sentinel per noise span, EOS; targets: noise tokens, sentinels, EOS
        _input_length = num_nonnoise_tokens + num_noise_spans + 1
        _output_length = num_noise_tokens + num_noise_spans + 1
        return _input_length, _output_length

    tokens_length = inputs_length
    # With spans of about one token the inputs outgrow the block (a sentinel per noise token): shrink first.
    while tokens_length > 2 and _tokens_length_to_inputs_length_targets_length(tokens_length)[0] > inputs_length:
        tokens_length -= 1
    while _tokens_length_to_inputs_length_targets_length(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    found_inputs, targets_length = _tokens_length_to_inputs_length_targets_length(tokens_length)
    if found_inputs != inputs_length:
        raise ValueError(f"no block length gives exactly {inputs_length} inputs at noise density {noise_density} and "
                         f"mean span {mean_noise_span_length} (closest: {found_inputs})")
    # T5's hack to make targets as long as inputs when the density is 0.5. Upstream drops the token
    # unconditionally, after which the inputs can miss the requested length (e.g. 37 tokens at 0.5 with
    # spans of 1 gave 38 inputs and a ValueError); here it is dropped only when the inputs still fit.
    if noise_density == 0.5 and targets_length > inputs_length:
        shorter_inputs, shorter_targets = _tokens_length_to_inputs_length_targets_length(tokens_length - 1)
        if shorter_inputs == inputs_length:
            tokens_length, targets_length = tokens_length - 1, shorter_targets
    return tokens_length, targets_length


def shift_tokens_right(input_ids, pad_token_id, decoder_start_token_id):
    shifted = np.zeros_like(input_ids)
    shifted[:, 1:] = input_ids[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return np.where(shifted == -100, pad_token_id, shifted)


@dataclass
class FlaxDataCollatorForT5MLM:
    """T5 span corruption: blocks of expanded length become inputs of `input_length` and targets of
    `target_length` tokens (compute_input_and_target_lengths gives both)."""

    tokenizer: PreTrainedTokenizerBase
    noise_density: float
    mean_noise_span_length: float
    input_length: int
    target_length: int
    pad_token_id: int
    decoder_start_token_id: int

    def __call__(self, examples, rng, row_ids=None):
        """`examples`: a dict with equal-length `input_ids` rows. `rng`: a numpy Generator for the whole
        batch; or, with `row_ids`, an integer seed, each row's spans then drawn from (seed, row id)."""
        input_ids = np.asarray(examples["input_ids"], dtype=np.int64)
        batch_size, expanded_length = input_ids.shape
        rngs = [rng] * batch_size if row_ids is None else [np.random.default_rng([rng, int(i)]) for i in row_ids]
        mask_indices = np.asarray([self.random_spans_noise_mask(expanded_length, g) for g in rngs])
        labels_mask = ~mask_indices
        input_ids_sentinel = self.create_sentinel_ids(mask_indices.astype(np.int8))
        labels_sentinel = self.create_sentinel_ids(labels_mask.astype(np.int8))
        batch = {
            "input_ids": self.filter_input_ids(input_ids, input_ids_sentinel),
            "labels": self.filter_input_ids(input_ids, labels_sentinel),
        }
        if batch["input_ids"].shape[-1] != self.input_length:
            raise ValueError(f"inputs are {batch['input_ids'].shape[-1]} tokens, expected {self.input_length}")
        if batch["labels"].shape[-1] != self.target_length:
            raise ValueError(f"targets are {batch['labels'].shape[-1]} tokens, expected {self.target_length}")
        batch["decoder_input_ids"] = shift_tokens_right(batch["labels"], self.pad_token_id, self.decoder_start_token_id)
        return {k: v.astype(np.int32) for k, v in batch.items()}

    def create_sentinel_ids(self, mask_indices):
        """Sentinel ids at span starts (counting down from len(tokenizer) - 1), -1 at the rest of a
        span (removed later), 0 elsewhere."""
        start_indices = mask_indices - np.roll(mask_indices, 1, axis=-1) * mask_indices
        start_indices[:, 0] = mask_indices[:, 0]
        sentinel_ids = np.where(start_indices != 0, np.cumsum(start_indices, axis=-1), start_indices)
        sentinel_ids = np.where(sentinel_ids != 0, (len(self.tokenizer) - sentinel_ids), 0)
        sentinel_ids -= mask_indices - start_indices
        return sentinel_ids

    def filter_input_ids(self, input_ids, sentinel_ids):
        """Put sentinels in, drop the rest of each span, append EOS. Token ids >= 0 are kept, so a
        literal <pad> (id 0) in the text survives (upstream bugs #15443/#15835 dropped it)."""
        batch_size = input_ids.shape[0]
        input_ids_full = np.where(sentinel_ids != 0, sentinel_ids, input_ids)
        input_ids = input_ids_full[input_ids_full >= 0].reshape((batch_size, -1))
        eos = np.full((batch_size, 1), self.tokenizer.eos_token_id, dtype=input_ids.dtype)
        return np.concatenate([input_ids, eos], axis=-1)

    def random_spans_noise_mask(self, length, rng):
        """A boolean noise mask of `length` tokens: about noise_density of them noise, in spans of mean
        length mean_noise_span_length, alternating non-noise/noise and starting with non-noise."""
        num_noise_tokens = int(np.round(length * self.noise_density))
        num_nonnoise_tokens = length - num_noise_tokens
        num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)  # at least one of each
        num_noise_spans = int(np.round(min(num_noise_tokens, num_nonnoise_tokens) / self.mean_noise_span_length))
        num_noise_spans = max(num_noise_spans, 1)

        def _random_segmentation(num_items, num_segments):
            """Split num_items into num_segments non-empty parts at random; return their lengths."""
            mask_indices = np.arange(num_items - 1) < (num_segments - 1)
            rng.shuffle(mask_indices)
            first_in_segment = np.pad(mask_indices, [[1, 0]])
            segment_id = np.cumsum(first_in_segment)
            _, segment_length = np.unique(segment_id, return_counts=True)
            return segment_length

        noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans)
        nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans)
        interleaved_span_lengths = np.reshape(np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1), [num_noise_spans * 2])
        span_starts = np.cumsum(interleaved_span_lengths)[:-1]
        span_start_indicator = np.zeros((length,), dtype=np.int8)
        span_start_indicator[span_starts] = True
        span_num = np.cumsum(span_start_indicator)
        return np.equal(span_num % 2, 1)


# --- --dtype bfloat16 ---------------------------------------------------------------------------------
# XLA:CPU computes a bf16 x bf16 -> bf16 product by converting it to f32 (slower than f32 itself), but
# a bf16 x bf16 product with an f32 result takes a bf16 kernel 2-4x as fast as f32 on CPUs with BF16 units
# (4096^2, GFLOP/s: 635-661 vs 311-357 on AVX-512 BF16, 1,121 vs 300 with AMX). Upstream's --dtype bfloat16 (the model's dtype)
# gets the slow kind. Here --dtype bfloat16 keeps the model in f32 (parameters, optimizer state,
# activations, softmax, layer norms, loss) and computes every dense layer, forward and backward, from
# bf16-rounded operands into f32 accumulators.

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
    dkernel = bf16_dot(x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1]), ((0,), (0,)))
    return dx.astype(kernel.dtype), dkernel.astype(kernel.dtype)


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


def model_logits(apply_fn, batch, params, bf16, **kwargs):
    """The model's logits, with --dtype bfloat16 under bf16_dense."""
    with nn.intercept_methods(bf16_dense) if bf16 else contextlib.nullcontext():
        return apply_fn(**batch, params=params, **kwargs)[0]


# --- memory --------------------------------------------------------------------------------------------
# Autodiff keeps the outputs of the activations' transcendental functions for the backward pass (GELU's
# erfc, softmax's exp): at roberta-base, 0.4 GB of the step's peak memory. Recomputing them there costs a
# few elementwise passes: measured no slower, and 0.35 GB (9 %) less peak memory (benchmarks/README.md).
def save_all_but_transcendentals(primitive, *_, **__):
    """A jax.checkpoint policy: keep every intermediate value except those of erf, erfc, exp, tanh, logistic."""
    return primitive.name not in ("erf", "erfc", "exp", "tanh", "logistic")


def group_texts(examples, block_size):
    """Concatenate all texts and cut them into blocks of block_size, dropping the remainder (a batch
    shorter than one block is kept whole), exactly as upstream but in linear time."""
    concatenated = {k: list(chain.from_iterable(examples[k])) for k in examples.keys()}
    total_length = len(concatenated[list(examples.keys())[0]])
    if total_length >= block_size:
        total_length = (total_length // block_size) * block_size
    return {k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}


def seq2seq_sums(logits, labels):
    """Summed cross-entropy and correct predictions over the target tokens, and their count."""
    mask = labels >= 0
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0)) * mask
    accuracy = (jnp.argmax(logits, axis=-1) == labels) * mask
    return loss.sum(), accuracy.sum(), mask.sum()


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


def unreplicate(tree):
    """The first local replica of a pmapped value, on the host. Unlike flax's `jax_utils.unreplicate`
    (`x[0]`), it also works on multi-host runs, where the other replicas are not addressable here."""
    return jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_shards[0].data)[0], tree)


def dummy_rows(batch, num_rows, pad_token_id):
    """Extend a collated batch with rows whose labels are -100 (no loss), so every device gets a full batch."""
    if num_rows == 0:
        return batch
    fill = {"input_ids": pad_token_id, "decoder_input_ids": pad_token_id, "labels": -100}
    return {
        k: np.concatenate([v, np.full((num_rows,) + v.shape[1:], fill.get(k, 0), dtype=v.dtype)]) for k, v in batch.items()
    }


def save_checkpoint(model, params, tokenizer, output_dir, step):
    """Write model + tokenizer into output_dir atomically, file by file: a crash mid-save leaves
    the previous checkpoint readable."""
    tmp_dir = os.path.join(output_dir, f".tmp-checkpoint-{step}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir, params=params)
    tokenizer.save_pretrained(tmp_dir)
    with open(os.path.join(tmp_dir, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step}, f)
    for name in os.listdir(tmp_dir):
        os.replace(os.path.join(tmp_dir, name), os.path.join(output_dir, name))
    os.rmdir(tmp_dir)


def write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=4, sort_keys=True)
    os.replace(tmp, path)


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
    try:
        raw = load()
        if "validation" not in raw.keys() and "train" in raw.keys():
            raw["validation"] = load(split=f"train[:{split_pct}%]")
            raw["train"] = load(split=f"train[{split_pct}%:]")
    except Exception as e:  # noqa: BLE001 - a dataset that cannot be read becomes one line
        source = data_args.dataset_name or data_args.train_file or data_args.validation_file
        fail(f"cannot load dataset {source!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return raw


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO, datefmt="[%X]")
    validate_args(model_args, data_args, training_args)

    # Multi-host: join the other processes before any JAX computation. On one host, JAX devices are
    # first touched after preprocessing, so datasets' worker processes fork before JAX starts threads.
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        try:
            jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]), process_id=int(os.environ["JAX_PROCESS_ID"]))
        except (KeyError, ValueError) as e:
            fail(f"JAX_COORDINATOR_ADDRESS is set, so JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers too ({e})")
    is_main = int(os.environ.get("JAX_PROCESS_ID", "0")) == 0
    if not is_main:
        datasets.utils.logging.set_verbosity_error()
        logging.getLogger().setLevel(logging.WARNING)
    logger.info(f"Training/evaluation parameters {training_args}")

    set_seed(training_args.seed)

    # Data
    raw_datasets = load_raw_datasets(model_args, data_args)

    # Config, tokenizer
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
        fail(f"config model_type {config.model_type!r} is not t5: this script trains T5")
    if config.vocab_size < len(tokenizer):
        fail(f"the config's vocab_size ({config.vocab_size}) is smaller than the tokenizer's {len(tokenizer)} tokens; "
             "rebuild the config with tokenizers/create_config.py --tokenizer_name ...")
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    if tokenizer.eos_token_id is None:
        fail(f"tokenizer {tokenizer_source!r} has no EOS token, which span corruption appends")

    # Lengths: --max_seq_length is the input length after corruption; blocks are cut longer.
    max_seq_length = data_args.max_seq_length or tokenizer.model_max_length
    if max_seq_length > tokenizer.model_max_length:
        logger.warning(f"--max_seq_length {max_seq_length} is larger than the tokenizer's maximum "
                       f"({tokenizer.model_max_length}); using {tokenizer.model_max_length}.")
        max_seq_length = tokenizer.model_max_length
    if max_seq_length < 4:
        fail(f"--max_seq_length must be at least 4, got {max_seq_length}")
    try:
        expanded_inputs_length, targets_length = compute_input_and_target_lengths(
            max_seq_length, data_args.mlm_probability, data_args.mean_noise_span_length
        )
    except ValueError as e:
        fail(f"--max_seq_length {max_seq_length}: {e}; try a length one longer or shorter")
    # Preprocessing: tokenize (no attention mask: every token is real), pack into expanded blocks.
    column_names = list(raw_datasets["train" if "train" in raw_datasets else "validation"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]
    map_kwargs = dict(num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache)

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name], return_attention_mask=False)

    tokenized_datasets = raw_datasets.map(
        tokenize_function, batched=True, remove_columns=column_names, desc="Running tokenizer on dataset", **map_kwargs
    )
    lm_datasets = tokenized_datasets.map(
        group_texts, batched=True, fn_kwargs={"block_size": expanded_inputs_length},
        desc=f"Grouping texts in chunks of {expanded_inputs_length}", **map_kwargs,
    )
    for split in list(lm_datasets):  # a batch shorter than one block is kept whole by group_texts: drop it
        lm_datasets[split] = lm_datasets[split].filter(lambda ids: len(ids) == expanded_inputs_length, input_columns="input_ids")
    data_collator = FlaxDataCollatorForT5MLM(
        tokenizer=tokenizer, noise_density=data_args.mlm_probability, mean_noise_span_length=data_args.mean_noise_span_length,
        input_length=max_seq_length, target_length=targets_length, pad_token_id=config.pad_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )

    # Devices. From here on JAX runs threads: no more forking dataset workers.
    num_devices = jax.device_count()
    local_devices = jax.local_device_count()
    train_batch_size = training_args.per_device_train_batch_size * num_devices
    eval_batch_size = training_args.per_device_eval_batch_size * num_devices
    local_train = training_args.per_device_train_batch_size * local_devices
    local_eval = training_args.per_device_eval_batch_size * local_devices
    process_index = jax.process_index()
    is_main = process_index == 0

    if training_args.do_train:
        num_train_samples = len(lm_datasets["train"])
        steps_per_epoch = num_train_samples // train_batch_size
        if steps_per_epoch == 0:
            fail(f"the train set has {num_train_samples} blocks of {expanded_inputs_length} tokens, fewer than one "
                 f"global batch of {train_batch_size} ({training_args.per_device_train_batch_size} per device x "
                 f"{num_devices} devices); use more text or a smaller --per_device_train_batch_size/--max_seq_length")
        if training_args.max_steps > 0:
            total_train_steps = training_args.max_steps
        else:
            total_train_steps = int(steps_per_epoch * training_args.num_train_epochs)
        if total_train_steps <= 0:
            fail(f"no training step to run: --num_train_epochs {training_args.num_train_epochs} x {steps_per_epoch} steps per epoch")
    if training_args.do_eval and len(lm_datasets["validation"]) == 0:
        fail("the validation set is empty after tokenization; give a longer --validation_file")

    # Push to hub: only when asked (validate_args checked that the hub is reachable).
    api = repo_id = None
    if training_args.push_to_hub and is_main:
        from huggingface_hub import HfApi

        repo_name = training_args.hub_model_id or Path(training_args.output_dir).absolute().name
        try:
            api = HfApi()
            repo_id = api.create_repo(repo_name, exist_ok=True, token=training_args.hub_token).repo_id
        except Exception as e:  # noqa: BLE001
            fail(f"--push_to_hub: cannot create the hub repository {repo_name!r}: {str(e).splitlines()[0]}")

    os.makedirs(training_args.output_dir, exist_ok=True)
    summary_writer = None
    if is_main:
        try:
            from tensorboardX import SummaryWriter

            summary_writer = SummaryWriter(logdir=training_args.output_dir)
        except ImportError:
            logger.warning("tensorboardX is not installed: no TensorBoard logs (pip install -r requirements.txt)")

    # Model
    rng = jax.random.PRNGKey(training_args.seed)
    # One dropout key per global device, so a multi-host run draws what a single host with as many devices draws.
    dropout_rngs = jax.random.split(rng, num_devices)[process_index * local_devices : (process_index + 1) * local_devices]
    # --dtype bfloat16 computes the dense layers in bf16 on an f32 model (see bf16_dense); float16 is
    # upstream's model dtype.
    bf16 = model_args.dtype == "bfloat16"
    dtype = jnp.float32 if bf16 else getattr(jnp, model_args.dtype)
    if model_args.model_name_or_path:
        model = FlaxT5ForConditionalGeneration.from_pretrained(model_args.model_name_or_path, config=config, seed=training_args.seed, dtype=dtype, **hub_kwargs)
    else:
        model = FlaxT5ForConditionalGeneration(config, seed=training_args.seed, dtype=dtype)
    if training_args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
    logger.info(f"Model: {config.model_type}, {num_params:,} parameters, {num_devices} devices ({local_devices} local), "
                f"inputs {max_seq_length} tokens (blocks of {expanded_inputs_length}), targets {targets_length}")

    total_for_schedule = total_train_steps if training_args.do_train else 1
    linear_decay_lr_schedule_fn = create_learning_rate_fn(total_for_schedule, training_args.warmup_steps, training_args.learning_rate)
    if training_args.adafactor:
        # Upstream's choice: Adafactor with the same schedule, no decay mask.
        optimizer = optax.adafactor(learning_rate=linear_decay_lr_schedule_fn)
    else:
        optimizer = optax.adamw(
            learning_rate=linear_decay_lr_schedule_fn, b1=training_args.adam_beta1, b2=training_args.adam_beta2,
            eps=training_args.adam_epsilon, weight_decay=training_args.weight_decay, mask=decay_mask_fn,
        )
    state = train_state.TrainState.create(apply_fn=model.__call__, params=model.params, tx=optimizer)

    def train_step(state, batch, dropout_rng):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)

        def loss_fn(params):
            labels = batch.pop("labels")
            logits = model_logits(state.apply_fn, batch, params, bf16, dropout_rng=dropout_rng, train=True)
            loss, _, num_labels = seq2seq_sums(logits, labels)
            return loss, num_labels

        grad_fn = jax.value_and_grad(jax.checkpoint(loss_fn, policy=save_all_but_transcendentals), has_aux=True)
        (loss, num_labels), grad = grad_fn(state.params)
        # The "true loss": sum over every target token on every device, divided by their total count.
        num_labels = jnp.maximum(jax.lax.psum(num_labels, "batch"), 1)
        loss = jax.lax.psum(loss, "batch") / num_labels
        grad = jax.tree_util.tree_map(lambda g: jax.lax.psum(g, "batch") / num_labels, grad)
        new_state = state.apply_gradients(grads=grad)
        metrics = {"loss": loss, "learning_rate": linear_decay_lr_schedule_fn(state.step)}
        return new_state, metrics, new_dropout_rng

    def eval_step(params, batch):
        labels = batch.pop("labels")
        logits = model_logits(model.__call__, batch, params, bf16, train=False)
        loss, accuracy, normalizer = seq2seq_sums(logits, labels)
        return jax.lax.psum({"loss": loss, "accuracy": accuracy, "normalizer": normalizer}, axis_name="batch")

    p_train_step = jax.pmap(train_step, "batch", donate_argnums=(0,))
    p_eval_step = jax.pmap(eval_step, "batch")
    # Replicas placed by a pmap carry the same sharding (a mesh axis named "batch") as the steps'
    # outputs; placed by flax's replicate() they do not, and the train step compiled a second time.
    to_devices = jax.pmap(lambda x: x, "batch")

    eval_dataset = lm_datasets["validation"] if training_args.do_eval else None

    def local_slice(batch, local_size):
        """Every process collates the same global batch; each feeds its own rows to its devices."""
        start = process_index * local_size
        return shard({k: v[start : start + local_size] for k, v in batch.items()})

    def evaluate(params):
        num_eval = len(eval_dataset)
        sums = {"loss": 0.0, "accuracy": 0.0, "normalizer": 0.0}
        batches = generate_batch_splits(np.arange(num_eval), eval_batch_size, drop_last=False)
        for batch_idx in tqdm(batches, desc="Evaluating ...", position=2, leave=False, disable=not is_main):
            # Each example's spans come from (seed, index): the same at every evaluation and any batching.
            batch = data_collator(eval_dataset[batch_idx], training_args.seed, row_ids=batch_idx)
            batch = dummy_rows(batch, eval_batch_size - len(batch_idx), pad_token_id)
            metrics = unreplicate(p_eval_step(params, local_slice(batch, local_eval)))
            for k in sums:
                sums[k] += float(metrics[k])
        normalizer = max(sums["normalizer"], 1.0)
        eval_loss = sums["loss"] / normalizer
        return {
            "eval_loss": eval_loss,
            "eval_accuracy": sums["accuracy"] / normalizer,
            "eval_perplexity": math.exp(eval_loss) if eval_loss < 700 else float("inf"),
            "eval_target_tokens": int(sums["normalizer"]),
            "eval_samples": num_eval,
        }

    def log_eval(metrics, step):
        logger.info(f"Step {step}: eval loss {metrics['eval_loss']:.4f}, accuracy {metrics['eval_accuracy']:.4f}, "
                    f"perplexity {metrics['eval_perplexity']:.2f}")
        if summary_writer is not None:
            for k in ("eval_loss", "eval_accuracy", "eval_perplexity"):
                summary_writer.add_scalar(k, metrics[k], step)

    def save(params, step):
        if not is_main:
            return
        params = unreplicate(params)
        save_checkpoint(model, params, tokenizer, training_args.output_dir, step)
        if api is not None:
            api.upload_folder(commit_message=f"Saving weights and logs of step {step}", folder_path=training_args.output_dir,
                              repo_id=repo_id, repo_type="model", token=training_args.hub_token)

    last_eval, last_eval_step = None, None
    cur_step = 0
    if training_args.do_train:
        state = to_devices(jax_utils.replicate(state))
        dropout_rngs = to_devices(dropout_rngs)
        train_rng = np.random.default_rng(training_args.seed)
        num_epochs = math.ceil(total_train_steps / steps_per_epoch)
        logger.info(f"***** Running training *****\n  Num examples = {num_train_samples}\n  Num epochs = {num_epochs}\n"
                    f"  Global batch size = {train_batch_size}\n  Total optimization steps = {total_train_steps}")
        train_start = time.time()
        window_losses = []
        tokens_seen = 0
        progress = tqdm(total=total_train_steps, desc="Training", disable=not is_main, dynamic_ncols=True)
        for epoch in range(num_epochs):
            # Identical on every process: the same permutation, batches and masks.
            batches = generate_batch_splits(train_rng.permutation(num_train_samples), train_batch_size)
            for batch_idx in batches:
                if cur_step >= total_train_steps:
                    break
                batch = data_collator(lm_datasets["train"][np.sort(batch_idx)], train_rng)
                tokens_seen += batch["input_ids"].size
                state, train_metric, dropout_rngs = p_train_step(state, local_slice(batch, local_train), dropout_rngs)
                cur_step += 1
                progress.update(1)
                window_losses.append(train_metric["loss"])

                if cur_step % training_args.logging_steps == 0 or cur_step == total_train_steps:
                    losses = [unreplicate(x) for x in window_losses]
                    lr = float(unreplicate(train_metric["learning_rate"]))
                    train_loss = float(np.mean(losses))
                    window_losses = []
                    progress.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}")
                    progress.write(f"Step {cur_step}/{total_train_steps} (epoch {epoch + 1}) | loss {train_loss:.4f} | lr {lr:.3e}")
                    if summary_writer is not None:
                        summary_writer.add_scalar("train_loss", train_loss, cur_step)
                        summary_writer.add_scalar("learning_rate", lr, cur_step)

                end_of_epoch = batch_idx is batches[-1] or cur_step == total_train_steps
                due = cur_step % training_args.eval_steps == 0 if training_args.eval_steps else end_of_epoch
                if training_args.do_eval and due:
                    last_eval, last_eval_step = evaluate(state.params), cur_step
                    log_eval(last_eval, cur_step)

                if cur_step % training_args.save_steps == 0 or cur_step == total_train_steps:
                    save(state.params, cur_step)
        progress.close()
        train_time = time.time() - train_start
        train_results = {
            "train_loss": train_loss,
            "train_runtime_s": train_time,
            "train_steps": cur_step,
            "train_samples_per_second": cur_step * train_batch_size / train_time,
            "train_tokens_per_second": tokens_seen / train_time,
            "global_batch_size": train_batch_size,
            "max_seq_length": max_seq_length,
            "expanded_inputs_length": expanded_inputs_length,
            "targets_length": targets_length,
            "num_devices": num_devices,
            "num_parameters": num_params,
        }
        logger.info(f"Trained {cur_step} steps in {train_time:.1f} s ({train_results['train_tokens_per_second']:.0f} tokens/s)")
        if is_main:
            write_json(os.path.join(training_args.output_dir, "train_results.json"), train_results)
        params = state.params
    else:
        params = to_devices(jax_utils.replicate(state.params))

    if training_args.do_eval:
        if last_eval is None or last_eval_step != cur_step:
            last_eval = evaluate(params)
            log_eval(last_eval, cur_step)
        if is_main:
            write_json(os.path.join(training_args.output_dir, "eval_results.json"), last_eval)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in last_eval.items()}))
    if summary_writer is not None:
        summary_writer.close()


if __name__ == "__main__":
    main()
