#!/usr/bin/env python
# Reproduction of Hugging Face's Flax BERT inference timing example (Apache-2.0 upstream), rewritten for
# transformers 4.57.6 / jax 0.9.2, offline by default.
"""Inference throughput of FlaxBertModel in float32 or bfloat16 on random token ids.

Upstream (batch 32, length 128, 5 warm-up and 100 timed calls) never waits for the results, so it
times how fast calls are dispatched, not computed. Here every timed call blocks until its output is
ready, the warm-up (which includes compilation) is excluded, and the median call time is reported with
examples/s and tokens/s. With --precision bfloat16 the weights and activations are bfloat16 and every
dense layer is computed by bf16_dense: a bf16 x bf16 product with an f32 result, which XLA:CPU runs
with a bf16 kernel, faster than f32, on CPUs with bf16 instructions (AMX-BF16, AVX-512 BF16). Upstream's way
(the model's `dtype` alone) gets a bf16 x bf16 -> bf16 product, which XLA:CPU computes by converting to f32:
slower than float32 itself. On a CPU without bf16 instructions (AVX2 only) bfloat16 is slower than float32
either way, and the script warns. Offline it builds bert-base-uncased from its published config (random weights:
fine for timing); --config_name takes a local folder or, online, a hub name.

Example:
  python flax/run_bert_flax.py --precision float32 --num_iterations 20
  python flax/run_bert_flax.py --precision bfloat16 --num_iterations 20
  XLA_FLAGS=--xla_cpu_use_thunk_runtime=false python flax/run_bert_flax.py --precision bfloat16
"""

import argparse
import contextlib
import difflib
import importlib.metadata
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

os.environ.setdefault("USE_TF", "0")  # never needed here; transformers would import them (seconds at every start)
os.environ.setdefault("USE_TORCH", "0")
# The supported range, from requirements.txt's pins (Python 3.11) to requirements-current.txt's (Python 3.12+): a
# package missing or outside it is one line here, before an import fails deep inside transformers or jax.
STACK = {
    "jax": "0.9.2",
    "jaxlib": "0.9.2",
    "flax": "0.12.6",
    "transformers": "4.57.6",
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
    jax = "jax==0.12.1 jaxlib==0.12.1 flax==0.12.12" if current else "jax==0.9.2 jaxlib==0.9.2 flax==0.12.6"
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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm import tqdm
from transformers import AutoConfig, BertConfig, FlaxBertModel, HfArgumentParser

logger = logging.getLogger(__name__)


@dataclass
class BenchmarkArguments:
    precision: str = field(
        default="float32", metadata={"help": "float32 or bfloat16", "choices": ["float32", "bfloat16"]}
    )
    batch_size: int = field(default=32, metadata={"help": "Sequences per call."})
    seq_length: int = field(default=128, metadata={"help": "Tokens per sequence."})
    num_warmup: int = field(default=5, metadata={"help": "Untimed calls first (at least one: the first compiles)."})
    num_iterations: int = field(default=100, metadata={"help": "Timed calls."})
    seed: int = field(default=0, metadata={"help": "Seed of the random weights and token ids."})
    config_name: str | None = field(
        default=None,
        metadata={"help": "A BERT config folder, or online a hub name; none: bert-base-uncased's, built here"},
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": 'e.g. "hidden_size=64,num_hidden_layers=2" (for tests)'}
    )
    output_file: str | None = field(default=None, metadata={"help": "Also write the results as JSON here."})


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


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
    transformers' Flax models build their projections and their (tied) LM heads from nn.Dense."""
    module = context.module
    if context.method_name != "__call__" or not isinstance(module, nn.Dense):
        return next_fun(*args, **kwargs)
    kernel = module.get_variable("params", "kernel")
    y = bf16_matmul(jnp.asarray(args[0], kernel.dtype), kernel)
    if module.use_bias:
        y = y + module.get_variable("params", "bias")
    return y if module.dtype is None else y.astype(module.dtype)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: the docstring as written, then each argument with its default."""


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
                "config folder (tokenizers/create_config.py --model_type bert), "
                "or set HF_HUB_OFFLINE=1 to use the local cache"
            )


def build_model(args):
    if args.config_name:
        try:
            config = AutoConfig.from_pretrained(args.config_name)
        except (OSError, ValueError) as e:
            fail(f"--config_name {args.config_name!r}: {str(e).splitlines()[0]}")
        if config.model_type != "bert":
            fail(
                f"--config_name {args.config_name!r} is a {config.model_type} config; "
                "this script times BERT: pass a bert one"
            )
    else:
        config = BertConfig()  # its defaults are bert-base-uncased: 12 layers, hidden 768, vocab 30522
    if args.config_overrides:
        try:
            config.update_from_string(args.config_overrides)
        except ValueError as e:
            fail(f"--config_overrides: {e}")
    if args.seq_length > config.max_position_embeddings:
        fail(f"--seq_length {args.seq_length} is longer than the model's {config.max_position_embeddings} positions")
    dtype = jnp.bfloat16 if args.precision == "bfloat16" else jnp.float32
    model = FlaxBertModel(config, dtype=dtype, seed=args.seed)
    params = model.to_bf16(model.params) if args.precision == "bfloat16" else model.params
    return model, params, config


def make_forward(model, precision):
    """The compiled forward pass; weights and inputs are arguments, not constants folded into it."""

    @jax.jit
    def forward(params, input_ids):
        with nn.intercept_methods(bf16_dense) if precision == "bfloat16" else contextlib.nullcontext():
            return model(input_ids, params=params, train=False).last_hidden_state

    return forward


def parse_args(argv=None):
    """The arguments; a flag that does not exist (a typo) or a malformed value gets one line naming it."""
    parser = HfArgumentParser(BenchmarkArguments, description=__doc__, formatter_class=HelpFormatter)
    parser.error = fail
    args, unknown = parser.parse_args_into_dataclasses(
        args=sys.argv[1:] if argv is None else argv, return_remaining_strings=True
    )
    if unknown:
        flag = next((arg for arg in unknown if arg.startswith("-")), unknown[0]).split("=")[0]
        options = [option.lstrip("-") for action in parser._actions for option in action.option_strings]
        close = difflib.get_close_matches(flag.lstrip("-"), options, n=1)  # without "--", --lr is not near --help
        fail(f"unknown argument {flag}" + (f"; did you mean --{close[0]}?" if close else "; see --help"))
    for name in ("batch_size", "seq_length", "num_iterations"):
        if getattr(args, name) <= 0:
            fail(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.num_warmup < 0:
        fail(f"--num_warmup must not be negative, got {args.num_warmup}")
    if args.config_name:
        check_hub_name("--config_name", args.config_name)
    if (
        args.config_name
        and os.path.isdir(args.config_name)
        and not os.path.isfile(os.path.join(args.config_name, "config.json"))
    ):
        fail(
            f"--config_name {args.config_name} holds no config.json; "
            "write one with tokenizers/create_config.py --model_type bert"
        )
    if args.output_file:  # found now, not after the timing
        folder = os.path.dirname(os.path.abspath(args.output_file))
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            fail(f"--output_file {args.output_file} cannot be written ({e.strerror} in {folder}); choose another path")
    return args


def main():
    args = parse_args()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    # Not jax's "Unable to initialize backend 'tpu'" (none is looked for here), nor transformers' note that its Flax
    # classes go in v5 (4.57.6, the last with them, is pinned on purpose).
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    deprecated = "TensorFlow and JAX classes are deprecated and will be removed in Transformers v5"
    logging.getLogger("transformers.modeling_flax_utils").addFilter(lambda r: deprecated not in r.getMessage())
    warn_if_bf16_is_slow("--precision", args.precision)
    model, params, config = build_model(args)
    rng = np.random.default_rng(args.seed)
    input_ids = jnp.asarray(
        rng.integers(0, config.vocab_size, size=(args.batch_size, args.seq_length)), dtype=jnp.int32
    )

    forward = make_forward(model, args.precision)

    start = time.perf_counter()
    for _ in range(max(args.num_warmup, 1)):
        forward(params, input_ids).block_until_ready()
    warmup_s = time.perf_counter() - start

    times = []
    for _ in tqdm(range(args.num_iterations), desc=f"Timing {args.precision}"):
        start = time.perf_counter()
        forward(params, input_ids).block_until_ready()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    results = {
        "precision": args.precision,
        "batch_size": args.batch_size,
        "seq_length": args.seq_length,
        "num_iterations": args.num_iterations,
        "warmup_s": warmup_s,
        "median_s": median,
        "min_s": min(times),
        "examples_per_second": args.batch_size / median,
        "tokens_per_second": args.batch_size * args.seq_length / median,
        "device": str(jax.devices()[0].device_kind),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(
        f"{args.precision}: median {median * 1000:.1f} ms per call of {args.batch_size} x {args.seq_length} tokens, "
        f"{results['examples_per_second']:.1f} examples/s ({results['tokens_per_second']:.0f} tokens/s); "
        f"warm-up incl. compile {warmup_s:.1f} s"
    )
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
