#!/usr/bin/env python
"""A Flax script's train step against a plain step of the same model and loss, both compiled for a TPU slice by
flax/train_compile.py: per device, the memory XLA:TPU plans and its time estimate. The plain step is
jax.value_and_grad of loss_sums' loss (its sum over its count) on one micro-batch, then the script's optimizer: no
scan over micro-batches, no vector-Jacobian product per loss term, no remat policy. The script's flags follow `--`:

  TPU_LIBRARY_PATH=.libtpu/libtpu/libtpu.so python benchmarks/step_memory.py flax/run_clm_flax.py --topology v3-8 -- \\
      --output_dir unused --config_name gpt2-config --tokenizer_name T --block_size 512 \\
      --per_device_train_batch_size 64 --do_train
"""

import argparse
import json
import logging
import multiprocessing
import os
import sys
from pathlib import Path

os.environ.setdefault("USE_TF", "0")
os.environ.setdefault("USE_TORCH", "0")
ROOT = Path(__file__).resolve().parent.parent


def plain_train_step(script):
    """make_train_step's replacement: the step as the upstream examples write it, over the script's loss_sums."""
    import jax

    def make_train_step(model, schedule, bf16, seed, state):
        def train_step(state, batch):
            batch = jax.tree.map(lambda x: x[0], batch)  # one micro-batch

            def loss(params):
                sums = script.loss_sums(model, params, batch, jax.random.PRNGKey(seed), train=True, bf16=bf16)
                return sums["loss"][0] / sums["loss"][1]

            value, grad = jax.value_and_grad(loss)(state.params)
            return state.apply_gradients(grads=grad), value

        shardings = jax.tree.map(lambda x: x.sharding, state)
        return jax.jit(train_step, out_shardings=(shardings, None), donate_argnums=(0,))

    return make_train_step


def step_line(relpath, topology, flags, plain):
    """What flax/train_compile.py logs of the script's train step (or the line saying it does not fit), or with
    plain=True of the plain one; RuntimeError with the error line if it stopped before compiling (bad flags, no
    libtpu)."""
    sys.path.insert(0, str(ROOT))  # the package benchmarks/
    from benchmarks.workload import load_script

    tool = load_script("flax/train_compile.py")
    lines, handler = [], logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    tool.logger.addHandler(handler)
    try:
        target = tool.topology_devices(topology)
        script = tool.load_script(str(ROOT / relpath))
        if plain:
            script.make_train_step = plain_train_step(script)
        tool.compile_steps(script, flags, topology, target)
    except SystemExit as e:
        lines.append(str(e))
    found = [line for line in lines if "train step" in line]
    if not found:
        raise RuntimeError(lines[-1] if lines else f"{relpath} compiled no train step")
    return found[-1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("script", help="A Flax training script, e.g. flax/run_mlm_flax.py.")
    parser.add_argument("--topology", required=True, help="A TPU slice, as flax/train_compile.py takes it: v3-8.")
    parser.usage = "%(prog)s SCRIPT --topology SLICE -- FLAGS (the script's, with --do_train)"
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, flags = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if "--do_train" not in flags:
        parser.error("the script's flags need --do_train")
    rows = {}
    for name in ("ours", "plain"):
        # A process a compile: XLA's compile memory stays with the process (T5 base's two compiles for v3-8 need more
        # than 24 GB together, at most 19 GB each alone).
        pool = multiprocessing.get_context("spawn").Pool(1)
        try:
            rows[name] = pool.apply(step_line, (args.script, args.topology, flags, name == "plain"))
        except RuntimeError as e:  # the script's own line: it names the flag
            sys.exit(str(e))
        finally:
            pool.close()
            pool.join()
    for name, line in rows.items():
        print(f"{name}: {line}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
