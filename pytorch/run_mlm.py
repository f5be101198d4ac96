#!/usr/bin/env python
# Reproduction of Hugging Face's examples/pytorch/language-modeling/run_mlm.py (Apache-2.0 upstream),
# rewritten for transformers 4.57.6 / torch 2.13, offline by default. The PyTorch baseline of the
# Flax example: same data files, tokenizer and config folders as flax/run_mlm_flax.py.
"""Pretrain or fine-tune a masked language model (BERT, RoBERTa, ...) on the Trainer.

Launch it three ways (see README.md):
  python pytorch/run_mlm.py ...                                   one process (CPU, one GPU)
  torchrun --nproc_per_node N pytorch/run_mlm.py ...              data parallel (GPUs, or gloo on CPU)
  python pytorch/xla_spawn.py --num_cores N pytorch/run_mlm.py ... PyTorch/XLA (TPU; XLA:CPU with N=1)

Differences from upstream, all fixes:
- Masks are drawn per example from (seed, epoch, example index): one process, N processes and
  gradient accumulation train on exactly the same masked batches, a resumed run continues exactly,
  and evaluation masks the same tokens every time.
- The loss is the mean over all masked tokens of the global batch (summed across gradient-accumulation
  steps and processes), so N processes or K accumulation steps give the same update as one big batch.
  Upstream averaged per micro-batch means, which weighs a micro-batch with few masked tokens up.
- Eval loss and perplexity are token-weighted over the whole eval set; accuracy counts masked tokens
  only and needs no hub (`evaluate.load("accuracy")` fails offline).
- On a machine without an accelerator the CPU is chosen for the user: `torchrun` then really trains
  data parallel over gloo (without `--use_cpu`, transformers 4.57 leaves every rank alone with world
  size 1), and `--bf16` runs as CPU autocast instead of failing.
- Resuming skips a last checkpoint that was only half written (no trainer_state.json).
- A rank that loses another (dead, or silent for --ddp_timeout seconds: transformers 4.57 drops that timeout
  on CPUs, where gloo waited 30 minutes) stops in one line naming the step and the checkpoint, exit code 75.
- Bad input (files, output folder, hub names offline, ...) ends with one line and a non-zero exit.
"""

import atexit
import codecs
import contextlib
import datetime
import difflib
import fcntl
import functools
import gc
import importlib.util
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field, replace
from itertools import chain

# Only PyTorch is used: keep transformers from importing TensorFlow and JAX (several seconds).
os.environ.setdefault("USE_TF", "0")
os.environ.setdefault("USE_FLAX", "0")
if importlib.util.find_spec("transformers") is None:  # the system's Python, not .venv's
    sys.exit(
        f"{os.path.basename(__file__)}: error: transformers is not installed for {sys.executable}: bash run.sh "
        "setup, then source .venv/bin/activate"
    )
# A captured log (no terminal) gets a progress bar line every 30 s, not one every 0.1 s joined by carriage returns.
if not sys.stderr.isatty():
    os.environ.setdefault("TQDM_MININTERVAL", "30")

import datasets
import numpy as np
import safetensors
import torch
import torch.nn.functional as F
import transformers
from datasets import load_dataset
from transformers import (
    CONFIG_MAPPING,
    MODEL_FOR_MASKED_LM_MAPPING,
    AutoConfig,
    AutoModelForMaskedLM,
    AutoTokenizer,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import is_torch_mps_available, is_torch_xla_available, is_torch_xpu_available

logger = logging.getLogger(__name__)

MODEL_CONFIG_CLASSES = list(MODEL_FOR_MASKED_LM_MAPPING.keys())
MODEL_TYPES = tuple(conf.model_type for conf in MODEL_CONFIG_CLASSES)
# These models number positions from pad_token_id + 1, so they fit max_position_embeddings - pad - 1 tokens.
OFFSET_POSITION_MODELS = ("roberta", "roberta-prelayernorm", "xlm-roberta", "camembert")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": (
                "The model checkpoint for weights initialization. Don't set if you want to train a model from scratch."
            )
        },
    )
    model_type: str | None = field(
        default=None,
        metadata={"help": "If training from scratch, pass a model type from the list: " + ", ".join(MODEL_TYPES)},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": (
                "Override some existing default config settings when a model is trained from scratch. Example: "
                "n_embd=10,resid_pdrop=0.2,scale_attn_weights=false,summary_type=cls_index"
            )
        },
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Pretrained config name or path if not the same as model_name"}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Pretrained tokenizer name or path if not the same as model_name"}
    )
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "Where do you want to store the pretrained models downloaded from huggingface.co"},
    )
    use_fast_tokenizer: bool = field(
        default=True,
        metadata={"help": "Whether to use one of the fast tokenizer (backed by the tokenizers library) or not."},
    )
    model_revision: str = field(
        default="main",
        metadata={"help": "The specific model version to use (can be a branch name, tag name or commit id)."},
    )
    token: str = field(
        default=None, metadata={"help": "The token to use as HTTP bearer authorization for remote files."}
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Whether to trust the execution of code from datasets/models defined on the Hub."},
    )
    torch_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Override the default `torch.dtype` and load the model under this dtype.",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )
    low_cpu_mem_usage: bool = field(
        default=False,
        metadata={
            "help": (
                "Create the model as an empty shell, then materialize its parameters when the pretrained weights are "
                "loaded."
            )
        },
    )


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "The name of the dataset to use (via the datasets library)."}
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "The configuration name of the dataset to use (via the datasets library)."}
    )
    train_file: str | None = field(
        default=None, metadata={"help": "The input training data file (a text, csv or json file)."}
    )
    validation_file: str | None = field(
        default=None,
        metadata={"help": "An optional input evaluation data file to evaluate the perplexity on (a text file)."},
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Overwrite the cached training and evaluation sets"}
    )
    validation_split_percentage: int | None = field(
        default=5,
        metadata={
            "help": "The percentage of the train set used as validation set in case there's no validation split"
        },
    )
    max_seq_length: int | None = field(
        default=None,
        metadata={
            "help": (
                "The maximum total input sequence length after tokenization (default: the tokenizer's, capped by the "
                "model's positions)."
            )
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "The number of processes to use for the preprocessing."}
    )
    mlm_probability: float = field(
        default=0.15, metadata={"help": "Ratio of tokens to mask for masked language modeling loss"}
    )
    line_by_line: bool = field(
        default=False,
        metadata={"help": "Whether distinct lines of text in the dataset are to be handled as distinct sequences."},
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={
            "help": (
                "Whether to pad all samples to `max_seq_length`. If False, will pad the samples dynamically when "
                "batching to the maximum length in the batch."
            )
        },
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={
            "help": (
                "For debugging purposes or quicker training, truncate the number of training examples to this value "
                "if set."
            )
        },
    )
    max_eval_samples: int | None = field(
        default=None,
        metadata={
            "help": (
                "For debugging purposes or quicker training, truncate the number of evaluation examples to this "
                "value if set."
            )
        },
    )
    streaming: bool = field(default=False, metadata={"help": "Enable streaming mode (needs --max_steps)."})


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
    """A name that is not a local path is a hub id: fail at once if the hub cannot be reached, unless HF_HUB_OFFLINE=1
    asks for the local cache (a name missing from it then fails in one line where it is loaded)."""
    from huggingface_hub import constants

    if name is None or os.path.exists(name) or constants.HF_HUB_OFFLINE:
        return
    if not hub_reachable():
        fail(
            f"{flag} {name!r} is not a local path and the Hugging Face Hub is unreachable (offline?); "
            "pass local files instead (--train_file/--validation_file for data, a folder for models/tokenizers; "
            "see tokenizers/prepare_corpus.py), or set HF_HUB_OFFLINE=1 to use a copy in the local cache"
        )


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


def warn_if_bf16_is_slow(training_args):
    """One warning line when --bf16 is asked for on a CPU without bf16 instructions; the run goes on as asked."""
    if not training_args.bf16 or training_args.device.type != "cpu":
        return
    model, support = cpu_bf16()
    if support.startswith("none"):
        logger.warning(
            f"--bf16: this CPU ({model}, bf16: {support}) has no bf16 instructions; PyTorch emulates bf16 "
            "products here, many times slower than float32. Going on as asked."
        )


def has_accelerator():
    return (
        torch.cuda.is_available() or is_torch_xla_available() or is_torch_mps_available() or is_torch_xpu_available()
    )


def parse_args(argv=None):
    """The three argument groups. With no accelerator, --use_cpu defaults to true before TrainingArguments
    sets up its devices: that is what makes torchrun data parallel over gloo, and --bf16 CPU autocast."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    parser.error = fail  # argparse's errors (a bad value, a missing flag) as one line, not a usage block
    defaults = {} if has_accelerator() else {"use_cpu": True}
    parser.set_defaults(**defaults)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        if not os.path.isfile(argv[0]):
            fail(f"arguments file {argv[0]} does not exist")
        try:
            with open(argv[0]) as f:
                given = json.load(f)
            start_cpu_process_group(given)
            model_args, data_args, training_args = parser.parse_dict({**defaults, **given})
        except ValueError as e:  # also malformed JSON and unknown keys
            fail(f"arguments file {argv[0]}: {str(e).splitlines()[0]}")
    else:
        start_cpu_process_group(vars(parser.parse_known_args(argv)[0]))
        model_args, data_args, training_args, unknown = parser.parse_args_into_dataclasses(
            args=argv, return_remaining_strings=True
        )
        if unknown:
            flag = next((arg for arg in unknown if arg.startswith("-")), unknown[0]).split("=")[0]
            options = [option.lstrip("-") for action in parser._actions for option in action.option_strings]
            close = difflib.get_close_matches(flag.lstrip("-"), options, n=1)  # without "--", --lr is not near --help
            fail(f"unknown argument {flag}" + (f"; did you mean --{close[0]}?" if close else "; see --help"))
    if not torch.cuda.is_available():
        training_args.dataloader_pin_memory = False  # pinned memory only speeds up copies to a CUDA device
    return model_args, data_args, training_args


def start_cpu_process_group(given):
    """Under torchrun without an accelerator, start the process group with --ddp_timeout (given: the arguments as
    parsed so far), before TrainingArguments sets up its devices: transformers 4.57 passes the timeout only to an
    accelerator's group, so gloo's would wait its default 30 minutes for a rank that stopped answering."""
    if has_accelerator() or int(os.environ.get("WORLD_SIZE", "1")) < 2 or torch.distributed.is_initialized():
        return
    timeout = datetime.timedelta(seconds=given.get("ddp_timeout") or 1800)
    torch.distributed.init_process_group(given.get("ddp_backend") or "gloo", timeout=timeout)


def validate_args(model_args, data_args, training_args):
    if data_args.dataset_name is None and data_args.train_file is None and data_args.validation_file is None:
        fail("need --dataset_name or --train_file/--validation_file")
    for flag, path in (("--train_file", data_args.train_file), ("--validation_file", data_args.validation_file)):
        if path is not None:
            check_data_file(flag, path)
    if data_args.train_file and data_args.validation_file:
        extensions = {path.split(".")[-1] for path in (data_args.train_file, data_args.validation_file)}
        if len(extensions) > 1:
            fail(
                "--train_file and --validation_file must have the same extension (one loader reads both), got "
                f"{sorted(extensions)}"
            )
    if not 0.0 < data_args.mlm_probability < 1.0:
        fail(f"--mlm_probability must be in (0, 1), got {data_args.mlm_probability}")
    if data_args.streaming and training_args.do_train and training_args.max_steps <= 0:
        fail("--streaming needs --max_steps (a stream has no length to count epochs with)")
    if not training_args.do_train and not training_args.do_eval:
        fail("nothing to do: pass --do_train and/or --do_eval")
    for flag in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
    ):
        if getattr(training_args, flag) <= 0:
            fail(f"--{flag} must be positive, got {getattr(training_args, flag)}")
    for flag in ("weight_decay", "warmup_steps", "warmup_ratio"):
        if getattr(training_args, flag) < 0:
            fail(f"--{flag} must not be negative, got {getattr(training_args, flag)}")
    if model_args.config_overrides is not None and model_args.model_name_or_path is not None:
        fail(
            "--config_overrides changes the architecture of a model trained from scratch; it cannot be combined "
            "with --model_name_or_path (pretrained weights fix the shapes)"
        )
    for flag in ("config_name", "model_name_or_path"):
        path = getattr(model_args, flag)
        if path and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            fail(f"--{flag} {path} holds no config.json; write one with tokenizers/create_config.py")
    tokenizer_flag = "tokenizer_name" if model_args.tokenizer_name else "model_name_or_path"
    if getattr(model_args, tokenizer_flag):
        check_tokenizer_folder(f"--{tokenizer_flag}", getattr(model_args, tokenizer_flag))
    if model_args.model_type is not None and model_args.model_type not in MODEL_TYPES:
        fail(f"--model_type {model_args.model_type!r} has no masked-LM model; choose one of {', '.join(MODEL_TYPES)}")
    if os.path.exists(training_args.output_dir) and not os.path.isdir(training_args.output_dir):
        fail(f"--output_dir {training_args.output_dir} exists and is not a directory")
    check_writable("--output_dir", training_args.output_dir)
    if training_args.push_to_hub and not hub_reachable():
        fail(
            f"--push_to_hub: the Hugging Face Hub is unreachable (offline?); drop --push_to_hub and upload "
            f"{training_args.output_dir} later"
        )
    check_hub_name("--dataset_name", data_args.dataset_name)
    for flag in ("model_name_or_path", "config_name", "tokenizer_name"):
        check_hub_name(f"--{flag}", getattr(model_args, flag))


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
                fail(
                    f"{flag} {path} is not UTF-8 text (byte 0x{chunk[e.start]:02x} on line {where}); convert it "
                    "first, e.g. with iconv -f latin1 -t utf-8"
                )
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
            f"another run ({lock.read().strip() or 'unknown'}) is writing into {output_dir}; wait for it to end, or "
            "choose another --output_dir"
        )
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


def check_checkpoint_config(checkpoint, config):
    """A checkpoint is resumed only into the model that wrote it: refuse one of another architecture before the
    Trainer dies of a size mismatch."""
    saved = {}
    if os.path.isfile(os.path.join(checkpoint, "config.json")):
        with open(os.path.join(checkpoint, "config.json")) as f:
            saved = json.load(f)
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "type_vocab_size",
    )
    differing = [
        f"{k} {saved[k]} there, {getattr(config, k, None)} here"
        for k in keys
        if k in saved and saved[k] != getattr(config, k, None)
    ]
    if differing:
        fail(
            f"{checkpoint} holds a model of another config ({'; '.join(differing)}); resume with the config that "
            "wrote it, or start afresh with --overwrite_output_dir"
        )


def checkpoints_newest_first(output_dir):
    """The checkpoint-N folders in output_dir, the highest N first."""
    steps = sorted(
        (int(name[len(PREFIX_CHECKPOINT_DIR) + 1 :]), name)
        for name in os.listdir(output_dir)
        if name.startswith(PREFIX_CHECKPOINT_DIR + "-") and name[len(PREFIX_CHECKPOINT_DIR) + 1 :].isdigit()
    )
    return [os.path.join(output_dir, name) for _, name in reversed(steps)]


def find_checkpoint(training_args):
    """The checkpoint to resume from: --resume_from_checkpoint, or the newest checkpoint-N in output_dir that is
    whole (checkpoint_damage); a damaged one is skipped with a line, or refused when named."""
    output_dir = training_args.output_dir
    if training_args.resume_from_checkpoint is not None:
        path = training_args.resume_from_checkpoint
        if damage := checkpoint_damage(path):
            fail(f"--resume_from_checkpoint {path} cannot be resumed: {damage}")
        return path
    if training_args.overwrite_output_dir or not os.path.isdir(output_dir):
        return None
    if not training_args.do_train:
        if os.path.exists(os.path.join(output_dir, "eval_results.json")):
            fail(
                f"{output_dir} already holds an eval_results.json; pass --overwrite_output_dir to replace it, or "
                "choose another --output_dir"
            )
        return None
    for path in checkpoints_newest_first(output_dir):
        if not (damage := checkpoint_damage(path)):
            logger.info(
                f"Checkpoint detected, resuming training at {path}. To avoid this behavior, change "
                "the `--output_dir` or add `--overwrite_output_dir` to train from scratch."
            )
            return path
        logger.warning(f"skipping {path}: {damage}")
    if set(os.listdir(output_dir)) - {".lock"}:
        fail(
            f"output directory {output_dir} is not empty and holds no checkpoint to resume from; "
            "pass --overwrite_output_dir to write into it"
        )
    return None


def checkpoint_damage(path):
    """Why the Trainer's checkpoint `path` cannot be resumed exactly, or None: trainer_state.json (written last: a
    checkpoint without it was cut short), the model's weights (readable), the optimizer's and the schedule's state
    (without them the Trainer would silently start both afresh)."""
    if not os.path.isdir(path):
        return "no such folder"
    weights = next((n for n in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(f"{path}/{n}")), None)
    for name in ("trainer_state.json", weights or "model.safetensors", "optimizer.pt", "scheduler.pt"):
        if not os.path.isfile(os.path.join(path, name)):
            cut = " (not a Trainer checkpoint, or cut short while saving)" if name == "trainer_state.json" else ""
            return f"{name} is missing{cut}"
    try:
        if weights == "model.safetensors":
            with safetensors.safe_open(os.path.join(path, weights), "pt") as f:
                f.keys()
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file
        return f"{weights} is damaged ({str(e).splitlines()[0]})"
    return None


@dataclass
class DataCollatorForMaskedLM:
    """Pads a batch and masks it for MLM: of the tokens that are neither special nor padding,
    `mlm_probability` are selected; of those 80% become the mask token, 10% a random token, 10% stay.
    Labels are -100 elsewhere. Each example's draws come from its own generator, seeded by
    (seed, epoch, example_id) in training and (seed, example_id) in evaluation, so masks do not depend
    on batch size, process count, gradient accumulation, DataLoader workers or resumption."""

    tokenizer: PreTrainedTokenizerBase
    mlm_probability: float = 0.15
    seed: int = 42
    pad_to_multiple_of: int | None = None
    evaluating: bool = False
    # In shared memory: DataLoader workers kept across epochs (--dataloader_persistent_workers) keep the collator they
    # started with, and would draw every epoch's masks with the first epoch's key.
    shared_epoch: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64).share_memory_())

    @property
    def epoch(self):
        return int(self.shared_epoch)

    @epoch.setter
    def epoch(self, epoch):
        self.shared_epoch.fill_(epoch)

    def __call__(self, features):
        features = [dict(f) for f in features]
        ids = [int(f.pop("example_id")) for f in features]
        lengths = [len(f["input_ids"]) for f in features]
        # Padding pre-tokenized ids is what pad() is for: silence its advice to call the tokenizer instead.
        self.tokenizer.deprecation_warnings["Asking-to-pad-a-fast-tokenizer"] = True
        batch = self.tokenizer.pad(features, pad_to_multiple_of=self.pad_to_multiple_of, return_tensors="np")
        special_tokens_mask = batch.pop("special_tokens_mask", None)
        shape = batch["input_ids"].shape
        uniform = np.ones((3,) + shape)
        words = np.zeros(shape, dtype=np.int64)
        for row, (example_id, length) in enumerate(zip(ids, lengths)):
            key = [self.seed, example_id] if self.evaluating else [self.seed, self.epoch, example_id]
            rng = np.random.default_rng([1 if self.evaluating else 0, *key])
            uniform[:, row, :length] = rng.random((3, length))
            words[row, :length] = rng.integers(0, self.tokenizer.vocab_size, size=length)
        inputs, labels = self.mask_tokens(
            batch["input_ids"], special_tokens_mask, batch.get("attention_mask"), uniform, words
        )
        batch["input_ids"], batch["labels"] = inputs, labels
        return {k: torch.as_tensor(np.asarray(v, dtype=np.int64)) for k, v in batch.items()}

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


class MaskEpochCallback(TrainerCallback):
    """Tells the collator which epoch it is masking for (read from the state, so resuming works too)."""

    def __init__(self, collator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(math.floor(state.epoch + 1e-6))


class MaskedLMTrainer(Trainer):
    """Evaluates with the collator's evaluation masks and reports the token-weighted eval loss. It needs each token's
    prediction and loss (two numbers a token, see preprocess_logits_for_metrics), so it gathers them even under
    --prediction_loss_only: eval_loss means the same with and without that flag.

    torch_xla's loaders collate and read ahead in threads of their own, so the evaluation masks come from a collator
    of the evaluation loader's own (a flag on the shared one would reach training batches collated meanwhile), and
    every row is gathered as is: accelerate's gather_for_metrics cuts a batch down to the last batch's rows when the
    loader reports its end, which a thread running ahead reports early (it cut rows of full batches).
    compute_metrics drops the padding, which comes last."""

    def get_eval_dataloader(self, eval_dataset=None):
        training = self.data_collator
        self.data_collator = replace(training, evaluating=True)
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator = training

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        per_token = False if self.compute_metrics is not None else prediction_loss_only
        self.gather_function = self.accelerator.gather  # the Trainer sets it back after its loop
        output = super().evaluation_loop(dataloader, description, per_token, ignore_keys, metric_key_prefix)
        prefix = metric_key_prefix
        if f"{prefix}_token_loss" in output.metrics:
            output.metrics[f"{prefix}_loss"] = output.metrics.pop(f"{prefix}_token_loss")
            output.metrics[f"{prefix}_perplexity"] = math.exp(min(output.metrics[f"{prefix}_loss"], 700.0))
        return output


def masked_lm_loss(outputs, labels, num_items_in_batch=None):
    """Cross-entropy summed over the masked tokens, divided by the masked tokens of the whole global
    batch (the Trainer counts them across accumulation steps and processes); in evaluation, the mean."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    labels = labels.to(logits.device)
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    if num_items_in_batch is None:
        num_items_in_batch = (labels != -100).sum().clamp(min=1)
    return loss / num_items_in_batch


def preprocess_logits_for_metrics(logits, labels):
    """Keep only what the metrics need, per token: the prediction and its cross-entropy."""
    if isinstance(logits, tuple):
        logits = logits[0]
    token_loss = F.cross_entropy(logits.float().transpose(1, 2), labels.clamp(min=0), reduction="none")
    return logits.argmax(dim=-1), token_loss


def compute_metrics(eval_preds, rows=None):
    """`rows`: the evaluation set's, the first gathered (processes pad their last batches with repeated rows)."""
    (predictions, token_loss), labels = eval_preds
    predictions, token_loss, labels = predictions[:rows], token_loss[:rows], labels[:rows]
    mask = labels != -100
    count = int(mask.sum())
    return {
        "accuracy": float((predictions[mask] == labels[mask]).mean()) if count else float("nan"),
        "token_loss": float(token_loss[mask].astype(np.float64).sum() / count) if count else float("nan"),
        "masked_tokens": count,
    }


def group_texts(examples, max_seq_length):
    """Concatenate all texts and cut them into blocks of max_seq_length, dropping the remainder
    (a batch shorter than one block is kept whole), as upstream but in linear time."""
    concatenated = {k: list(chain.from_iterable(examples[k])) for k in examples.keys()}
    total_length = len(concatenated[list(examples.keys())[0]])
    if total_length >= max_seq_length:
        total_length = (total_length // max_seq_length) * max_seq_length
    return {
        k: [t[i : i + max_seq_length] for i in range(0, total_length, max_seq_length)] for k, t in concatenated.items()
    }


def load_raw_datasets(model_args, data_args):
    split_pct = data_args.validation_split_percentage
    common = dict(cache_dir=model_args.cache_dir, token=model_args.token, streaming=data_args.streaming)
    if data_args.dataset_name is not None:
        load = functools.partial(
            load_dataset,
            data_args.dataset_name,
            data_args.dataset_config_name,
            trust_remote_code=model_args.trust_remote_code,
            **common,
        )
    else:
        data_files = {}
        if data_args.train_file is not None:
            data_files["train"] = data_args.train_file
        if data_args.validation_file is not None:
            data_files["validation"] = data_args.validation_file
        extension = (data_args.train_file or data_args.validation_file).split(".")[-1]
        extension = "text" if extension == "txt" else extension
        load = functools.partial(load_dataset, extension, data_files=data_files, **common)
    source = data_args.dataset_name or data_args.train_file or data_args.validation_file
    try:
        raw = load()
        if "validation" not in raw.keys() and "train" in raw.keys():
            if data_args.streaming:
                fail(
                    "--streaming needs a validation split: pass --validation_file (a stream cannot be split by "
                    "percentage)"
                )
            if round(len(raw["train"]) * split_pct / 100) == 0:
                fail(
                    f"{source} is too short to split {split_pct} % off for validation (it has {len(raw['train'])} "
                    "examples); give --validation_file, or more text"
                )
            raw["validation"] = load(split=f"train[:{split_pct}%]")
            raw["train"] = load(split=f"train[{split_pct}%:]")
    except Exception as e:  # noqa: BLE001 - a dataset that cannot be read becomes one line
        fail(f"cannot load dataset {source!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return raw


def text_column(raw_datasets, data_args):
    """The column that holds the text: `text`, else (as upstream) the first column, if it holds strings."""
    features = raw_datasets["train" if "train" in raw_datasets else "validation"].features
    if features is None:  # a stream of unknown columns: upstream's default
        return "text"
    columns = list(features)
    if "text" in columns:
        return "text"
    if getattr(features[columns[0]], "dtype", None) in ("string", "large_string"):
        logger.warning(f"no column named 'text': taking the text from the first column, {columns[0]!r}")
        return columns[0]
    source = data_args.dataset_name or data_args.train_file or data_args.validation_file
    fail(
        f"{source} has no column named 'text' (its columns: {', '.join(columns)}); name the column that holds the "
        "text 'text'"
    )


def load_config_and_tokenizer(model_args):
    hub_kwargs = dict(
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
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
        if model_args.config_overrides is not None:
            logger.info(f"Overriding config: {model_args.config_overrides}")
            config.update_from_string(model_args.config_overrides)
        tokenizer_source = model_args.tokenizer_name or model_args.model_name_or_path
        if tokenizer_source is None:
            fail(
                "you are instantiating a new tokenizer from scratch, which this script does not do; "
                "train one with tokenizers/train_tokenizer.py and pass it with --tokenizer_name"
            )
        tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_source, use_fast=model_args.use_fast_tokenizer, **hub_kwargs
        )
    except Exception as e:  # noqa: BLE001 - a damaged tokenizer.json raises a bare Exception
        fail(f"cannot load the config or tokenizer: {(str(e).splitlines() or [type(e).__name__])[0]}")
    if model_args.model_type not in (None, config.model_type):
        source = model_args.config_name or model_args.model_name_or_path
        fail(
            f"--model_type {model_args.model_type}, but {source} holds a {config.model_type} config; drop one of the "
            "two"
        )
    if config.model_type not in MODEL_TYPES:
        fail(f"config model_type {config.model_type!r} has no masked-LM model; choose one of {', '.join(MODEL_TYPES)}")
    if config.vocab_size < len(tokenizer):
        fail(
            f"the config's vocab_size ({config.vocab_size}) is smaller than the tokenizer's {len(tokenizer)} tokens; "
            "rebuild the config with tokenizers/create_config.py --tokenizer_name ..."
        )
    if tokenizer.mask_token is None:
        fail(f"tokenizer {tokenizer_source!r} has no mask token, which masked language modelling needs")
    if config.hidden_size % config.num_attention_heads:
        fail(
            f"the config's hidden size {config.hidden_size} is not divisible by its {config.num_attention_heads} "
            "attention heads; fix the config (tokenizers/create_config.py --config_overrides)"
        )
    return config, tokenizer


def resolve_max_seq_length(data_args, config, tokenizer):
    """The tokenizer's limit and the model's positions both bound the sequence length."""
    model_positions = getattr(config, "max_position_embeddings", None)
    if model_positions is not None and config.model_type in OFFSET_POSITION_MODELS:
        model_positions -= (config.pad_token_id or 0) + 1
    if data_args.max_seq_length is None:
        max_seq_length = min(tokenizer.model_max_length, model_positions or tokenizer.model_max_length)
    else:
        if data_args.max_seq_length > tokenizer.model_max_length:
            logger.warning(
                f"--max_seq_length {data_args.max_seq_length} is larger than the tokenizer's maximum "
                f"({tokenizer.model_max_length}); using {tokenizer.model_max_length}."
            )
        max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)
    if model_positions is not None and max_seq_length > model_positions:
        fail(f"--max_seq_length {max_seq_length} is longer than the model's {model_positions} positions")
    if max_seq_length <= 0:
        fail(f"--max_seq_length must be positive, got {max_seq_length}")
    return max_seq_length


def preprocess(raw_datasets, data_args, training_args, tokenizer, max_seq_length):
    """Tokenize (line by line, or concatenated and grouped into blocks) and number the examples."""
    column_names = list(raw_datasets["train" if "train" in raw_datasets else "validation"].features or ["text"])
    text_column_name = text_column(raw_datasets, data_args)
    map_kwargs = (
        {}
        if data_args.streaming
        else dict(num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache)
    )

    if data_args.line_by_line:
        padding = "max_length" if data_args.pad_to_max_length else False

        def tokenize_function(examples):
            """Each non-blank line's first max_seq_length tokens, and (fast tokenizers) how many it had and lost."""
            lines = [line for line in examples[text_column_name] if len(line) > 0 and not line.isspace()]
            rows = tokenizer(
                lines,
                return_special_tokens_mask=True,
                padding=padding,
                truncation=True,
                max_length=max_seq_length,
                return_overflowing_tokens=tokenizer.is_fast,  # the cut parts as extra rows of the same line
            )
            line_of = rows.pop("overflow_to_sample_mapping", range(len(lines)))
            counts = np.zeros((2, len(lines)), np.int64)  # tokens kept, tokens cut (special ones aside)
            for row, (line, specials) in enumerate(zip(line_of, rows["special_tokens_mask"])):
                counts[int(row > 0 and line == line_of[row - 1]), line] += len(specials) - sum(specials)
            first = [row for row, line in enumerate(line_of) if row == 0 or line != line_of[row - 1]]
            return {**{k: [v[row] for row in first] for k, v in rows.items()}, "kept": counts[0], "cut": counts[1]}

        steps = [(tokenize_function, "Running tokenizer on dataset line_by_line", column_names)]
    else:
        # Every text becomes a sequence with its special tokens; group_texts then packs them into blocks.
        def tokenize_function(examples):
            return tokenizer(examples[text_column_name], return_special_tokens_mask=True)

        steps = [
            (tokenize_function, "Running tokenizer on every text in dataset", column_names),
            (
                lambda examples: group_texts(examples, max_seq_length),
                f"Grouping texts in chunks of {max_seq_length}",
                None,
            ),
        ]
    with training_args.main_process_first(desc="dataset map pre-processing"):
        for function, desc, remove in steps:
            extra = {} if data_args.streaming else dict(desc=desc, **map_kwargs)
            raw_datasets = raw_datasets.map(function, batched=True, remove_columns=remove, **extra)
        if data_args.line_by_line:
            for split, rows in raw_datasets.items() if not data_args.streaming else ():  # a stream cannot be counted
                kept, cut = (np.asarray(rows[name]) for name in ("kept", "cut"))
                if cut.any():
                    logger.warning(
                        f"--line_by_line: {np.count_nonzero(cut):,} of {len(cut):,} {split} lines are longer than "
                        f"--max_seq_length {max_seq_length} and were cut, dropping {cut.sum():,} of their "
                        f"{cut.sum() + kept[cut > 0].sum():,} tokens "
                        f"({100 * cut.sum() / (cut.sum() + kept.sum()):.1f} % "
                        f"of all {split} tokens); raise --max_seq_length to keep them"
                    )
            raw_datasets = raw_datasets.remove_columns(["kept", "cut"])
        # The example's index seeds its masks (see DataCollatorForMaskedLM).
        numbered = {}
        for split, dataset in raw_datasets.items():
            numbered[split] = dataset.map(
                lambda example, i: {"example_id": i},
                with_indices=True,
                **({} if data_args.streaming else dict(desc=f"Numbering {split} examples", **map_kwargs)),
            )
    return numbered


def setup_logging(training_args):
    """Log to stdout, at the process's log level, for this script, datasets and transformers."""
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        force=True,
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    for name, text in QUIET.items():
        logging.getLogger(name).addFilter(lambda record, text=text: text not in record.getMessage())


# transformers' lines that read as errors or point to a hub this project never uses: the Trainer's reminder to share
# the model, and the model card's note on each result it leaves out (the card is written all the same).
QUIET = {
    "transformers.trainer": "Do not forget to share your model on huggingface.co",
    "transformers.modelcard": "Dropping the following result as it does not have all the necessary fields",
}


def prepare_training_args(training_args):
    """Adjust the training arguments for XLA and the collator, and log this process's setup."""
    if is_torch_xla_available() and training_args.optim == "adamw_torch_fused":
        logger.warning("--optim adamw_torch_fused does not run on XLA devices; using adamw_torch")
        training_args.optim = "adamw_torch"
    # The collator needs the example ids and consumes special_tokens_mask itself; what it returns
    # is exactly the model's input, so the Trainer must pass every column through.
    training_args.remove_unused_columns = False
    logger.warning(
        f"Process rank: {training_args.local_rank}, device: {training_args.device}, world size: "
        f"{training_args.world_size}, distributed training: {training_args.parallel_mode.value == 'distributed'}, "
        f"16-bits training: {training_args.fp16 or training_args.bf16}"
    )


def load_model(model_args, config, tokenizer):
    """The pretrained model, or a new one from the config; its embeddings grown to the tokenizer's size."""
    torch_dtype = (
        model_args.torch_dtype if model_args.torch_dtype in ("auto", None) else getattr(torch, model_args.torch_dtype)
    )
    if model_args.model_name_or_path:
        try:
            model = AutoModelForMaskedLM.from_pretrained(
                model_args.model_name_or_path,
                config=config,
                cache_dir=model_args.cache_dir,
                revision=model_args.model_revision,
                token=model_args.token,
                trust_remote_code=model_args.trust_remote_code,
                torch_dtype=torch_dtype,
                low_cpu_mem_usage=model_args.low_cpu_mem_usage,
            )
        except Exception as e:  # noqa: BLE001 - a missing, truncated or corrupt weights file becomes one line
            fail(
                f"cannot load the model {model_args.model_name_or_path!r} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); "
                "is its weights file complete?"
            )
    else:
        logger.info("Training new model from scratch")
        model = AutoModelForMaskedLM.from_config(
            config,
            trust_remote_code=model_args.trust_remote_code,
            torch_dtype=None if torch_dtype == "auto" else torch_dtype,
        )
    # Resize only when the tokenizer has more tokens than the model (never shrink a padded vocabulary).
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))
    return model


def check_train_schedule(train_dataset, training_args, max_seq_length):
    """Fail if the train set is shorter than one global batch; warn if the warm-up outlasts the training."""
    global_batch = (
        training_args.per_device_train_batch_size
        * training_args.world_size
        * training_args.gradient_accumulation_steps
    )
    if len(train_dataset) < global_batch:
        fail(
            f"the train set has {len(train_dataset)} examples of {max_seq_length} tokens, fewer than one global batch "
            f"({global_batch}); use more data or a smaller --per_device_train_batch_size"
        )
    steps_per_epoch = len(train_dataset) // global_batch  # about what the Trainer counts
    total = (
        training_args.max_steps
        if training_args.max_steps > 0
        else math.ceil(steps_per_epoch * training_args.num_train_epochs)
    )
    warmup = training_args.get_warmup_steps(total)
    if warmup >= total:  # the last step's rate is the schedule's at step total - 1
        logger.warning(
            f"{warmup} warm-up steps are not fewer than the {total} training steps: the learning rate only "
            f"reaches {training_args.learning_rate * (total - 1) / warmup:.3g}, "
            f"not --learning_rate {training_args.learning_rate:g}"
        )


def select_datasets(tokenized, data_args, training_args, max_seq_length):
    """The train and eval datasets (None where not asked for), cut to --max_train_samples/--max_eval_samples."""
    train_dataset = eval_dataset = None
    if training_args.do_train:
        if "train" not in tokenized:
            fail("--do_train requires a train dataset (--train_file or --dataset_name)")
        train_dataset = tokenized["train"]
        if data_args.max_train_samples is not None:
            n = data_args.max_train_samples
            train_dataset = (
                train_dataset.take(n)
                if data_args.streaming
                else train_dataset.select(range(min(len(train_dataset), n)))
            )
        if not data_args.streaming:
            check_train_schedule(train_dataset, training_args, max_seq_length)
    if training_args.do_eval:
        if "validation" not in tokenized:
            fail("--do_eval requires a validation dataset (--validation_file, or a train set to split)")
        eval_dataset = tokenized["validation"]
        if data_args.max_eval_samples is not None:
            n = data_args.max_eval_samples
            eval_dataset = (
                eval_dataset.take(n) if data_args.streaming else eval_dataset.select(range(min(len(eval_dataset), n)))
            )
    return train_dataset, eval_dataset


def build_trainer(model, tokenizer, train_dataset, eval_dataset, data_args, training_args):
    """The masking collator and the Trainer that uses it."""
    # Padding to a multiple of 8 helps tensor cores; only worth it when not padding to max length.
    pad_to_multiple_of_8 = data_args.line_by_line and training_args.fp16 and not data_args.pad_to_max_length
    collator = DataCollatorForMaskedLM(
        tokenizer,
        mlm_probability=data_args.mlm_probability,
        seed=training_args.seed,
        pad_to_multiple_of=8 if pad_to_multiple_of_8 else None,
    )
    eval_rows = None if data_args.streaming or eval_dataset is None else len(eval_dataset)
    return MaskedLMTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        compute_loss_func=masked_lm_loss,
        compute_metrics=functools.partial(compute_metrics, rows=eval_rows) if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
        callbacks=[MaskEpochCallback(collator)],
    )


def run_training(trainer, train_dataset, last_checkpoint, data_args, training_args):
    """Train (resuming from last_checkpoint), save the model and state, and log and save the train metrics."""
    if last_checkpoint:  # the Trainer would train one step more and rewrite the results
        with open(os.path.join(last_checkpoint, "trainer_state.json")) as f:
            done = json.load(f)["global_step"]
        total = trainer.set_initial_training_values(training_args, trainer.get_train_dataloader(), 1)[-1]
        if done >= total:
            fail(
                f"{last_checkpoint} is at step {done} and this run ends at step {total}: nothing left to train, "
                "every file left as it was; raise --max_steps or --num_train_epochs to train on"
            )
    # transformers 4.57 reads a multi-process CPU run's optimizer state onto the device "cpu:RANK", a location
    # torch.load does not know: such storages stay where they were read, on the CPU.
    torch.serialization.register_package(99, lambda _: None, lambda obj, at: obj if at.startswith("cpu:") else None)
    try:
        train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
    except RuntimeError as e:
        if training_args.world_size > 1 and any(text in str(e) for text in LOST_RANK):
            stop_lost_rank(e, trainer, training_args)
        raise
    trainer.save_model()  # Saves the tokenizer too for easy upload
    metrics = dict(train_result.metrics)
    if not data_args.streaming:
        metrics["train_samples"] = len(train_dataset)
    metrics.update(
        world_size=training_args.world_size,
        global_batch_size=training_args.per_device_train_batch_size
        * training_args.world_size
        * training_args.gradient_accumulation_steps,
        global_step=train_result.global_step,
    )
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()


# gloo's errors in a rank whose peer died or stopped answering for --ddp_timeout seconds
LOST_RANK = ("Application timeout caused pair closure", "Timed out waiting", "Connection closed by peer")


def stop_lost_rank(error, trainer, training_args):
    """Another rank died or stopped answering for --ddp_timeout seconds (gloo's error, here): one line naming the
    step and the checkpoint to resume from, exit code 75 (EX_TEMPFAIL, as the Flax scripts), and no teardown of a
    process group whose ranks can no longer agree."""
    whole = [path for path in checkpoints_newest_first(training_args.output_dir) if not checkpoint_damage(path)]
    named = f" with --resume_from_checkpoint {whole[0]}" if whole and training_args.resume_from_checkpoint else ""
    resume = f"rerun the command{named} to resume from {whole[0]}" if whole else "no whole checkpoint to resume from"
    reason = str(error).splitlines()[0].split("] ")[-1]  # without gloo's "[.../unbound_buffer.cc:78] "
    print(
        f"{os.path.basename(__file__)}: error: rank {training_args.process_index}: another rank was lost after step "
        f"{trainer.state.global_step} (gloo: {reason}), so this rank stopped; {resume}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(75)


def run_evaluation(trainer, eval_dataset, data_args):
    """Evaluate, and log and save the eval metrics."""
    logger.info("*** Evaluate ***")
    metrics = trainer.evaluate()
    metrics["perplexity"] = metrics["eval_perplexity"]  # upstream's key, which its example tests read
    if not data_args.streaming:
        metrics["eval_samples"] = len(eval_dataset)
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


def push_or_create_model_card(trainer, model_args, data_args, training_args):
    """Push to the hub with --push_to_hub; otherwise, after training, write the model card."""
    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "fill-mask"}
    if data_args.dataset_name is not None:
        kwargs["dataset_tags"] = data_args.dataset_name
        kwargs["dataset"] = (
            data_args.dataset_name
            if data_args.dataset_config_name is None
            else f"{data_args.dataset_name} {data_args.dataset_config_name}"
        )
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    elif training_args.do_train:
        trainer.create_model_card(**kwargs)


def main(argv=None):
    model_args, data_args, training_args = parse_args(argv)
    setup_logging(training_args)
    validate_args(model_args, data_args, training_args)
    warn_if_bf16_is_slow(training_args)
    last_checkpoint = find_checkpoint(training_args)
    prepare_training_args(training_args)
    lock = lock_output_dir(training_args.output_dir) if training_args.process_index == 0 else None

    set_seed(training_args.seed)
    raw_datasets = load_raw_datasets(model_args, data_args)
    config, tokenizer = load_config_and_tokenizer(model_args)
    if last_checkpoint is not None:
        check_checkpoint_config(last_checkpoint, config)
    max_seq_length = resolve_max_seq_length(data_args, config, tokenizer)
    model = load_model(model_args, config, tokenizer)
    # After every check that can refuse the input: a refusal's one line is not preceded by 170 lines of arguments.
    logger.info(f"Training/evaluation parameters {training_args}")

    tokenized = preprocess(raw_datasets, data_args, training_args, tokenizer, max_seq_length)
    train_dataset, eval_dataset = select_datasets(tokenized, data_args, training_args, max_seq_length)
    trainer = build_trainer(model, tokenizer, train_dataset, eval_dataset, data_args, training_args)

    if training_args.do_train:
        run_training(trainer, train_dataset, last_checkpoint, data_args, training_args)
    if training_args.do_eval:
        run_evaluation(trainer, eval_dataset, data_args)
    push_or_create_model_card(trainer, model_args, data_args, training_args)
    if lock is not None:
        lock.close()
    if torch.distributed.is_initialized():  # gloo's threads stop now, not in the interpreter's teardown (an abort)
        # The DDP model first: its reducer freed after the process group would join gloo's threads holding the GIL,
        # which a thread still freeing the evaluation's all-gather needs (a deadlock, 1 run in about 30 under load).
        del trainer
        gc.collect()
        torch.distributed.destroy_process_group()


def _mp_fn(index):
    """Entry point for pytorch/xla_spawn.py: `index` is this process's ordinal. accelerate reads the local
    rank of a non-TPU XLA process (XLA:CPU, XLA:GPU) from LOCAL_RANK, and without it no process counts as
    the local main one, so nothing would be logged."""
    os.environ.setdefault("LOCAL_RANK", str(index))
    main()


if __name__ == "__main__":
    main()
