#!/usr/bin/env python
"""Bytes of the train state (parameters and AdamW's two moments) on each device, as flax/run_mlm_flax.py places it
with and without --fsdp, for models too large to hold replicated on this machine: computed from the state's shapes
and shardings (build_train_state(abstract=True)), so nothing is allocated. On fake CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/fsdp_memory.py   # roberta-large
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("USE_TF", "0")
os.environ.setdefault("USE_TORCH", "0")
ROOT = Path(__file__).resolve().parent.parent
ROBERTA_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)


def state_bytes(script, config, fsdp):
    """(bytes on the fullest device, bytes in all) of the train state under --fsdp `fsdp` ("" for none)."""
    import jax

    training_args = script.TrainingArguments(output_dir="unused", do_train=True, fsdp=fsdp)
    devices = jax.device_count()
    plan = script.TrainingPlan(script.make_mesh(fsdp), devices, jax.local_device_count(), 0, devices, devices)
    _, state, _ = script.build_train_state(script.ModelArguments(), training_args, config, plan, abstract=True)
    leaves = jax.tree_util.tree_leaves(state)
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    return per_device, sum(x.size * x.dtype.itemsize for x in leaves)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config_name", help="A model config folder (default: roberta-large's sizes, vocab 50,265).")
    args = parser.parse_args(argv)
    import jax
    import transformers

    sys.path.insert(0, str(ROOT))  # the package benchmarks/
    from benchmarks.workload import load_script

    script = load_script("flax/run_mlm_flax.py")
    if args.config_name:
        config = transformers.AutoConfig.from_pretrained(args.config_name)
    else:
        config = transformers.RobertaConfig(vocab_size=50265, max_position_embeddings=514, **ROBERTA_LARGE)
    rows = {}
    for fsdp in ("", "full_shard", "hybrid_shard"):
        per_device, total = state_bytes(script, config, fsdp)
        rows[fsdp or "none"] = {"per_device_mb": per_device / 2**20, "total_mb": total / 2**20}
    print(f"{config.model_type}, {jax.device_count()} devices ({jax.local_device_count()} per process)")
    print("| --fsdp | train state per device (MB) | share of the whole state |\n| --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['per_device_mb']:,.0f} | {row['per_device_mb'] / row['total_mb']:.3f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
