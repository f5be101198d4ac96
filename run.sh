#!/usr/bin/env bash
# The project's entry point. Needs only Python 3.11 with venv and pip; everything else it installs.
#   bash run.sh main    set up, then: PTB corpus -> tokenizer -> small RoBERTa config -> Flax MLM pretraining
#                       (3 to 4 minutes on 2 CPU cores) -> eval loss, masked-token accuracy, perplexity
#   bash run.sh test    set up both environments, then run the test suite on every core (extra arguments go to
#                       pytest; -n 0 runs it in one process)
#   bash run.sh setup   only create/refresh the main virtual environment (.venv, or $VENV)
#   bash run.sh setup-xla  only create/refresh the PyTorch/XLA environment (.venv-xla, or $VENV_XLA):
#                       torch_xla 2.9 needs torch 2.9.0, so pytorch/xla_spawn.py gets its own venv
#   bash run.sh setup-tpu  only install libtpu into .libtpu, for flax/train_compile.py (TPU_LIBRARY_PATH=.libtpu/libtpu/libtpu.so)
#   bash run.sh setup-gpu  only install jax's CUDA plugin into .libgpu, for flax/train_compile.py --topology h100 (PYTHONPATH=.libgpu)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
VENV_XLA=${VENV_XLA:-.venv-xla}
PY="$VENV/bin/python"

# make_venv DIR REQUIREMENTS MINUTES GB: (re)install only when the requirements file changed, and only with GB free.
make_venv() {
  local venv=$1 reqs=$2 want have free
  want=$(sha256sum "$reqs" | cut -d' ' -f1)
  have=$(cat "$venv/.requirements.sha256" 2>/dev/null || true)
  if [ "$want" != "$have" ]; then
    free=$(( $(df -Pk . | awk 'NR == 2 {print $4}') / 1048576 ))
    if [ "$free" -lt "$4" ]; then
      echo "run.sh: installing $reqs into $venv needs about $4 GB of free disk; $free GB left here: free some space" >&2
      exit 1
    fi
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    echo "Installing $reqs into $venv (about $3 minutes the first time) ..."
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$reqs"
    "$venv/bin/python" -m pip check
    echo "$want" > "$venv/.requirements.sha256"
  fi
}
setup() { make_venv "$VENV" requirements.txt 2 6; }
setup_xla() { make_venv "$VENV_XLA" pytorch/requirements-xla.txt 3 10; }
# The compilers for flax/train_compile.py, each in a folder of its own: jax in .venv would look for
# the chip at every start if they were installed there. libtpu, XLA's TPU compiler (TPU_LIBRARY_PATH=.libtpu/libtpu/
# libtpu.so); jax's CUDA plugin, XLA's GPU compiler (PYTHONPATH=.libgpu). No TPU, GPU or CUDA libraries needed.
# install_into DIR REQUIREMENTS WHAT: (re)install only when the requirements file changed.
install_into() {
  local want
  want=$(sha256sum "$2" | cut -d' ' -f1)
  if [ "$want" != "$(cat "$1/.requirements.sha256" 2>/dev/null || true)" ]; then
    echo "Installing $2 into $1 ($3) ..."
    "$PY" -m pip install --quiet --disable-pip-version-check --upgrade --target "$1" -r "$2"
    echo "$want" > "$1/.requirements.sha256"
  fi
}
setup_tpu() { install_into .libtpu flax/requirements-tpu.txt "about 1 minute the first time, 0.7 GB"; }
setup_gpu() { install_into .libgpu flax/requirements-gpu.txt "about 1 minute the first time, 0.4 GB"; }

main_job() {
  local data=data/ptb out=out/main
  "$PY" tokenizers/prepare_corpus.py --corpus ptb --output_dir "$data"
  "$PY" tokenizers/train_tokenizer.py --tokenizer_type byte_level_bpe --train_file "$data/train.txt" \
    --vocab_size 8192 --min_frequency 2 --output_dir "$out/model" --overwrite_output_dir
  "$PY" tokenizers/create_config.py --model_type roberta --tokenizer_name "$out/model" --output_dir "$out/model" \
    --overwrite_output_dir \
    --config_overrides "hidden_size=128,num_hidden_layers=2,num_attention_heads=2,intermediate_size=512,hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"
  "$PY" flax/run_mlm_flax.py --output_dir "$out/run" --overwrite_output_dir \
    --model_type roberta --config_name "$out/model" --tokenizer_name "$out/model" \
    --train_file "$data/train.txt" --validation_file "$data/validation.txt" \
    --max_seq_length 64 --per_device_train_batch_size 64 --per_device_eval_batch_size 128 \
    --learning_rate 2e-3 --warmup_steps 100 --weight_decay 0.01 --max_steps 750 \
    --logging_steps 50 --save_steps 750 --do_train --do_eval
  echo "Model, tokenizer, eval_results.json and TensorBoard logs: $out/run"
}

case "${1:-}" in
  setup) setup ;;
  setup-xla) setup_xla ;;
  setup-tpu) setup; setup_tpu ;;
  setup-gpu) setup; setup_gpu ;;
  main) setup; main_job ;;
  # One pytest-xdist worker per core, each taking whole test files (module fixtures are built once), longest first
  # (tests/conftest.py).
  test) shift; setup; setup_xla; setup_tpu; setup_gpu; XLA_PYTHON="$VENV_XLA/bin/python" "$PY" -m pytest tests -n auto --dist loadfile --no-loadscope-reorder "$@" ;;
  *) echo "usage: bash run.sh {main|test|setup|setup-xla|setup-tpu|setup-gpu}" >&2; exit 2 ;;
esac
