"""The supported range: the Flax scripts keep their guarantees on the pins (requirements.txt, Python 3.11) and on
today's releases (requirements-current.txt, Python 3.12+: `bash run.sh test-current` runs this file there), and a
stack outside the range is one line before any work."""

import importlib.util
import os
import sys

import pytest
from conftest import (
    FLAX_TRAINING_SCRIPTS,
    ROOT,
    TWO_DEVICES,
    check_ok,
    error_line,
    flax_args,
    kill_after_first_checkpoint,
    losses_by_step,
    run,
)

TOOLS = (
    "flax/run_bert_flax.py",
    "flax/export_to_pytorch.py",
    "flax/train_compile.py",
    "flax/dump_noised_examples.py",
)
# PyTorch for Python 3.12 is a CUDA build of 3 GB and more, left out of requirements-current.txt: there, a model saved
# on today's jax is exported by the pins' venv, as a user of both would.
EXPORTING_PYTHON = (
    sys.executable if importlib.util.find_spec("torch") else os.path.join(ROOT, ".venv", "bin", "python")
)


# On the pins, test_flax_resume.py, test_streaming.py and test_objective_block.py hold these guarantees already.
@pytest.mark.skipif(sys.version_info < (3, 12), reason="today's releases only: bash run.sh test-current")
@pytest.mark.parametrize("path", FLAX_TRAINING_SCRIPTS)
def test_kill_9_then_resume_on_two_devices_with_accumulation_is_bitwise_and_the_model_exports(
    path, request, corpus, tmp_path
):
    """Each script, on two devices with two micro-batches a step: kill -9 after the first checkpoint, then the same
    command with --resume_from_checkpoint, gives the uninterrupted run's losses and saved weights bit for bit; the
    saved model becomes a PyTorch model with the same logits."""
    flags = ["--do_train", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--seed", "3"]
    flags += ["--max_steps", "8", "--logging_steps", "1", "--save_steps", "4", "--report_to", "none"]
    full, out = tmp_path / "full", tmp_path / "run"
    uninterrupted = check_ok(run(flax_args(path, request, corpus, full, *flags), env=TWO_DEVICES))
    args = flax_args(path, request, corpus, out, *flags)
    before = losses_by_step(kill_after_first_checkpoint(args, out, env=TWO_DEVICES))
    resumed = check_ok(run(args + ["--resume_from_checkpoint"], env=TWO_DEVICES))
    assert "2 devices" in resumed.stderr + resumed.stdout and "Resuming at step 4" in resumed.stderr + resumed.stdout
    full_losses, after = (losses_by_step(r.stdout + r.stderr) for r in (uninterrupted, resumed))
    assert len(full_losses) == 8 and before and after and {**before, **after} == full_losses, (before, after)
    assert (out / "flax_model.msgpack").read_bytes() == (full / "flax_model.msgpack").read_bytes()

    export = ["flax/export_to_pytorch.py", "--model_dir", str(out), "--output_dir", str(tmp_path / "pt")]
    exported = check_ok(run(export, python=EXPORTING_PYTHON))
    assert "max |difference| of the logits" in exported.stdout and (tmp_path / "pt" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "package,version,expected",
    [
        (
            "transformers",
            "5.25.0",
            "transformers 5.25.0 has no Flax models (5.0 removed them); this script needs 4.57",
        ),
        ("jax", "0.8.1", "jax 0.8.1 is older than the 0.9.2 this script needs: pip install jax=="),
        ("flax", "0.11.2", "flax 0.11.2 is older than the 0.12.6 this script needs: pip install jax=="),
    ],
)
def test_a_stack_outside_the_range_is_one_line_in_every_flax_script_and_tool(package, version, expected, tmp_path):
    """A package's metadata ahead of site-packages on the path, as an install of that version leaves it: each Flax
    script and tool exits 1 with one line naming what is installed, what is needed and the install command."""
    info = tmp_path / f"{package}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    for script in (*FLAX_TRAINING_SCRIPTS, *TOOLS):
        result = run([script, "--help"], env={"PYTHONPATH": str(tmp_path)})
        line = error_line(result, script.split("/")[-1])
        assert result.returncode == 1 and expected in line and len(result.stderr.strip().splitlines()) == 1, line
