#!/usr/bin/env python
# Reproduction of Hugging Face's examples/tensorflow/language-modeling-tpu/run_mlm.py (Apache-2.0 upstream),
# the script of the Keras/TF walkthrough "Training a language model from scratch with Transformers and
# TPUs", for transformers 4.57.6 / tensorflow 2.21 / tf-keras 2.21.
"""Pretrain a masked language model from TFRecord shards with tf.distribute: TPUStrategy on a TPU,
otherwise MirroredStrategy over several devices or OneDeviceStrategy on one.

  python tensorflow/run_mlm.py --pretrained_model_config out/config --tokenizer out/unigram \
      --train_dataset out/shards/train --eval_dataset out/shards/validation --no_tpu \
      --num_epochs 1 --per_replica_batch_size 32 --max_length 128 --learning_rate 1e-3 --output_dir out/tf-mlm

Differences from upstream, all fixes:
- No TPU: upstream catches only ValueError, but TPUClusterResolver("local") raises NotFoundError from
  initialize_tpu_system, and --no_tpu asked for a GPU that may not be there. Here the script falls back
  to MirroredStrategy over the GPUs or the logical CPU devices (--num_cpu_devices) when there are
  several, else OneDeviceStrategy, and logs which one it chose. --jit_compile (XLA) is refused under
  MirroredStrategy on CPU, where TensorFlow cannot run it.
- Metrics: Keras' "accuracy" on MLM labels counts the -100 positions (it reports the mask rate); here
  accuracy and loss are computed over masked tokens only, for train and eval, with perplexity, and
  written to train_results.json / eval_results.json. Eval masks are drawn once, so every epoch's
  evaluation scores the same tokens.
- The config takes the tokenizer's vocabulary size (as upstream; a config of fewer tokens than the tokenizer, made for
  another, is refused) and its pad/bos/eos ids. TFRoberta
  numbers positions assuming pad id 1 whatever the config says; the walkthrough's tokenizer had [SEP]
  at id 1, so every [SEP] was taken for padding. train_unigram.py now puts <pad> at 1, and a
  tokenizer with another pad id is refused for RoBERTa-family models.
- Every special token in the text (such as a literal <unk>) is kept out of the MLM targets.
- Steps and logs, with the Trainer's flag names: --max_steps (the data repeats as needed), --warmup_steps (default:
  upstream's 5 %), --eval_steps (fit runs stretches of that many steps, each ending in an evaluation), and TensorBoard
  events under output_dir/runs/<date>_<host> with the Trainer's tags (train/loss, eval/loss, ...; --report_to none to
  skip). --model_name_or_path starts from saved TF or PyTorch weights, e.g. the same initial model as another
  framework's run.
  --full_determinism (the Trainer's name) makes a seeded run repeatable.
- Shards are checked before training (names, counts, sequence length); the hub is only contacted when
  --hub_model_id is given, and offline that fails before training. The model and tokenizer are saved
  together (fill-mask works from --output_dir), atomically, and never over a folder without
  --overwrite_output_dir.
"""

import argparse
import atexit
import contextlib
import datetime
import fcntl
import hashlib
import importlib.util
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

# Only TensorFlow is used: keep transformers from importing PyTorch and JAX.
os.environ.setdefault("USE_TORCH", "0")
os.environ.setdefault("USE_FLAX", "0")
if importlib.util.find_spec("transformers") is None:  # the system's Python, not .venv's
    sys.exit(
        f"{os.path.basename(__file__)}: error: transformers is not installed for {sys.executable}: "
        "bash run.sh setup, then source .venv/bin/activate"
    )
# Without an NVIDIA driver, TensorFlow's CUDA build logs "failed call to cuInit" as an error: keep its C++ log to
# fatal errors there (Python's exceptions still say what failed); with a GPU, its warnings and errors stay.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1" if os.path.exists("/dev/nvidiactl") else "3")

import numpy as np
import tensorflow as tf
import transformers
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    TFAutoModelForMaskedLM,
    create_optimizer,
)
from transformers.modeling_tf_utils import keras

logger = logging.getLogger(__name__)
AUTO = tf.data.AUTOTUNE
SHARD_NAME = re.compile(r"-\d+-(\d+)\.tfrecord$")
OFFSET_POSITION_MODELS = ("roberta", "xlm-roberta", "camembert")
WEIGHTS = ("tf_model.h5", "model.safetensors", "pytorch_model.bin")  # TF's, then PyTorch's (pytorch/run_mlm.py's)


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def add_model_args(parser):
    """Flags of the model's config, initial weights and tokenizer."""
    parser.add_argument(
        "--pretrained_model_config",
        type=str,
        default="FacebookAI/roberta-base",
        help=(
            "The model config to use (a folder, e.g. from tokenizers/create_config.py, or a hub name). "
            "Note that we don't copy the model's weights, only the config!"
        ),
    )
    parser.add_argument(
        "--model_name_or_path",
        type=str,
        help=(
            "Start from these TF or PyTorch weights (and their config) instead of a fresh initialisation, "
            "e.g. to compare frameworks from the same initial model."
        ),
    )
    parser.add_argument(
        "--tokenizer",
        type=str,
        default="unigram-tokenizer-wikitext",
        help=(
            "The name or folder of the tokenizer (tensorflow/train_unigram.py). "
            "The model's vocab size will be set to the tokenizer's size."
        ),
    )


def add_device_args(parser):
    """Flags of the batch per replica, the TPU or fallback devices and the precision."""
    parser.add_argument(
        "--per_replica_batch_size", type=int, default=8, help="Batch size per TPU core (or other replica)."
    )
    parser.add_argument(
        "--no_tpu",
        action="store_true",
        help="Do not look for a TPU: MirroredStrategy over several devices, else OneDeviceStrategy.",
    )
    parser.add_argument(
        "--tpu_name",
        type=str,
        default="local",
        help="Name of TPU resource to initialize. Should be blank on Colab, and 'local' on TPU VMs.",
    )
    parser.add_argument(
        "--tpu_zone",
        type=str,
        help="Google cloud zone that TPU resource is located in. Only used for non-Colab TPU nodes.",
    )
    parser.add_argument(
        "--gcp_project", type=str, help="Google cloud project name. Only used for non-Colab TPU nodes."
    )
    parser.add_argument(
        "--num_cpu_devices",
        type=int,
        default=1,
        help=(
            "Without TPU or GPU: split the CPU into this many logical devices, "
            "so MirroredStrategy runs data parallel over them."
        ),
    )
    parser.add_argument(
        "--jit_compile",
        action="store_true",
        help="Compile the train step with XLA (not under MirroredStrategy on CPU).",
    )
    parser.add_argument(
        "--bfloat16",
        action="store_true",
        help="Use mixed-precision bfloat16 for training. This is the recommended lower-precision format for TPU.",
    )


def add_data_args(parser):
    """Flags of the training and evaluation shards."""
    parser.add_argument(
        "--train_dataset",
        type=str,
        help=(
            "Path to training dataset to load. "
            "If the path begins with `gs://` then the dataset will be loaded from a Google Cloud Storage bucket."
        ),
    )
    parser.add_argument(
        "--shuffle_buffer_size", type=int, default=2**18, help="Size of the shuffle buffer (in samples)"
    )
    parser.add_argument(
        "--eval_dataset",
        type=str,
        help=(
            "Path to evaluation dataset to load. "
            "If the path begins with `gs://` then the dataset will be loaded from a Google Cloud Storage bucket."
        ),
    )


def add_training_args(parser):
    """Flags of the schedule, the optimizer, the masking and the seed."""
    parser.add_argument("--num_epochs", type=int, default=1, help="Number of epochs to train for.")
    parser.add_argument(
        "--max_steps",
        type=int,
        help="Train this many steps instead of --num_epochs epochs (the data repeats as needed).",
    )
    parser.add_argument(
        "--warmup_steps",
        type=int,
        help="Linear warm-up steps (default: 5%% of the training steps, as the walkthrough).",
    )
    parser.add_argument("--eval_steps", type=int, help="Evaluate and log every N steps (default: once per epoch).")
    parser.add_argument("--learning_rate", type=float, default=1e-4, help="Learning rate to use for training.")
    parser.add_argument("--weight_decay_rate", type=float, default=1e-3, help="Weight decay rate to use for training.")
    parser.add_argument(
        "--max_length",
        type=int,
        default=512,
        help="Maximum length of tokenized sequences. Should match the setting used in prepare_tfrecord_shards.py",
    )
    parser.add_argument(
        "--mlm_probability", type=float, default=0.15, help="Fraction of tokens to mask during training."
    )
    parser.add_argument("--seed", type=int, default=42, help="Seed for initialization, shuffling and masking.")
    parser.add_argument(
        "--full_determinism",
        action="store_true",
        help=(
            "Deterministic ops and input pipeline (tf.config.experimental.enable_op_determinism): "
            "the same seed gives the same run. "
            "Without it the masks drawn in the parallel input pipeline differ from run to run."
        ),
    )


def add_output_args(parser):
    """Flags of the output folder, the hub upload and the TensorBoard logs."""
    parser.add_argument("--output_dir", type=str, required=True, help="Path to save model checkpoints to.")
    parser.add_argument("--overwrite_output_dir", action="store_true", help="Write into a non-empty --output_dir.")
    parser.add_argument("--hub_model_id", type=str, help="Model ID to upload to on the Hugging Face Hub.")
    parser.add_argument(
        "--report_to",
        choices=["tensorboard", "none"],
        default="tensorboard",
        help=(
            "tensorboard: events under output_dir/runs/<date>_<host> "
            "with the Trainer's tags (train/loss, eval/loss, ...)."
        ),
    )


def build_parser():
    """The command line, its flags in --help order."""
    parser = argparse.ArgumentParser(description="Train a masked language model on TPU.")
    parser.error = fail  # a bad or missing flag: one line, not a usage block
    add_model_args(parser)
    add_device_args(parser)
    add_data_args(parser)
    add_training_args(parser)
    add_output_args(parser)
    return parser


def validate_args(args):
    """Fail with one line on a value that the flags' types let through."""
    for flag in (
        "per_replica_batch_size",
        "num_epochs",
        "max_length",
        "num_cpu_devices",
        "shuffle_buffer_size",
        "max_steps",
        "eval_steps",
    ):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            fail(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if not 0.0 < args.mlm_probability < 1.0:
        fail(f"--mlm_probability must be in (0, 1), got {args.mlm_probability}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        fail(f"--warmup_steps must not be negative, got {args.warmup_steps}")
    if args.learning_rate <= 0 or args.weight_decay_rate < 0:
        fail(
            "--learning_rate must be positive and --weight_decay_rate not negative, "
            f"got {args.learning_rate} and {args.weight_decay_rate}"
        )
    if args.train_dataset is None:
        fail("--train_dataset is required: a folder of TFRecord shards from tensorflow/prepare_tfrecord_shards.py")


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    validate_args(args)
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
            f"{flag} {name!r} is not a local path and the Hugging Face Hub is unreachable (offline?); pass a local "
            "folder (tokenizers/create_config.py writes configs, tensorflow/train_unigram.py tokenizers)"
        )


def initialize_tpu(args):
    if args.tpu_name:
        tpu = tf.distribute.cluster_resolver.TPUClusterResolver(
            args.tpu_name, zone=args.tpu_zone, project=args.gcp_project
        )
    else:
        tpu = tf.distribute.cluster_resolver.TPUClusterResolver()
    tf.config.experimental_connect_to_cluster(tpu)
    tf.tpu.experimental.initialize_tpu_system(tpu)
    return tpu


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


def warn_if_bf16_is_slow(strategy_name):
    """One warning line when --bfloat16 is asked for on a CPU without bf16 instructions; the run goes on as asked."""
    if strategy_name == "TPUStrategy" or tf.config.list_logical_devices("GPU"):
        return
    model, support = cpu_bf16()
    if support.startswith("none"):
        logger.warning(
            f"--bfloat16: this CPU ({model}, bf16: {support}) has no bf16 instructions; TensorFlow computes "
            "bf16 in f32 here, with conversions: slower than float32. Going on as asked."
        )


def choose_strategy(args):
    """TPUStrategy when a TPU answers; else MirroredStrategy over several GPUs or logical CPU devices;
    else OneDeviceStrategy. Returns the strategy and its name for the log and results."""
    if not args.no_tpu:
        try:
            return tf.distribute.TPUStrategy(initialize_tpu(args)), "TPUStrategy"
        except (ValueError, tf.errors.NotFoundError, tf.errors.UnavailableError, tf.errors.InvalidArgumentError) as e:
            reason = str(e).strip().split(". ")[0] if str(e).strip() else "no detail"
            logger.warning(
                f"No TPU found ({type(e).__name__}: {reason}); falling back to the devices of this machine "
                "(pass --no_tpu to skip looking)"
            )
    devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
        d.name for d in tf.config.list_logical_devices("CPU")
    ]
    if len(devices) > 1:
        return tf.distribute.MirroredStrategy(devices=devices), "MirroredStrategy"
    return tf.distribute.OneDeviceStrategy(devices[0]), "OneDeviceStrategy"


def count_samples(file_list):
    num_samples = 0
    for file in file_list:
        filename = file.split("/")[-1]
        match = SHARD_NAME.search(filename)
        if match is None:
            fail(
                f"shard {file}: the name must end in -<shard>-<count>.tfrecord "
                "(as prepare_tfrecord_shards.py writes), because the sample count is read from it"
            )
        num_samples += int(match.group(1))
    return num_samples


def find_shards(flag, path, max_length):
    """The shards of one split, checked: present, named with counts, holding sequences of max_length."""
    records = sorted(tf.io.gfile.glob(os.path.join(path, "*.tfrecord")))
    if not records:
        fail(f"{flag} {path}: no .tfrecord files found; write them with tensorflow/prepare_tfrecord_shards.py")
    num_samples = count_samples(records)
    first = next(iter(tf.data.TFRecordDataset(records[:1]).take(1)), None)
    if first is None:
        fail(f"{flag} {records[0]} holds no record")
    length = len(tf.train.Example.FromString(first.numpy()).features.feature["input_ids"].int64_list.value)
    if length != max_length:
        fail(
            f"{flag} {path} holds sequences of {length} tokens but --max_length is {max_length}; "
            "pass the --max_length the shards were prepared with"
        )
    return records, num_samples


def vocab_digest(tokenizer):
    """The tokenizer's vocabulary, tokens and ids, as a SHA-256 digest (prepare_tfrecord_shards.py writes its own)."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def check_tokenizer(flag, path, files, tokenizer):
    """Shards of another tokenizer: refused by the vocabulary that shards.json records, or (shards written before it)
    by ids past this vocabulary, which the model has no embedding for: the first shard's largest id."""
    again = "write them again with tensorflow/prepare_tfrecord_shards.py --tokenizer_name_or_path and this --tokenizer"
    if tf.io.gfile.exists(os.path.join(path, "shards.json")):
        with tf.io.gfile.GFile(os.path.join(path, "shards.json")) as f:
            written = json.load(f)
        if written["vocab_sha256"] != vocab_digest(tokenizer):
            fail(
                f"{flag} {path} was written with the tokenizer {written['tokenizer']} "
                f"({written['vocab_size']} tokens), not this --tokenizer ({len(tokenizer)} tokens); {again}"
            )
    vocab_size = len(tokenizer)
    records = tf.data.TFRecordDataset(files[:1])
    ids = (tf.train.Example.FromString(r.numpy()).features.feature["input_ids"].int64_list.value for r in records)
    largest = max((max(row, default=0) for row in ids), default=0)
    if largest >= vocab_size:
        fail(
            f"{flag} {files[0]} holds token id {largest}, but the tokenizer has {vocab_size} tokens: the shards were "
            f"written with another tokenizer; {again}"
        )


def prepare_dataset(
    records, decode_fn, mask_fn, batch_size, shuffle, shuffle_buffer_size=None, seed=None, drop_remainder=True
):
    """Training (shuffle=True): shuffled full batches, repeated without end (fit's steps_per_epoch sets the length).
    Evaluation: the records in order, masked once and cached."""
    num_samples = count_samples(records)
    dataset = tf.data.Dataset.from_tensor_slices(records)
    if shuffle:
        dataset = dataset.shuffle(len(dataset), seed=seed)
    dataset = tf.data.TFRecordDataset(dataset, num_parallel_reads=AUTO)
    # TF can't infer the total sample count because it doesn't read all the records yet, so we assert it here
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(num_samples))
    dataset = dataset.map(decode_fn, num_parallel_calls=AUTO)
    if shuffle:
        dataset = dataset.shuffle(shuffle_buffer_size, seed=seed)
    dataset = dataset.batch(batch_size, drop_remainder=shuffle or drop_remainder)
    dataset = dataset.map(mask_fn, num_parallel_calls=AUTO)
    # evaluation: mask once, so every evaluation scores the same tokens
    dataset = dataset.repeat() if shuffle else dataset.cache()
    return dataset.prefetch(AUTO)


def make_mask_fn(tokenizer, mlm_probability):
    """Mask a batch inside the tf.data pipeline with the collator's TF masking (80% [MASK], 10% random,
    10% kept). Padding and every special token id are never selected."""
    data_collator = DataCollatorForLanguageModeling(
        tokenizer=tokenizer, mlm_probability=mlm_probability, mlm=True, return_tensors="tf"
    )
    special_ids = tf.constant(sorted(set(tokenizer.all_special_ids)), dtype=tf.int64)

    def mask_with_collator(batch):
        input_ids = batch["input_ids"]
        is_special = tf.reduce_any(input_ids[..., None] == special_ids, axis=-1)
        special_tokens_mask = ~tf.cast(batch["attention_mask"], tf.bool) | is_special
        batch["input_ids"], batch["labels"] = data_collator.tf_mask_tokens(
            input_ids,
            vocab_size=len(tokenizer),
            mask_token_id=tokenizer.mask_token_id,
            special_tokens_mask=special_tokens_mask,
        )
        return batch

    return mask_with_collator


class MaskedAccuracy(keras.metrics.Metric):
    """Share of masked tokens (label != -100) whose most likely prediction is the label."""

    def __init__(self, name="masked_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.correct = self.add_weight(name="correct", initializer="zeros", dtype=tf.float64)
        self.count = self.add_weight(name="count", initializer="zeros", dtype=tf.float64)

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = tf.cast(y_true, tf.int64)
        mask = y_true != -100
        # Only the masked positions' logits (about 15 %): on the full [batch, length, vocabulary] logits the two
        # metrics took a third of a small model's step.
        hits = tf.argmax(tf.boolean_mask(y_pred, mask), axis=-1) == tf.boolean_mask(y_true, mask)
        self.correct.assign_add(tf.reduce_sum(tf.cast(hits, tf.float64)))
        self.count.assign_add(tf.reduce_sum(tf.cast(mask, tf.float64)))

    def result(self):
        return tf.math.divide_no_nan(self.correct, self.count)


class MaskedLoss(MaskedAccuracy):
    """Cross-entropy averaged over all masked tokens seen (token-weighted, unlike Keras' batch mean)."""

    def __init__(self, name="masked_loss", **kwargs):
        super().__init__(name=name, **kwargs)

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = tf.cast(y_true, tf.int64)
        mask = y_true != -100
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.boolean_mask(y_true, mask), tf.cast(tf.boolean_mask(y_pred, mask), tf.float32)
        )
        self.correct.assign_add(tf.reduce_sum(tf.cast(losses, tf.float64)))
        self.count.assign_add(tf.reduce_sum(tf.cast(mask, tf.float64)))


class TrainingLog(keras.callbacks.Callback):
    """Times every training step (the first includes tracing and compilation) and stops fit after max_steps. At the
    end of every fit epoch (each --eval_steps steps) writes the Trainer's TensorBoard tags at the global step."""

    TAGS = {
        "train/loss": "masked_loss",
        "train/accuracy": "masked_accuracy",
        "eval/loss": "val_masked_loss",
        "eval/accuracy": "val_masked_accuracy",
    }

    def __init__(self, max_steps, schedule, writer):
        super().__init__()
        self.max_steps, self.schedule, self.writer = max_steps, schedule, writer
        self.times, self.printed = [], time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)
        if len(self.times) >= self.max_steps:
            self.model.stop_training = True
        # Keras prints one line an epoch when its output is not a terminal: a line a minute here, so a log shows life
        if not sys.stdout.isatty() and time.perf_counter() - self.printed >= 60:
            self.printed = time.perf_counter()
            print(
                f"step {len(self.times)}/{self.max_steps}, loss {(logs or {}).get('loss', float('nan')):.4f}",
                flush=True,
            )

    def on_epoch_end(self, epoch, logs=None):
        if self.writer is None:
            return
        with self.writer.as_default(step=len(self.times)):
            for tag, key in self.TAGS.items():
                if key in logs:
                    tf.summary.scalar(tag, logs[key])
            tf.summary.scalar("train/learning_rate", self.schedule(len(self.times)))
        self.writer.flush()


def open_summary_writer(args):
    """TensorBoard events in output_dir/runs/<date>_<host>, the folder the Trainer and the Flax scripts use."""
    if args.report_to == "none":
        return None
    run_name = f"{datetime.datetime.now():%b%d_%H-%M-%S}_{socket.gethostname()}"
    return tf.summary.create_file_writer(os.path.join(args.output_dir, "runs", run_name))


def write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=4, sort_keys=True)
    os.replace(tmp, path)


def save_atomically(model, tokenizer, output_dir):
    """Write model + tokenizer to a temporary folder, then move the files in."""
    tmp_dir = os.path.join(output_dir, ".tmp-save")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    for name in os.listdir(tmp_dir):
        os.replace(os.path.join(tmp_dir, name), os.path.join(output_dir, name))
    os.rmdir(tmp_dir)


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


def lock_output_dir(output_dir):
    """Hold output_dir/.lock while this process runs, so that a second run into the same folder is refused instead
    of mixing its files with this one's. An flock: the OS releases it however the process ends (kill -9 too),
    so a stale lock never blocks a later run. Returns the open file, to keep for the process's lifetime."""
    if not os.path.isdir(output_dir):  # made here: gone again if the run stops before writing anything into it
        atexit.register(
            lambda: os.path.isdir(output_dir) and os.listdir(output_dir) == [".lock"] and shutil.rmtree(output_dir)
        )
    os.makedirs(output_dir, exist_ok=True)
    lock = open(os.path.join(output_dir, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        fail(
            f"another run ({lock.read().strip() or 'unknown'}) is writing into {output_dir}; "
            "wait for it to end, or choose another --output_dir"
        )
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


def configure_logging():
    """This script's log lines at INFO; transformers and TensorFlow only from WARNING."""
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO, force=True)
    transformers.utils.logging.set_verbosity_warning()
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    # transformers 4.57.6 is pinned on purpose, the last release with TF and Flax models: its warning that they go in
    # v5 is no news to a run of this script.
    for name in ("modeling_tf_utils", "tokenization_utils_base"):
        logging.getLogger(f"transformers.{name}").addFilter(lambda record: DEPRECATION not in record.getMessage())


DEPRECATION = "TensorFlow and JAX classes are deprecated and will be removed in Transformers v5"


def split_cpu_devices(num_cpu_devices):
    """Split the CPU into num_cpu_devices logical devices (not when GPUs are present)."""
    if num_cpu_devices > 1:
        if tf.config.list_physical_devices("GPU"):
            logger.warning("--num_cpu_devices is ignored: GPUs are present")
        else:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * num_cpu_devices)


def check_output_dir(output_dir, overwrite_output_dir):
    """Fail unless output_dir is a writable folder, empty or to be overwritten."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        fail(f"--output_dir {output_dir} exists and is not a directory")
    if os.path.isdir(output_dir) and set(os.listdir(output_dir)) - {".lock"} and not overwrite_output_dir:
        fail(f"output directory {output_dir} is not empty; pass --overwrite_output_dir to write into it")
    check_writable("--output_dir", output_dir)


def saved_weights(path):
    """The weights files of WEIGHTS in the folder `path` (none for a hub name)."""
    return [name for name in WEIGHTS if os.path.isfile(os.path.join(path, name))]


def check_model_sources(args):
    """Check the config, weights, tokenizer and hub flags before training; returns where the config comes from."""
    config_flag, config_source = (
        ("--model_name_or_path", args.model_name_or_path)
        if args.model_name_or_path
        else ("--pretrained_model_config", args.pretrained_model_config)
    )
    if os.path.isdir(config_source) and not os.path.isfile(os.path.join(config_source, "config.json")):
        fail(f"{config_flag} {config_source} holds no config.json; write one with tokenizers/create_config.py")
    if (
        args.model_name_or_path
        and os.path.isdir(args.model_name_or_path)
        and not saved_weights(args.model_name_or_path)
    ):
        fail(
            f"--model_name_or_path {args.model_name_or_path} holds no TensorFlow or PyTorch weights "
            f"({', '.join(WEIGHTS)}); save them with save_pretrained, "
            "or leave the flag out to start from a fresh initialisation"
        )
    if args.hub_model_id and not hub_reachable():
        fail(
            f"--hub_model_id {args.hub_model_id}: the Hugging Face Hub is unreachable (offline?); drop --hub_model_id "
            f"and upload {args.output_dir} later"
        )
    for flag, name in ((config_flag, config_source), ("--tokenizer", args.tokenizer)):
        check_hub_name(flag, name)
    check_tokenizer_folder("--tokenizer", args.tokenizer)
    return config_source


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


def setup_strategy(args):
    """The distribution strategy (TPU, else this machine's devices) and its name, logged; refuses XLA where it
    cannot run."""
    strategy, strategy_name = choose_strategy(args)
    replicas = strategy.num_replicas_in_sync
    logger.info(f"Strategy: {strategy_name} with {replicas} replica(s)")
    if args.jit_compile and strategy_name == "MirroredStrategy" and not tf.config.list_logical_devices("GPU"):
        fail(
            "--jit_compile does not work under MirroredStrategy on CPU devices (TensorFlow cannot place the XLA "
            "step across them); drop --jit_compile or use --num_cpu_devices 1"
        )
    return strategy, strategy_name


def set_precision_and_seed(args, strategy_name):
    """Mixed bfloat16 with --bfloat16, the seed, and deterministic ops with --full_determinism."""
    if args.bfloat16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        warn_if_bf16_is_slow(strategy_name)
    keras.utils.set_random_seed(args.seed)
    if args.full_determinism:
        tf.config.experimental.enable_op_determinism()


def load_tokenizer_and_config(args, config_source):
    """The tokenizer, with a mask token, and the model config as written (fit_config fits it to the tokenizer)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        config = AutoConfig.from_pretrained(config_source)
    except Exception as e:  # noqa: BLE001 - a folder without tokenizer files raises AttributeError, not OSError
        fail(
            f"cannot load the tokenizer or config ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); "
            "is --tokenizer a folder written by train_unigram.py or save_pretrained?"
        )
    if tokenizer.mask_token is None:
        fail(f"tokenizer {args.tokenizer!r} has no mask token, which masked language modelling needs")
    return tokenizer, config


def fit_config(args, config_source, config, tokenizer):
    """The config given the tokenizer's vocabulary size and special ids, checked against the tokenizer and
    --max_length."""
    if args.model_name_or_path and config.vocab_size != len(tokenizer):
        fail(
            f"--model_name_or_path {args.model_name_or_path} has a vocabulary of {config.vocab_size} "
            f"but --tokenizer has {len(tokenizer)} tokens; pass the tokenizer the model was trained with"
        )
    # A config of fewer tokens was made for another tokenizer: refused, as by the Flax and PyTorch scripts. One of
    # more, such as the default roberta-base's, is an architecture that takes the tokenizer's vocabulary.
    if config.vocab_size < len(tokenizer):
        fail(
            f"--pretrained_model_config {config_source}: the config's vocab_size ({config.vocab_size}) is smaller "
            f"than the tokenizer's {len(tokenizer)} tokens; rebuild the config with tokenizers/create_config.py "
            f"--tokenizer_name {args.tokenizer}"
        )
    # The model's vocabulary and special ids come from the tokenizer.
    config.vocab_size = len(tokenizer)
    special_ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id,
        "eos_token_id": tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id,
    }
    for name, token_id in special_ids.items():
        if token_id is not None:
            setattr(config, name, token_id)
    if config.model_type in OFFSET_POSITION_MODELS and tokenizer.pad_token_id != 1:
        fail(
            f"tokenizer {args.tokenizer!r} has pad id {tokenizer.pad_token_id}, "
            f"but TF{config.model_type} numbers positions "
            "assuming pad id 1 (its padding_idx is fixed), so every token with id 1 would count as padding; "
            "train the tokenizer with tensorflow/train_unigram.py, which puts <pad> at id 1"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and config.model_type in OFFSET_POSITION_MODELS:
        positions -= config.pad_token_id + 1
    if positions is not None and args.max_length > positions:
        fail(f"--max_length {args.max_length} is longer than the model's {positions} positions")
    return config


def plan_steps(args, num_train_samples, replicas):
    """The global batch size, the training and warm-up steps, and the steps of each fit epoch."""
    batch_size = args.per_replica_batch_size * replicas
    steps_per_epoch = num_train_samples // batch_size
    if steps_per_epoch == 0:
        fail(
            f"{num_train_samples} training samples are fewer than one global batch ({batch_size}); "
            "use more data or a smaller --per_replica_batch_size"
        )
    total_train_steps = args.max_steps or steps_per_epoch * args.num_epochs
    warmup_steps = args.warmup_steps if args.warmup_steps is not None else total_train_steps // 20
    if warmup_steps > total_train_steps:
        logger.warning(
            f"--warmup_steps {warmup_steps} is longer than training ({total_train_steps} steps): the learning rate "
            "never reaches --learning_rate"
        )
    # fit's epochs are stretches of --eval_steps steps (default: a pass over the data), each ending in an evaluation.
    fit_epoch_steps = min(args.eval_steps or steps_per_epoch, total_train_steps)
    return batch_size, total_train_steps, warmup_steps, fit_epoch_steps


def create_model(args, config, strategy, total_train_steps, warmup_steps):
    """The model (fresh, or --model_name_or_path's weights) compiled with its optimizer in the strategy's scope;
    returns it and the learning-rate schedule."""
    with strategy.scope():
        if args.model_name_or_path:
            try:
                # PyTorch's weights only by from_pt: transformers 4.57 fails on PyTorch's model.safetensors without it
                # (TypeError: 'builtins.safe_open' object is not iterable)
                from_pt = "tf_model.h5" not in saved_weights(args.model_name_or_path)
                model = TFAutoModelForMaskedLM.from_pretrained(args.model_name_or_path, config=config, from_pt=from_pt)
            except (OSError, ValueError) as e:
                fail(
                    f"--model_name_or_path {args.model_name_or_path}: "
                    f"cannot load the weights: {str(e).splitlines()[0]}"
                )
        else:
            model = TFAutoModelForMaskedLM.from_config(config)
        model(model.dummy_inputs)  # Pass some dummy inputs through the model to ensure all the weights are built
        optimizer, schedule = create_optimizer(
            num_train_steps=total_train_steps,
            num_warmup_steps=warmup_steps,
            init_lr=args.learning_rate,
            weight_decay_rate=args.weight_decay_rate,
        )
        # The model computes its own MLM loss from the labels (no loss passed to compile).
        model.compile(optimizer=optimizer, metrics=[MaskedAccuracy(), MaskedLoss()], jit_compile=args.jit_compile)
    return model, schedule


def make_decode_fn(max_length):
    """The parser of one TFRecord example: input_ids and attention_mask of max_length."""

    def decode_fn(example):
        features = {
            "input_ids": tf.io.FixedLenFeature(dtype=tf.int64, shape=(max_length,)),
            "attention_mask": tf.io.FixedLenFeature(dtype=tf.int64, shape=(max_length,)),
        }
        return tf.io.parse_single_example(example, features)

    return decode_fn


def build_datasets(args, tokenizer, decode_fn, training_records, eval_records, batch_size, replicas, strategy_name):
    """The masked training dataset and, with eval_records, the evaluation dataset (else None); also whether
    evaluation drops a last short batch."""
    mask_fn = make_mask_fn(tokenizer, args.mlm_probability)
    train_dataset = prepare_dataset(
        training_records,
        decode_fn=decode_fn,
        mask_fn=mask_fn,
        batch_size=batch_size,
        shuffle=True,
        shuffle_buffer_size=args.shuffle_buffer_size,
        seed=args.seed,
    )
    eval_dataset = None
    # TPUs need full batches, and a replica's share of a short one can hold no masked token (a NaN loss); on
    # one device every evaluation block counts, as in the other scripts.
    full_batches = replicas > 1 or strategy_name == "TPUStrategy"
    if eval_records:
        eval_dataset = prepare_dataset(
            eval_records,
            decode_fn=decode_fn,
            mask_fn=mask_fn,
            batch_size=batch_size,
            shuffle=False,
            drop_remainder=full_batches,
        )
        if full_batches and count_samples(eval_records) < batch_size:
            fail(
                f"--eval_dataset holds {count_samples(eval_records)} samples, "
                f"fewer than one global batch ({batch_size})"
            )
    return train_dataset, eval_dataset, full_batches


def make_callbacks(args, tokenizer, total_train_steps, schedule):
    """The step timer and TensorBoard log (TrainingLog), and with --hub_model_id the upload to the hub."""
    timer = TrainingLog(total_train_steps, schedule, open_summary_writer(args))
    callbacks = [timer]
    if args.hub_model_id:
        from transformers import PushToHubCallback

        callbacks.append(
            PushToHubCallback(output_dir=args.output_dir, hub_model_id=args.hub_model_id, tokenizer=tokenizer)
        )
    return timer, callbacks


def train(model, train_dataset, eval_dataset, total_train_steps, fit_epoch_steps, callbacks):
    """Keras' fit over total_train_steps, in fit epochs of fit_epoch_steps; returns its history and the runtime."""
    start = time.perf_counter()
    history = model.fit(
        train_dataset,
        validation_data=eval_dataset,
        epochs=math.ceil(total_train_steps / fit_epoch_steps),
        steps_per_epoch=fit_epoch_steps,
        callbacks=callbacks,
        verbose=2 if not sys.stdout.isatty() else "auto",
    ).history
    runtime = time.perf_counter() - start
    return history, runtime


def save_and_check_reload(model, tokenizer, output_dir, training_records, decode_fn):
    """Save model and tokenizer to output_dir, and fail unless the saved model gives back the trained model's
    logits; returns their largest difference."""
    os.makedirs(output_dir, exist_ok=True)
    save_atomically(model, tokenizer, output_dir)
    # The saved model must give back the trained model's outputs.
    sample = next(iter(tf.data.TFRecordDataset(training_records[:1]).map(decode_fn).batch(4).take(1)))
    reload_diff = float(
        tf.reduce_max(
            tf.abs(
                tf.cast(TFAutoModelForMaskedLM.from_pretrained(output_dir)(sample).logits, tf.float32)
                - tf.cast(model(sample).logits, tf.float32)
            )
        )
    )
    if reload_diff > 1e-4:
        fail(
            f"the model saved to {output_dir} does not reproduce the trained model "
            f"(max logit difference {reload_diff:.3g})"
        )
    return reload_diff


def write_train_results(
    args,
    history,
    timer,
    runtime,
    total_train_steps,
    fit_epoch_steps,
    batch_size,
    num_train_samples,
    replicas,
    strategy_name,
    reload_diff,
):
    """train_results.json: the masked-token metrics averaged over the run, the step times and the run's setup."""
    steady = timer.times[1:] or timer.times
    # Keras' metrics restart every fit epoch: average the stretches, weighted by their steps.
    stretches = len(history["loss"])
    weights = [fit_epoch_steps] * (stretches - 1) + [total_train_steps - fit_epoch_steps * (stretches - 1)]
    train_loss = float(np.average(history["masked_loss"], weights=weights))
    train_results = {
        "train_loss": train_loss,
        "train_keras_loss": float(np.average(history["loss"], weights=weights)),
        "train_accuracy": float(np.average(history["masked_accuracy"], weights=weights)),
        "train_perplexity": math.exp(min(train_loss, 700.0)),
        "train_runtime": runtime,
        "global_step": total_train_steps,
        "first_step_s": timer.times[0],
        "step_time_median_s": float(np.median(steady)),
        "train_tokens_per_second": batch_size * args.max_length / float(np.median(steady)),
        "train_samples": num_train_samples,
        "global_batch_size": batch_size,
        "num_devices": replicas,
        "strategy": strategy_name,
        "jit_compile": args.jit_compile,
        "bfloat16": args.bfloat16,
        "max_length": args.max_length,
        "epoch": total_train_steps * batch_size / num_train_samples,
        "reload_max_abs_logit_diff": reload_diff,
    }
    write_json(os.path.join(args.output_dir, "train_results.json"), train_results)
    logger.info(
        f"Train: loss {train_loss:.4f}, masked accuracy {train_results['train_accuracy']:.4f}, "
        f"median step {train_results['step_time_median_s'] * 1000:.1f} ms (first {timer.times[0]:.1f} s)"
    )


def write_eval_results(history, eval_records, batch_size, full_batches, output_dir):
    """eval_results.json: the last evaluation's masked-token metrics."""
    eval_loss = float(history["val_masked_loss"][-1])
    eval_results = {
        "eval_loss": eval_loss,
        "eval_keras_loss": float(history["val_loss"][-1]),
        "eval_accuracy": float(history["val_masked_accuracy"][-1]),
        "eval_perplexity": math.exp(min(eval_loss, 700.0)),
        "eval_samples": count_samples(eval_records) // batch_size * batch_size
        if full_batches
        else count_samples(eval_records),
    }
    write_json(os.path.join(output_dir, "eval_results.json"), eval_results)
    logger.info(
        f"Eval: loss {eval_loss:.4f}, masked accuracy {eval_results['eval_accuracy']:.4f}, "
        f"perplexity {eval_results['eval_perplexity']:.2f}"
    )


def main(argv=None):
    args = parse_args(argv)
    configure_logging()
    # Logical CPU devices must be configured before TensorFlow touches any device.
    split_cpu_devices(args.num_cpu_devices)

    output_dir = args.output_dir
    check_output_dir(output_dir, args.overwrite_output_dir)
    config_source = check_model_sources(args)
    training_records, num_train_samples = find_shards("--train_dataset", args.train_dataset, args.max_length)
    eval_records = find_shards("--eval_dataset", args.eval_dataset, args.max_length)[0] if args.eval_dataset else None

    lock = lock_output_dir(output_dir)
    strategy, strategy_name = setup_strategy(args)
    replicas = strategy.num_replicas_in_sync
    set_precision_and_seed(args, strategy_name)
    tokenizer, config = load_tokenizer_and_config(args, config_source)
    for flag, path, records in (
        ("--train_dataset", args.train_dataset, training_records),
        ("--eval_dataset", args.eval_dataset, eval_records or []),
    ):
        if records:
            check_tokenizer(flag, path, records, tokenizer)
    config = fit_config(args, config_source, config, tokenizer)
    batch_size, total_train_steps, warmup_steps, fit_epoch_steps = plan_steps(args, num_train_samples, replicas)
    model, schedule = create_model(args, config, strategy, total_train_steps, warmup_steps)
    logger.info(
        f"Model: {config.model_type}, {model.count_params():,} parameters; {num_train_samples:,} training samples, "
        f"global batch {batch_size}, {total_train_steps} steps ({warmup_steps} warm-up)"
        + (f", evaluating every {fit_epoch_steps}" if args.eval_dataset else "")
    )

    decode_fn = make_decode_fn(args.max_length)
    train_dataset, eval_dataset, full_batches = build_datasets(
        args, tokenizer, decode_fn, training_records, eval_records, batch_size, replicas, strategy_name
    )
    timer, callbacks = make_callbacks(args, tokenizer, total_train_steps, schedule)
    history, runtime = train(model, train_dataset, eval_dataset, total_train_steps, fit_epoch_steps, callbacks)

    reload_diff = save_and_check_reload(model, tokenizer, output_dir, training_records, decode_fn)
    write_train_results(
        args,
        history,
        timer,
        runtime,
        total_train_steps,
        fit_epoch_steps,
        batch_size,
        num_train_samples,
        replicas,
        strategy_name,
        reload_diff,
    )
    if eval_dataset is not None:
        write_eval_results(history, eval_records, batch_size, full_batches, output_dir)
    logger.info(f"Model, tokenizer and results saved to {output_dir}")
    lock.close()


if __name__ == "__main__":
    main()
