#!/usr/bin/env bash
# The project's entry point. Needs only Python 3.11 with venv and pip; everything else it installs.
#   bash run.sh main    set up, then: PTB corpus -> tokenizer -> small RoBERTa config -> Flax MLM pretraining
#                       (about 5 minutes on 2 CPU cores) -> eval loss, masked-token accuracy, perplexity
#   bash run.sh test    set up, then run the test suite (extra arguments go to pytest)
#   bash run.sh setup   only create/refresh the virtual environment (.venv, or $VENV)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

setup() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  local want have
  want=$(sha256sum requirements.txt | cut -d' ' -f1)
  have=$(cat "$VENV/.requirements.sha256" 2>/dev/null || true)
  if [ "$want" != "$have" ]; then
    echo "Installing requirements.txt into $VENV (about 2 minutes the first time) ..."
    "$PY" -m pip install --quiet --disable-pip-version-check -r requirements.txt
    "$PY" -m pip check
    echo "$want" > "$VENV/.requirements.sha256"
  fi
}

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
  main) setup; main_job ;;
  test) shift; setup; "$PY" -m pytest tests "$@" ;;
  *) echo "usage: bash run.sh {main|test|setup}" >&2; exit 2 ;;
esac
