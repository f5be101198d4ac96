"""What the benchmark runs: the model sizes, the shared hyperparameters, and the modes as named records."""

from dataclasses import dataclass

# The presets of --size: the model (a RoBERTa, dropout 0) and the global batch.
SIZES = {
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        vocab_size=8192,
        seq_len=64,
        batch_size=64,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=8192,
        seq_len=128,
        batch_size=16,
    ),
    "base": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        vocab_size=50265,
        seq_len=128,
        batch_size=8,
    ),
}
LEARNING_RATE, WEIGHT_DECAY, BETAS, EPS = 5e-4, 0.01, (0.9, 0.999), 1e-8
MLM_PROBABILITY = 0.15


def warmup_steps_for(total_steps):
    """The learning-rate warm-up of a run of total_steps in every mode: 10 % of it, at least one step."""
    return max(1, total_steps // 10)


@dataclass(frozen=True)
class Mode:
    """One row of the step benchmark: which worker runs it, in what precision, and how.

    head: "masked" computes the LM head at the masked positions only, the products the loss needs (every mode's
    default); "all" at every position and masks the loss after, as transformers' models compute it (reference rows).
    """

    framework: str  # "flax", "pytorch", "pytorch/xla" or "tensorflow"
    precision: str  # "fp32" or "bf16"
    how: str  # the table's words
    head: str = "masked"
    compiled: bool = False  # torch.compile; TensorFlow's tf.function(jit_compile=True)
    fsdp: str = ""  # Flax: run_mlm_flax.py's --fsdp
    model_dtype: str = "float32"  # Flax: the model's dtype ("bfloat16" is upstream's meaning of --dtype)
    stack: str = "pins"  # Flax: "current" runs in requirements-current.txt's venv (today's jax; --current_python)

    @property
    def worker(self):
        """The worker module's name in benchmarks/ (one a framework, each importing only its framework)."""
        return {"flax": "worker_flax", "tensorflow": "worker_tf"}.get(self.framework, "worker_torch")


# Each framework at its best ordinary practice: the script's own step for Flax; fused AdamW, SDPA attention and
# torch.compile for PyTorch; XLA and mixed bf16 for TensorFlow. Every mode computes the head where the loss needs it.
MODES = {
    "flax": Mode("flax", "fp32", "run_mlm_flax.py's train step (jit, donated state)"),
    "flax_bf16": Mode("flax", "bf16", "as flax, --dtype bfloat16: dense products bf16 x bf16 -> f32 (f32 model)"),
    "flax_model_bf16": Mode(
        "flax", "bf16", "as flax, the model's dtype bfloat16 (upstream's --dtype bfloat16)", model_dtype="bfloat16"
    ),
    "flax_fsdp": Mode("flax", "fp32", "as flax, --fsdp full_shard over fake CPU devices", fsdp="full_shard"),
    # The same three on today's releases (requirements-current.txt), beside the pins' in the same rounds.
    "flax_current": Mode("flax", "fp32", "as flax, on today's jax (requirements-current.txt)", stack="current"),
    "flax_bf16_current": Mode("flax", "bf16", "as flax_bf16, on today's jax", stack="current"),
    "flax_model_bf16_current": Mode(
        "flax", "bf16", "as flax_model_bf16, on today's jax", model_dtype="bfloat16", stack="current"
    ),
    "torch": Mode("pytorch", "fp32", "eager, SDPA attention, fused AdamW"),
    "torch_bf16": Mode("pytorch", "bf16", "as torch, autocast bfloat16"),
    "torch_compile": Mode("pytorch", "fp32", "as torch, torch.compile (inductor)", compiled=True),
    "torch_compile_bf16": Mode("pytorch", "bf16", "as torch_compile, autocast bfloat16", compiled=True),
    "torch_xla": Mode("pytorch/xla", "fp32", "PyTorch/XLA on XLA:CPU, own venv"),
    "tf": Mode("tensorflow", "fp32", "tf.function"),
    "tf_xla": Mode("tensorflow", "fp32", "tf.function(jit_compile=True)", compiled=True),
    "tf_bf16": Mode("tensorflow", "bf16", "as tf, Keras mixed_bfloat16"),
    # Reference rows: the head at every position, as transformers computes it (and as these rows did before every
    # mode computed the same work).
    "flax_all_positions": Mode("flax", "fp32", "as flax, head at every position", head="all"),
    "torch_all_positions": Mode("pytorch", "fp32", "as torch, head at every position", head="all"),
    "tf_all_positions": Mode("tensorflow", "fp32", "as tf, head at every position", head="all"),
}
DEFAULT_MODES = ["flax", "flax_bf16", "torch", "torch_bf16", "torch_compile", "torch_xla", "tf", "tf_xla", "tf_bf16"]
# On a GPU (the default there; `--modes gpu` anywhere): no TensorFlow on the GPU machines we are lent, and no CPU-only
# modes; upstream's bf16 (the model's dtype) and transformers' head at every position as reference rows beside ours.
GPU_MODES = ["flax", "flax_bf16", "flax_model_bf16", "torch", "torch_bf16", "torch_compile_bf16"]
GPU_MODES += ["torch_all_positions"]
# `--modes stacks`: Flax's step on the pins and on today's releases, side by side.
STACK_MODES = ["flax", "flax_bf16", "flax_model_bf16", "flax_current", "flax_bf16_current", "flax_model_bf16_current"]
# Published dense peaks, TFLOP/s, by the products' precision: NVIDIA's datasheets (SXM parts unless named). The first
# name found in the GPU's name wins; a GPU not listed is measured against this run's matrix-product peak.
GPU_PEAKS = {
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.3},
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


@dataclass(frozen=True)
class EndToEndMode:
    """One row of --end_to_end: a training script run as a user would, with its flags beyond the shared ones."""

    framework: str
    precision: str
    command: tuple  # the script and its own flags


E2E_MODES = {
    "flax": EndToEndMode("flax", "fp32", ("flax/run_mlm_flax.py", "--model_type", "roberta")),
    "flax_bf16": EndToEndMode(
        "flax", "bf16", ("flax/run_mlm_flax.py", "--model_type", "roberta", "--dtype", "bfloat16")
    ),
    "torch": EndToEndMode("pytorch", "fp32", ("pytorch/run_mlm.py",)),
    "torch_bf16": EndToEndMode("pytorch", "bf16", ("pytorch/run_mlm.py", "--bf16")),
    "torch_xla": EndToEndMode(
        "pytorch/xla", "fp32", ("pytorch/xla_spawn.py", "--num_cores", "1", "pytorch/run_mlm.py")
    ),
    "tf": EndToEndMode("tensorflow", "fp32", ("tensorflow/run_mlm.py",)),
    "tf_bf16": EndToEndMode("tensorflow", "bf16", ("tensorflow/run_mlm.py", "--bfloat16")),
}
