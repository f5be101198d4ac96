"""tokenizers/: the corpus helper, the tokenizer trainer and the config writer."""

import json
import os

import pytest
from conftest import TINY_ROBERTA, check_ok, error_line, load_script, refusal, run
from transformers import AutoConfig, AutoTokenizer

create_config = load_script("tokenizers/create_config.py", "create_config")


def test_ptb_splits_have_the_standard_sizes(corpus):
    counts = {}
    for split in ("train", "validation", "test"):
        with open(corpus / f"{split}.txt") as f:
            lines = f.read().splitlines()
        counts[split] = (len(lines), sum(len(line.split()) for line in lines))
    # Mikolov's splits: 887,521 / 70,390 / 78,669 words (without end-of-sentence markers).
    assert counts == {"train": (42068, 887521), "validation": (3370, 70390), "test": (3761, 78669)}


def test_norwegian_handbook_drops_english_paragraphs(tmp_path):
    result = check_ok(
        run(
            [
                "tokenizers/prepare_corpus.py",
                "--corpus",
                "nb_handbook",
                "--output_dir",
                str(tmp_path),
                "--cache_dir",
                str(tmp_path / "cache"),
            ],
            timeout=600,
        )
    )
    train = (tmp_path / "train.txt").read_text()
    validation = (tmp_path / "validation.txt").read_text()
    assert 600_000 < len(train) < 900_000 and 20_000 < len(validation) < 60_000, result.stdout
    words = train.lower().split()
    # Norwegian function words dominate; untranslated English paragraphs were dropped.
    assert words.count("og") > 5 * max(words.count("the"), 1)  # English survives only quoted inside Norwegian text
    assert "apt-get" in train  # real technical prose, not boilerplate


def test_byte_level_bpe_loads_with_auto_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == 1000
    assert tokenizer.convert_ids_to_tokens(list(range(5))) == ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert (tokenizer.unk_token_id, tokenizer.mask_token_id, tokenizer.model_max_length) == (3, 4, 512)
    ids = tokenizer("the market fell N points")["input_ids"]
    assert ids[0] == 0 and ids[-1] == 2 and len(ids) > 3
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the market fell N points"
    assert tokenizer.convert_tokens_to_ids("<mask>") == 4


def test_tokenizer_bad_input(tmp_path, corpus):
    out = tmp_path / "tok"
    error_line(
        run(
            ["tokenizers/train_tokenizer.py", "--train_file", str(tmp_path / "missing.txt"), "--output_dir", str(out)]
        ),
        "train_tokenizer.py",
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    line = error_line(
        run(["tokenizers/train_tokenizer.py", "--train_file", str(empty), "--output_dir", str(out)]),
        "train_tokenizer.py",
    )
    assert "empty" in line
    for args, message in [
        (["--train_file", "/dev/null"], "--train_file /dev/null is not a regular file"),
        (["--tokenizer_type", "unigram", "--model_type", "gpt2", "--train_file", str(empty)], "T5's"),
    ]:
        line = error_line(
            run(["tokenizers/train_tokenizer.py", *args, "--output_dir", str(out)]), "train_tokenizer.py"
        )
        assert message in line
    assert not out.exists()
    out.mkdir()
    (out / "tokenizer.json").write_text("keep me")
    line = error_line(
        run(
            [
                "tokenizers/train_tokenizer.py",
                "--train_file",
                str(corpus / "validation_slice.txt"),
                "--output_dir",
                str(out),
            ]
        ),
        "train_tokenizer.py",
    )
    assert "--overwrite_output_dir" in line and (out / "tokenizer.json").read_text() == "keep me"
    # Overwritten beside a model config of the tokenizer before, and asked for more tokens than the text holds.
    (out / "config.json").write_text('{"vocab_size": 8192}')
    args = ["--train_file", str(corpus / "validation_slice.txt"), "--vocab_size", "60000", "--overwrite_output_dir"]
    result = check_ok(run(["tokenizers/train_tokenizer.py", *args, "--output_dir", str(out)]))
    assert "note: --vocab_size 60,000 asked for more tokens than the trainer found" in result.stdout, result.stdout
    assert f"note: {out / 'config.json'} was written for another tokenizer" in result.stdout
    cache = ["--corpus", "nb_handbook", "--cache_dir", str(out / "config.json"), "--output_dir", str(tmp_path / "nb")]
    line = error_line(run(["tokenizers/prepare_corpus.py", *cache]), "prepare_corpus.py")
    assert f"--cache_dir {out / 'config.json'}" in line and not (tmp_path / "nb").exists()


@pytest.mark.parametrize(
    "model_type,expected",
    [
        (
            "roberta",
            dict(
                hidden_size=768,
                num_hidden_layers=12,
                max_position_embeddings=514,
                type_vocab_size=1,
                layer_norm_eps=1e-5,
                vocab_size=50265,
            ),
        ),
        ("gpt2", dict(n_embd=768, n_layer=12, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, vocab_size=50257)),
        (
            "t5",
            dict(
                d_model=768,
                d_ff=2048,
                num_layers=12,
                feed_forward_proj="gated-gelu",
                tie_word_embeddings=False,
                vocab_size=32128,
            ),
        ),
        ("bart", dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_ffn_dim=3072, vocab_size=50265)),
        (
            "bert",
            dict(
                hidden_size=768, num_hidden_layers=12, max_position_embeddings=512, type_vocab_size=2, vocab_size=30522
            ),
        ),
    ],
)
def test_reference_configs(model_type, expected, tmp_path):
    create_config.main(["--model_type", model_type, "--output_dir", str(tmp_path)])
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == model_type
    for key, value in expected.items():
        assert getattr(config, key) == value, key


def test_config_follows_tokenizer_and_overrides(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == 1000 and config["pad_token_id"] == 1 and config["eos_token_id"] == 2
    for item in TINY_ROBERTA.split(","):
        key, value = item.split("=")
        assert config[key] == int(value)


def test_config_bad_input(tmp_path):
    line = error_line(
        run(
            [
                "tokenizers/create_config.py",
                "--model_type",
                "roberta",
                "--output_dir",
                str(tmp_path),
                "--config_overrides",
                "hiden_size=3",
            ]
        ),
        "create_config.py",
    )
    assert "hiden_size" in line and not os.path.exists(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{}")
    error_line(
        run(["tokenizers/create_config.py", "--model_type", "bert", "--output_dir", str(tmp_path)]), "create_config.py"
    )
    assert (tmp_path / "config.json").read_text() == "{}"


def test_config_values_no_model_can_train_with(tiny_model_dir, tmp_path):
    command = ["tokenizers/create_config.py", "--model_type", "roberta", "--output_dir", str(tmp_path / "config")]
    for extra, expected in (
        (["--config_overrides", "hidden_size=64,,num_hidden_layers=2"], "'' is not key=value"),
        (["--config_overrides", "num_hidden_layers=0"], "num_hidden_layers=0: a model needs at least one layer"),
        (["--config_overrides", "hidden_dropout_prob=1.5"], "hidden_dropout_prob=1.5: a dropout probability"),
        (["--tokenizer_name", str(tiny_model_dir), "--vocab_size", "10"], "smaller than the tokenizer's 1000 tokens"),
    ):
        assert expected in refusal(command + extra), extra
    assert not (tmp_path / "config").exists()


def test_unigram_t5_tokenizer(corpus, tmp_path):
    check_ok(
        run(
            [
                "tokenizers/train_tokenizer.py",
                "--tokenizer_type",
                "unigram",
                "--train_file",
                str(corpus / "train_slice.txt"),
                "--vocab_size",
                "800",
                "--output_dir",
                str(tmp_path),
            ]
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert type(tokenizer).__name__ == "T5TokenizerFast"
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert len(tokenizer) == 900  # 800 pieces + 100 sentinels
    # Sentinels sit above the vocabulary, <extra_id_0> last: span corruption counts down from len - 1.
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == len(tokenizer) - 1
    assert tokenizer.convert_tokens_to_ids("<extra_id_99>") == 800
    ids = tokenizer("The  Market   FELL 42 points.")["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert ids[-1] == 1 and ids.count(1) == 1  # </s> appended once
    assert "4" in tokens and "2" in tokens and "42" not in tokens and "▁42" not in tokens  # individual digits
    assert "." in tokens  # punctuation split off
    assert (
        tokenizer.decode(ids, skip_special_tokens=True) == "the market fell 42 points."
    )  # lowercased, spaces collapsed
