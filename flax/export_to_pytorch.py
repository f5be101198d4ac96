#!/usr/bin/env python
"""Convert a checkpoint written by the Flax scripts into a PyTorch transformers model (safetensors).

`PTModel.from_pretrained(flax_dir, from_flax=True)` is broken in transformers 4.57.6: the weights stay
on the `meta` device and the first forward pass fails. This builds the PyTorch model from the config,
loads the Flax weights into it with `load_flax_checkpoint_in_pytorch_model`, saves it with
`save_pretrained` (model.safetensors) beside a copy of the tokenizer, and then checks that PyTorch and
Flax give the same logits on a random batch (max abs difference <= --tolerance, default 1e-4); a base
model without a head (e.g. RobertaModel) is checked by its last hidden states.

Example:
  python flax/export_to_pytorch.py --model_dir out/main/run --output_dir out/main/pytorch
  python -c "from transformers import AutoModelForMaskedLM as M; M.from_pretrained('out/main/pytorch')"
"""

import argparse
import contextlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import shutil
import sys
import warnings

# This script never uses TensorFlow; keep transformers from importing it.
os.environ.setdefault("USE_TF", "0")
# The supported range, from requirements.txt's pins (Python 3.11) to requirements-current.txt's (Python 3.12+): a
# package missing or outside it is one line here, before an import fails deep inside transformers or jax.
STACK = {
    "jax": "0.9.2",
    "jaxlib": "0.9.2",
    "flax": "0.12.6",
    "transformers": "4.57.6",
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
# torch is left out of requirements-current.txt: for Python 3.12, PyPI has only its CUDA build (3 GB and more).
if importlib.util.find_spec("torch") is None:
    sys.exit(f"{os.path.basename(__file__)}: error: torch is not installed for {sys.executable}: pip install torch")

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax.errors import ScopeParamNotFoundError
from transformers import AutoConfig, AutoTokenizer
from transformers.modeling_flax_pytorch_utils import load_flax_checkpoint_in_pytorch_model


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


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


def model_classes(config):
    """The Flax class the checkpoint was saved from and its PyTorch twin, from config.architectures
    (Flax's save_pretrained writes the PyTorch name there, e.g. RobertaForMaskedLM)."""
    for name in config.architectures or []:
        name = name[4:] if name.startswith("Flax") else name
        if hasattr(transformers, name) and hasattr(transformers, f"Flax{name}"):
            return getattr(transformers, f"Flax{name}"), getattr(transformers, name)
    fail(
        f"config.architectures is {config.architectures}: no architecture with both a Flax and a PyTorch class; "
        "was the checkpoint written by save_pretrained of a Flax model?"
    )


class JnpWithAMax:
    """jax.numpy, but for a clip that also takes numpy's keywords a_min and a_max, which jax 0.10 removed."""

    def __getattr__(self, name):
        return getattr(jnp, name)

    @staticmethod
    def clip(x, a_min=None, a_max=None):
        return jnp.clip(x, a_min, a_max)


def clip_with_a_max_for_t5():
    """transformers 4.57's Flax T5 and LongT5 (their relative position buckets) call jnp.clip(x, a_max=...): on jax
    0.10 and later their modules get a jnp whose clip takes it, on jax 0.9 nothing changes. It goes when the scripts
    leave transformers 4.57, the last release with Flax models, whose T5 will not be fixed."""
    if "a_max" not in inspect.signature(jnp.clip).parameters:
        from transformers.models.longt5 import modeling_flax_longt5
        from transformers.models.t5 import modeling_flax_t5

        modeling_flax_t5.jnp = modeling_flax_longt5.jnp = JnpWithAMax()


def compare_outputs(flax_model, params, pt_model, config, seed=0, batch=2, length=16):
    """(largest absolute difference, its name) between the Flax and PyTorch models' first outputs on random token
    ids: the logits, or a base model's last hidden states (the Flax forward compiled whole: one program, where op by
    op is a program an operation)."""
    rng = np.random.default_rng(seed)
    low = 5 if config.vocab_size > 10 else 0  # stay clear of the special tokens
    input_ids = rng.integers(low, config.vocab_size, size=(batch, length)).astype("i4")
    inputs = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids)}
    if config.is_encoder_decoder:
        decoder_input_ids = rng.integers(low, config.vocab_size, size=(batch, length // 2)).astype("i4")
        inputs["decoder_input_ids"] = decoder_input_ids
    flax_output = jax.jit(lambda params, inputs: flax_model(**inputs, params=params))(params, inputs)
    name, flax_first = next(iter(flax_output.items()))
    with torch.no_grad():
        pt_first = pt_model(**{k: torch.from_numpy(v.astype("int64")) for k, v in inputs.items()})[name].numpy()
    return float(np.abs(np.asarray(flax_first, dtype=np.float32) - pt_first).max()), name.replace("_", " ")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = fail  # a bad or missing flag: one line, not a usage block
    parser.add_argument("--model_dir", required=True, help="folder with config.json and flax_model.msgpack")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--overwrite_output_dir", action="store_true")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed output difference")
    args = parser.parse_args(argv)

    weights = os.path.join(args.model_dir, "flax_model.msgpack")
    if not os.path.isfile(weights) and os.path.isdir(os.path.join(args.model_dir, "trainer_state")):
        fail(
            f"--model_dir {args.model_dir} is a training checkpoint of an earlier release, which held no model: "
            "export the model its run saved in the folder above, or a checkpoint written since"
        )
    if not os.path.isfile(weights):
        fail(f"--model_dir {args.model_dir} has no flax_model.msgpack")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        fail(
            f"--model_dir {args.model_dir} has weights but no config.json; "
            "export the folder a Flax script's save_pretrained wrote"
        )
    if os.path.isdir(args.output_dir) and os.listdir(args.output_dir) and not args.overwrite_output_dir:
        fail(f"output directory {args.output_dir} is not empty; pass --overwrite_output_dir to write into it")
    check_writable("--output_dir", args.output_dir)
    try:
        config = AutoConfig.from_pretrained(args.model_dir)
    except (OSError, ValueError) as e:
        fail(f"--model_dir {args.model_dir}: cannot read its config.json ({str(e).splitlines()[0]})")
    flax_cls, pt_cls = model_classes(config)

    # transformers warns that tied output weights (e.g. RoBERTa's lm_head.decoder) were "newly
    # initialized": they are tied to the loaded embeddings. The output check below is the real test.
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            # The converter hands torch.from_numpy read-only views of the loaded weights, then copies them into the
            # model's own parameters: nothing ever writes to the views that torch warns of.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            pt_model = load_flax_checkpoint_in_pytorch_model(pt_cls(config), weights)
        # _do_init=False: the saved weights only, without a random set made first and thrown away
        flax_model, params = flax_cls.from_pretrained(args.model_dir, _do_init=False)
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt weights file becomes one line
        fail(
            f"cannot read {weights} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); is the file complete?"
        )
    pt_model.tie_weights()
    pt_model.eval()
    clip_with_a_max_for_t5()
    try:
        difference, compared = compare_outputs(flax_model, params, pt_model, config)
    except ScopeParamNotFoundError as e:  # read without a random set to fill gaps: a weight of the class is missing
        fail(
            f"{weights} lacks weights of {flax_cls.__name__} ({str(e).split(' (')[0]}); was it saved from that model?"
        )
    if not difference <= args.tolerance:
        fail(
            f"PyTorch and Flax {compared} differ by {difference:.2e} (> --tolerance {args.tolerance}); nothing written"
        )

    pt_model.save_pretrained(args.output_dir, safe_serialization=True)
    if any(os.path.exists(os.path.join(args.model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(args.model_dir).save_pretrained(args.output_dir)
    else:
        print(f"No tokenizer in {args.model_dir}: only the model was exported", file=sys.stderr)
    print(
        f"Exported {pt_cls.__name__} to {args.output_dir} (model.safetensors); "
        f"max |difference| of the {compared} vs Flax: {difference:.2e}"
    )


if __name__ == "__main__":
    main()
