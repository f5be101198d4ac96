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
#   bash run.sh test-fast  the edit loop's tier (FAST_TESTS, about 5 minutes on 2 idle cores): layout and lint,
#                       arguments and refusals, each Flax script's tiny train, eval, reload and resume
#   bash run.sh test-current  the Flax tests that carry the guarantees, on today's releases (requirements-current.txt
#                       in .venv-current, on Python 3.12 or newer from pyenv or the PATH; libtpu into .libtpu-current);
#                       where this machine has no Python 3.12, one line says so and nothing runs
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
VENV_XLA=${VENV_XLA:-.venv-xla}
PY="$VENV/bin/python"

# make_venv DIR REQUIREMENTS MINUTES GB [PYTHON]: (re)install only when the requirements file changed, and only with
# GB free.
make_venv() {
  local venv=$1 reqs=$2 python=${5:-python3} want have free
  want=$(sha256sum "$reqs" | cut -d' ' -f1)
  have=$(cat "$venv/.requirements.sha256" 2>/dev/null || true)
  if [ "$want" != "$have" ]; then
    free=$(( $(df -Pk . | awk 'NR == 2 {print $4}') / 1048576 ))
    if [ "$free" -lt "$4" ]; then
      echo "run.sh: installing $reqs into $venv needs about $4 GB of free disk; $free GB left here: free some space" >&2
      exit 1
    fi
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
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
# Today's releases need Python 3.12 or newer (jax 0.11 and later): pyenv's newest, else one on the PATH.
python_current() {
  local root
  root=$(pyenv root 2> /dev/null || echo ~/.pyenv)
  for candidate in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2> /dev/null | sort -V -r) python3.13 python3.12; do
    command -v "$candidate" > /dev/null && { echo "$candidate"; return; }
  done
}
VENV_CURRENT=${VENV_CURRENT:-.venv-current}
# The Flax tests that carry the guarantees: every script trains, evaluates and reloads; kill -9 then a resume is
# bitwise on two devices with accumulation, and the model exports; --fsdp, --streaming, --dtype bfloat16; the
# objective blocks and the seams a block uses; a TPU compile with the libtpu of jax's [tpu] extra; run_bert_flax.py
# and dump_noised_examples.py; an earlier release's checkpoint resumed, and the install line's pins; the suite's
# in-process runs.
# Each Flax script's tiny run on two devices that trains, evaluates and reloads (in both lists below).
SCRIPT_RUNS=(tests/test_run_mlm_flax.py::test_trains_on_two_devices_and_loss_falls
  tests/test_run_mlm_flax.py::test_eval_metrics_written_and_consistent
  tests/test_run_mlm_flax.py::test_trained_model_beats_untrained_and_checkpoint_reloads
  tests/test_run_clm_flax.py::test_trains_on_two_devices_loss_falls_and_metrics_written
  tests/test_run_clm_flax.py::test_checkpoint_reloads_to_identical_eval
  tests/test_run_t5_mlm_flax.py::test_trains_on_two_devices_and_reloads
  tests/test_run_bart_dlm_flax.py::test_trains_on_two_devices_and_reloads)
CURRENT_TESTS=(tests/test_supported_stacks.py tests/test_objective_block.py tests/test_block_seams.py
  tests/test_run_bert_flax.py
  "${SCRIPT_RUNS[@]}"
  tests/test_run_t5_mlm_flax.py::test_dump_noised_examples
  tests/test_flax_training.py::test_gradient_accumulation_equals_the_larger_batch
  tests/test_flax_resume.py::test_fsdp_on_eight_devices_trains_as_one_and_resumes_on_fewer
  tests/test_streaming.py::test_a_streamed_run_resumes_bit_for_bit
  tests/test_bf16.py::test_bf16_training_follows_f32_and_saves_f32_weights
  tests/test_compile_topology.py::test_the_steps_compile_for_a_tpu_slice
  tests/test_checkpoints.py::test_an_earlier_release_checkpoint_resumes_with_one_warning
  tests/test_checkpoints.py::test_the_install_line_for_a_package_too_old_names_this_stacks_pins
  tests/test_in_process.py)
# The tests a change to a Flax script's shared text or objective block most often breaks, in about 5 minutes on 2 idle
# cores: layout and lint, arguments and refusals, and each script's tiny run on two devices that trains, evaluates and
# reloads its checkpoint, then a resume (streamed: each script stopped after a checkpoint and resumed bit for bit).
FAST_TESTS=(tests/test_layout.py tests/test_bad_input.py "${SCRIPT_RUNS[@]}"
  tests/test_streaming.py::test_a_streamed_run_resumes_bit_for_bit)
test_current() {
  local python
  python=$(python_current)
  if [ -z "$python" ]; then
    echo "run.sh: no Python 3.12 or newer on this machine (pyenv install 3.12): the tests on today's releases are skipped"
    return 0
  fi
  make_venv "$VENV_CURRENT" requirements-current.txt 2 3 "$python"
  PY="$VENV_CURRENT/bin/python" install_into .libtpu-current flax/requirements-tpu-current.txt "about 1 minute, 0.7 GB"
  SUITE_LIBTPU=.libtpu-current/libtpu/libtpu.so "$VENV_CURRENT/bin/python" -m pytest "${CURRENT_TESTS[@]}" \
    -n auto --dist loadfile --no-loadscope-reorder "$@"
}
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
  test-fast) shift; setup; "$PY" -m pytest "${FAST_TESTS[@]}" -n auto --dist loadfile --no-loadscope-reorder "$@" ;;
  # The export in tests/test_supported_stacks.py reads the pins' .venv (its torch): set up here first.
  test-current) shift; setup; test_current "$@" ;;
  *) echo "usage: bash run.sh {main|test|test-fast|test-current|setup|setup-xla|setup-tpu|setup-gpu}" >&2; exit 2 ;;
esac
