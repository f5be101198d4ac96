"""flax/train_compile.py: a Flax training script's steps compiled for a TPU slice (libtpu, installed by run.sh into
.libtpu) or for GPUs (jax's CUDA plugin, into .libgpu) on this CPU-only machine through the script's own functions,
their memory and time reported, nothing read or written (libtpu's log files neither); a step too big for the chip
refused in one line."""

import json
import os
import re
import shutil
import types
from pathlib import Path

import pytest
from conftest import ROOT, check_ok, error_line, finish, flax_args, load_script, renamed_copy, run, script_env, start

NO_CACHE = {"JAX_ENABLE_COMPILATION_CACHE": "false"}  # the suite's (conftest.py) holds CPU programs only
# The libtpu of jax's [tpu] extra: .libtpu's for the pins, another for today's releases (run.sh test-current).
LIBTPU = os.path.join(ROOT, os.environ.get("SUITE_LIBTPU", os.path.join(".libtpu", "libtpu", "libtpu.so")))
TPU = {"TPU_LIBRARY_PATH": LIBTPU, **NO_CACHE}
GPU = {"PYTHONPATH": os.path.join(ROOT, ".libgpu"), **NO_CACHE}
MLM, TOOL = "flax/run_mlm_flax.py", "flax/train_compile.py"


def compiling(args, topology):
    """The tool's command line for a script's (`args`: the script, then its flags)."""
    return [TOOL, args[0], "--topology", topology, "--", *args[1:]]


def with_vocabulary(model_dir, vocab_size, copy):
    """A copy of a tiny model's folder whose config has `vocab_size` tokens (the tokenizer keeps its own)."""
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    return copy


@pytest.mark.parametrize(
    "path,extra",
    [
        (MLM, []),
        ("flax/run_t5_mlm_flax.py", ["--fsdp", "full_shard", "--dtype", "bfloat16"]),
        ("flax/run_bart_dlm_flax.py", ["--dtype", "bfloat16", "--gradient_accumulation_steps", "2"]),
    ],
)
def test_the_steps_compile_for_a_tpu_slice(path, extra, request, corpus, tmp_path):
    """Data parallel and --fsdp full_shard, float32 and bfloat16, one micro-batch and two, over the four scripts; the
    data files named do not exist: no data is read."""
    out = tmp_path / "out"
    args = flax_args(path, request, corpus, out, "--do_train", "--do_eval", *extra)
    args[args.index("--train_file") + 1] = str(tmp_path / "absent.txt")
    proc = start(compiling(args, "v5e:2x4"), tmp_path / "log", env=script_env(TPU))
    log = finish([proc])[0]
    assert proc.returncode == 0, log[-3000:]
    assert "Compiling for v5e:2x4: 8 x TPU v5 lite (8 chips, 16.0 GiB of HBM a device)" in log, log[-3000:]
    for step in ("train", "eval"):
        # libtpu's estimate for so small a program can be negative on v5e: the report then says it has none
        line = (
            rf"{step} step, per device: arguments .* of 16.00 GiB .* GFLOP of matrix products; "
            r"(XLA's estimate [0-9,.]+ ms|no time)"
        )
        assert re.search(line, log), log[-3000:]
    assert not out.exists()  # nothing trained, nothing written: not libtpu's log files either (named by process)
    assert not list(Path("/tmp/tpu_logs").glob(f"*.{proc.pid}"))


def test_logits_larger_than_the_chip_fit_and_fsdp_holds_less(request, corpus, gpt2_dir, tmp_path):
    """GPT-2's vocabulary (50,257) at 768 rows of 128 tokens a device: whole f32 logits would be 19.6 GB a device, more
    than a v5e chip's 16 GiB; the CLM step computes them a chunk at a time and fits. With --fsdp full_shard each
    device holds less than with data parallelism, the train state's share included."""
    wide = with_vocabulary(gpt2_dir, 50257, tmp_path / "wide")
    totals = {}
    for fsdp in ([], ["--fsdp", "full_shard"]):
        args = flax_args("flax/run_clm_flax.py", request, corpus, tmp_path / "out", length="128")
        args[args.index("--config_name") + 1] = str(wide)
        args += ["--do_train", "--per_device_train_batch_size", "768", *fsdp]
        log = check_ok(run(compiling(args, "v5e:2x4"), env=TPU)).stderr
        total = re.search(r"train step, per device: arguments .*, total ([0-9.]+) (GiB|MiB) of 16.00 GiB", log)
        assert total, log[-3000:]
        totals[bool(fsdp)] = float(total[1]) * (1024 if total[2] == "GiB" else 1)
    assert totals[True] < totals[False], totals  # MiB


def test_the_steps_compile_for_gpus_and_one_too_big_for_the_gpu_is_refused(request, corpus, tiny_model_dir, tmp_path):
    """XLA's GPU compiler, given a target written from the H100's and A100's published figures: memory a device, no
    time estimate (the plugin gives no cost analysis without a GPU). It compiles a step larger than the GPU, which the
    report then refuses. An unknown count of GPUs and a missing plugin are refused before anything is compiled."""
    args = flax_args("flax/run_clm_flax.py", request, corpus, tmp_path / "out", "--do_train", "--do_eval")
    log = check_ok(run(compiling([*args, "--fsdp", "full_shard"], "h100:2"), env=GPU)).stderr
    assert "Compiling for h100:2: 2 x NVIDIA H100 80GB HBM3 (80.0 GiB of HBM a device)" in log, log[-3000:]
    for step in ("train", "eval"):
        line = (
            rf"{step} step, per device: arguments .* of 80.00 GiB .* GFLOP of matrix products; "
            r"no time estimate from XLA"
        )
        assert re.search(line, log), log[-3000:]
    line = error_line(run(compiling(args, "h100:x"), env=GPU), "train_compile.py")
    assert "name GPUs as h100 or h100:COUNT" in line
    line = error_line(run(compiling(args, "h100"), env={"PYTHONPATH": ""}), "train_compile.py")
    assert "--topology h100 needs jax's CUDA plugin" in line
    big = with_vocabulary(tiny_model_dir, 100_000_000, tmp_path / "big")
    # 6.5 G parameters, 12 bytes each with Adam's moments: 72.6 GiB, below the A100's 80; the gradients are not
    args = [MLM, "--output_dir", str(tmp_path / "out"), "--config_name", str(big), "--tokenizer_name", str(big)]
    line = error_line(run(compiling([*args, "--do_train"], "a100"), env=GPU), "train_compile.py")
    assert re.search(r"the train step does not fit: it needs [0-9.]+ GiB of a device's 80.00 GiB, [0-9.]+ GiB", line)
    assert line.endswith("or add --gradient_accumulation_steps, --fsdp full_shard, --gradient_checkpointing"), line
    # GPT-2's Flax model cannot recompute its activations: the hint names only what this run can still add
    big = with_vocabulary(request.getfixturevalue("gpt2_dir"), 100_000_000, tmp_path / "big_gpt2")
    args = ["flax/run_clm_flax.py", "--output_dir", str(tmp_path / "out"), "--config_name", str(big)]
    args += ["--tokenizer_name", str(big), "--block_size", "32", "--do_train", "--fsdp", "full_shard"]
    line = error_line(run(compiling(args, "a100"), env=GPU), "train_compile.py")
    assert line.endswith(" GiB more: lower the batch, or add --gradient_accumulation_steps"), line


def test_a_model_too_big_for_the_chip_an_unknown_slice_and_no_libtpu_are_refused(tiny_model_dir, corpus, tmp_path):
    big = with_vocabulary(tiny_model_dir, 40_000_000, tmp_path / "big")  # 40 M x 64 embedding weights
    args = [MLM, "--output_dir", str(tmp_path / "out"), "--config_name", str(big), "--tokenizer_name", str(big)]
    args += ["--do_train", "--max_seq_length", "32"]
    line = error_line(run(compiling(args, "v2:2x2"), env=TPU), "train_compile.py")
    # 2.6 G parameters (the embeddings, the head's bias), 12 bytes each with Adam's two moments, on each of 8 cores
    assert re.search(r"the train state alone is 29\.[0-9]{2} GiB a device, more than its 8.0 GiB of HBM", line), line
    assert "name a slice as v2-8, v3-8" in error_line(run(compiling(args, "v9:2x2"), env=TPU), "train_compile.py")
    line = error_line(run(compiling(args, "v3-8"), env={"TPU_LIBRARY_PATH": ""}), "train_compile.py")
    assert "--topology needs libtpu" in line
    line = error_line(run(compiling(args, "h200"), env={"TPU_LIBRARY_PATH": ""}), "train_compile.py")  # a typo
    assert "--topology h200 is neither a TPU slice nor a GPU this tool knows; name a slice" in line
    # The real mistake first, before libtpu is looked for: the script, then the slice's name.
    no_libtpu = {"TPU_LIBRARY_PATH": ""}
    line = error_line(run(compiling(["flax/absent.py", *args[1:]], "v3-8"), env=no_libtpu), "train_compile.py")
    assert "flax/absent.py does not exist: name a Flax training script" in line
    line = error_line(run(compiling(["README.md", *args[1:]], "v3-8"), env=no_libtpu), "train_compile.py")
    assert "README.md is not a Flax training script: it has no make_train_step" in line
    line = error_line(run(compiling(args, "v9-3"), env=no_libtpu), "train_compile.py")
    assert "--topology v9-3 is neither a TPU slice nor a GPU this tool knows" in line
    line = error_line(run([TOOL, MLM, "--topology", "v3-8", "--", *args[1:], "--no_such_flag"], env=TPU), MLM[5:])
    assert "unknown argument --no_such_flag" in line  # the script's own flags, parsed by the script
    memory = ["benchmarks/step_memory.py", *compiling(args, "v3-8")[1:]]  # the tool's line, not a StopIteration
    assert "--topology needs libtpu" in error_line(run(memory, env={"TPU_LIBRARY_PATH": ""}), "train_compile.py")


def test_bf16_products_for_tpu_skip_the_cpus_transposes(monkeypatch):
    """The written-out transposes that pay on a CPU with bf16 instructions (transposes_pay) are left out of a TPU
    program: no CPU detection applies once a topology is asked for."""
    script, tool = load_script(MLM, "train_compile_run_mlm_flax"), load_script(TOOL, "train_compile_tool")
    for variable in (
        "LM_CPU_BF16",
        "TPU_LIBRARY_PATH",
        "TPU_SKIP_MDS_QUERY",
        "TPU_ACCELERATOR_TYPE",
        "TPU_WORKER_HOSTNAMES",
        "TPU_LOG_DIR",
    ):
        monkeypatch.setenv(variable, "1")  # restored afterwards, with what topology_devices sets
    device = types.SimpleNamespace(device_kind="TPU v5 lite", coords=(0, 0, 0))
    monkeypatch.setattr(tool.topologies, "get_topology_desc", lambda **_: types.SimpleNamespace(devices=[device]))
    assert script.transposes_pay(512, (768, 768))
    tool.topology_devices("v5e:2x4")
    assert not script.transposes_pay(512, (768, 768))


def test_a_v4_chip_is_one_device_with_the_whole_chips_hbm(request, corpus, tmp_path):
    """A TPU v4 or v5p chip runs as one device (megacore), where libtpu's compile-only topology gives two a chip unless
    asked for megacore: each device of the report is a chip, with the chip's 32 GiB, and --per_device_train_batch_size
    means rows a chip, as on the real machine. Through a renamed copy of a script: any Flax training script
    compiles."""
    copy = renamed_copy(MLM, tmp_path)
    args = flax_args(MLM, request, corpus, tmp_path / "out", "--do_train", "--per_device_train_batch_size", "8")
    log = check_ok(run(compiling([copy, *args[1:]], "v4:2x2x1"), env=TPU)).stderr
    what = "Compiling for v4:2x2x1: 4 x TPU v4 (4 chips, megacore: one device a chip, 32.0 GiB of HBM a device)"
    assert f"{what}, --max_seq_length 32, --dtype float32; rows a device: train 8" in log, log[-3000:]
    assert re.search(r"train step, per device: arguments .* of 32.00 GiB .* GFLOP of matrix products", log), log
    assert "run_mlm_flax" not in log  # the copy's own name, as its refusals give it
