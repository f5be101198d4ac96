"""MIN_LENGTH, the fewest tokens a row of an objective can train on: a shorter length is refused in one line (no
traceback, a non-zero exit) and MIN_LENGTH itself is accepted, in the four Flax training scripts and in the two worked
blocks (tests/mtp_block.py in a copy of run_clm_flax.py, tests/electra_block.py in one of run_mlm_flax.py)."""

import shutil

import pytest
from conftest import FLAX_TRAINING_SCRIPTS, flax_args, refusal, script_args, script_module
from test_objective_block import electra_script, patched_block_script

# What each objective needs of a row, by hand (not read from the scripts).
MINIMUMS = {
    "flax/run_mlm_flax.py": 1,  # one token to mask
    "flax/run_clm_flax.py": 2,  # one token to read, the next to predict
    "flax/run_t5_mlm_flax.py": 4,  # input tokens after corruption: a shorter row leaves no span to corrupt
    "flax/run_bart_dlm_flax.py": 4,  # <s>, </s> and two tokens between them to noise
    "mtp_block.py": 4,  # one token to read and the one 3 ahead (AHEAD = (2, 3)) to predict
    "electra_block.py": 1,  # one token to mask
}


def check_min_length(args, minimum):
    """`args` (a script and its command line, with its length flag) refused in one line at minimum - 1, and the
    length resolved to minimum at minimum."""
    module = script_module(args[0])
    flag = f"--{module.LENGTH_FLAG}"
    assert module.MIN_LENGTH == minimum and flag in args

    def at(length):
        return [*args[: args.index(flag) + 1], str(length), *args[args.index(flag) + 2 :]]

    line = refusal(at(minimum - 1))  # one line, no traceback, a non-zero exit (conftest's error_line)
    assert line.endswith(f"error: {flag} must be at least {minimum}, got {minimum - 1}"), line
    model_args, data_args, _ = module.parse_args(at(minimum)[1:])
    config, tokenizer = module.load_config_and_tokenizer(model_args)
    assert module.resolve_max_seq_length(data_args, config, tokenizer) == minimum


@pytest.mark.parametrize("path", FLAX_TRAINING_SCRIPTS)
def test_each_script_refuses_a_length_below_its_minimum_and_accepts_the_minimum(path, request, corpus, tmp_path):
    check_min_length(flax_args(path, request, corpus, tmp_path / "out", "--do_train"), MINIMUMS[path])


def test_the_worked_blocks_refuse_a_length_below_their_minimum_and_accept_it(
    gpt2_dir, tiny_model_dir, corpus, tmp_path
):
    from transformers import AutoTokenizer, ElectraConfig

    mtp = patched_block_script("flax/run_clm_flax.py", "mtp_block.py", tmp_path)
    check_min_length(
        script_args(str(mtp), "gpt2", gpt2_dir, corpus, tmp_path / "mtp", "--block_size", "32", "--do_train"),
        MINIMUMS["mtp_block.py"],
    )
    model_dir = tmp_path / "electra"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ElectraConfig(
        vocab_size=len(tokenizer), max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(model_dir)
    electra = electra_script(tmp_path)
    check_min_length(
        script_args(
            str(electra), "electra", model_dir, corpus, tmp_path / "e", "--max_seq_length", "32", "--do_train"
        ),
        MINIMUMS["electra_block.py"],
    )
