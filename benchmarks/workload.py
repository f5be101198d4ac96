"""The work every mode does, and the machine it runs on: corpus, tokenizer, config and the pre-masked batches (made
by flax/run_mlm_flax.py's collator), the one definition of a step's model FLOPs, and what the CPU or GPU is."""

import contextlib
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.modes import GPU_PEAKS, MLM_PROBABILITY

ROOT = Path(__file__).resolve().parent.parent
BATCH_KEYS = ("input_ids", "attention_mask", "labels", "masked_positions", "masked_labels")


def fail(message):
    """One line on stderr naming what is wrong and what to do, and a non-zero exit."""
    sys.exit(f"run_benchmark.py: error: {message}")


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


def slow_bf16(modes, precisions, named):
    """{mode: why it is skipped} for the bf16 modes on a CPU without bf16 instructions, where bf16 is computed in f32
    or emulated (slower than fp32, PyTorch's many times so). Modes named in --modes run anyway, with a warning."""
    model, support = cpu_bf16()
    bf16 = [m for m in modes if precisions[m] == "bf16"]
    if not support.startswith("none") or not bf16:
        return {}
    if named:
        print(
            f"warning: {', '.join(bf16)}: this CPU ({model}, bf16: {support}) has no bf16 instructions; they run as "
            "asked, no faster than fp32 (PyTorch's many times slower)",
            file=sys.stderr,
        )
        return {}
    return {
        m: f"this CPU has no bf16 instructions (bf16: {support}), so bf16 is no faster than fp32 here; name it in "
        "--modes to run it anyway"
        for m in bf16
    }


def gpu_info():
    """The machine's first NVIDIA GPU by nvidia-smi ({name, driver, memory, count}), or None."""
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not lines:
        return None
    name, driver, memory = (field.strip() for field in lines[0].split(","))
    return {"name": name, "driver": driver, "memory": memory, "count": len(lines)}


def machine_info(gpu):
    cpu, bf16 = cpu_bf16()
    return {
        "cpu": cpu,
        "bf16": bf16,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": gpu,
    }


def hardware(machine):
    """The machine in words, for titles: the GPU (with its host) or the CPU."""
    cpu = f"{machine['cpu']} (bf16: {machine['bf16']}), {machine['cores']} cores"
    gpu = machine.get("gpu")
    return f"{gpu['name']} (driver {gpu['driver']}, {gpu['memory']}); host: {cpu}" if gpu else cpu


def gpu_peaks(gpu):
    """The GPU's published dense peaks in GFLOP/s by precision ({} for a GPU not in GPU_PEAKS, or none)."""
    name = next((n for n in GPU_PEAKS if gpu and n in gpu["name"]), None)
    return {k: 1000 * v for k, v in GPU_PEAKS[name].items()} if name else {}


def model_flops_per_step(config, batch_size, seq_len, masked_tokens):
    """The model FLOPs of one training step, the same number for every mode: the matrix products the masked-LM loss
    needs, 3 x forward (backward = 2 x forward), a multiply-add 2 FLOPs (embeddings, softmax and norms left out).
    Per token and layer: Q, K, V and output projections 8h^2, feed-forward 4hf, attention scores and values 4sh; the
    LM head (dense h x h and decoder h x V) at the `masked_tokens` masked positions of the step only, where the loss
    is taken. A mode that computes more (the head at every position, recomputation) shows it in its executed FLOPs."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    encoder = config["num_hidden_layers"] * (8 * h * h + 4 * h * f + 4 * seq_len * h)
    return 3 * (batch_size * seq_len * encoder + masked_tokens * (2 * h * h + 2 * h * v))


def load_script(relpath):
    """Import a project script by path (its folder may share a name with a package, so never by name)."""
    spec = importlib.util.spec_from_file_location("bench_" + Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(args, what):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        fail(f"{what} failed: {lines[-1] if lines else proc.returncode}")


def prepare_files(work, size_name, size):
    """Corpus, tokenizer (cached in the work folder) and the size's config (dropout 0)."""
    corpus, tok = work / "ptb", work / "tokenizer"
    if not (corpus / "train.txt").is_file():
        run_tool(["tokenizers/prepare_corpus.py", "--corpus", "ptb", "--output_dir", str(corpus)], "prepare_corpus.py")
    if not (tok / "tokenizer.json").is_file():
        flags = ["--train_file", str(corpus / "train.txt"), "--vocab_size", "8192", "--min_frequency", "2"]
        flags += ["--output_dir", str(tok), "--overwrite_output_dir"]
        run_tool(["tokenizers/train_tokenizer.py", *flags], "train_tokenizer.py")
    config_dir = work / f"config-{size_name}"
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    overrides = ",".join(f"{k}={size[k]}" for k in names) + ",hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"
    flags = ["--model_type", "roberta", "--tokenizer_name", str(tok), "--output_dir", str(config_dir)]
    flags += ["--overwrite_output_dir", "--config_overrides", overrides]
    run_tool(["tokenizers/create_config.py", *flags], "create_config.py")
    return corpus, tok, config_dir


def preprocessing_throughput(mlm, tokenizer, lines, block_size):
    """Tokenize, then group with the linear-time group_texts and with upstream's sum(lists, []): the report's
    "preprocessing", and the grouped blocks."""
    from datasets import Dataset

    start = time.perf_counter()
    tokenized = Dataset.from_dict({"text": lines}).map(
        lambda b: tokenizer(b["text"], return_special_tokens_mask=True), batched=True, remove_columns=["text"]
    )
    tokenize_s = time.perf_counter() - start
    num_tokens = sum(len(x) for x in tokenized["input_ids"])

    def group_with_sum(examples, block_size):
        concatenated = {k: sum(examples[k], []) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        return {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}

    group_s = {}
    for name, fn in (("group_texts (linear)", mlm.group_texts), ("sum(lists, []) (upstream)", group_with_sum)):
        start = time.perf_counter()
        grouped = tokenized.map(fn, fn_kwargs={"block_size": block_size}, batched=True, batch_size=1000)
        group_s[name] = time.perf_counter() - start
    preprocessing = {
        "lines": len(lines),
        "tokens": num_tokens,
        "tokenize_s": tokenize_s,
        "tokenize_tokens_per_s": num_tokens / tokenize_s,
        "group": {name: {"seconds": s, "tokens_per_s": num_tokens / s} for name, s in group_s.items()},
    }
    return preprocessing, grouped


def prepare_data(work, args, size, bar):
    """The files, preprocessing throughput, then the batches every mode trains on: a seeded permutation of the
    blocks, masked by the Flax script's collator, with the full labels and (run_mlm_flax.py's gather_masked) the
    labels at the masked positions, padded to one width K for all steps. Returns the config's folder, the batches'
    file and the report's "preprocessing"."""
    from datasets import disable_progress_bars
    from transformers import AutoTokenizer

    corpus, tok, config_dir = prepare_files(work, args.size, size)
    bar.update(1)
    disable_progress_bars()
    mlm = load_script("flax/run_mlm_flax.py")
    tokenizer = AutoTokenizer.from_pretrained(str(tok))
    lines = [line for line in (corpus / "train.txt").read_text().splitlines() if line.strip()][: args.preprocess_lines]
    preprocessing, grouped = preprocessing_throughput(mlm, tokenizer, lines, size["seq_len"])
    bar.update(1)

    steps, batch_size = args.steps, size["batch_size"]
    if len(grouped) < steps * batch_size:
        fail(
            f"{len(grouped)} blocks of {size['seq_len']} tokens are fewer than --steps x batch "
            f"({steps * batch_size}); "
            "raise --preprocess_lines or lower --steps"
        )
    order = np.random.default_rng(args.seed).permutation(len(grouped))[: steps * batch_size]
    collator = mlm.FlaxDataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=MLM_PROBABILITY)
    batches = []
    for step in range(steps):
        row_ids = order[step * batch_size : (step + 1) * batch_size]
        rows = grouped.select(row_ids)
        examples = {k: rows[k] for k in ("input_ids", "attention_mask", "special_tokens_mask")}
        batch = collator(examples, (args.seed,), row_ids, row_width=size["seq_len"])
        masked = mlm.gather_masked(batch, MLM_PROBABILITY)
        batches.append({**batch, "masked_positions": masked["masked_positions"], "masked_labels": masked["labels"]})
    width = max(b["masked_labels"].shape[1] for b in batches)
    for b in batches:  # the rare wider batch sets K for all: unused slots label -100 at position 0
        pad = ((0, 0), (0, width - b["masked_labels"].shape[1]))
        b["masked_positions"] = np.pad(b["masked_positions"], pad)
        b["masked_labels"] = np.pad(b["masked_labels"], pad, constant_values=-100)
    batches_path = work / f"batches-{args.size}.npz"
    np.savez(batches_path, **{k: np.stack([b[k].astype(np.int32) for b in batches]) for k in BATCH_KEYS})
    return config_dir, batches_path, preprocessing
