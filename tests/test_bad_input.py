"""Bad input, in every script: one line on stderr naming the argument or file and what to do, a non-zero
exit, no traceback, nothing lost, and the check made before any long work. One test per class of mistake.
The cases call each script's main() in this process with its command line in sys.argv (conftest's refusal, as
upstream's example tests do), so each script is imported once."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT, check_ok, error_line, flax_args, refusal, run, script_module

MLM = "flax/run_mlm_flax.py"
SIBLINGS = ("flax/run_clm_flax.py", "flax/run_t5_mlm_flax.py", "flax/run_bart_dlm_flax.py")


def errors(*cases):
    """Each (args, expected fragments) case must fail with one line holding every fragment."""
    for args, *fragments in cases:
        line = refusal(args)
        for fragment in fragments:
            assert fragment in line, (fragment, line)


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("bad")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    (d / "binary.txt").write_bytes(
        b"fine first line\n" + bytes(range(256)) * 20
    )  # 0x0a ends line 2; 0x80 is on line 3
    (d / "numbers.json").write_text("".join(json.dumps({"id": i, "value": 2 * i}) + "\n" for i in range(50)))
    (d / "numbers.csv").write_text("id,num\n" + "".join(f"{i},{2 * i}\n" for i in range(50)))
    (d / "short.txt").write_text("just one short line of text\n")
    (d / "a_folder.txt").mkdir()
    (d / "no_config").mkdir()
    return d


def mlm(request, corpus, out, *extra, train=None, script=MLM):
    args = flax_args(script, request, corpus, out, "--do_train", "--do_eval", "--max_steps", "2", *extra)
    if train is not None:
        args[args.index("--train_file") + 1] = str(train)
        i = args.index("--validation_file")
        del args[i : i + 2]
    return args


def pytorch(tiny_model_dir, corpus, out, *extra, train=None):
    return [
        "pytorch/run_mlm.py",
        "--output_dir",
        str(out),
        "--config_name",
        str(tiny_model_dir),
        "--tokenizer_name",
        str(tiny_model_dir),
        "--train_file",
        str(train or corpus / "train_slice.txt"),
        "--max_steps",
        "2",
        "--report_to",
        "none",
        *(extra or ["--do_train"]),
    ]


def tf_mlm(tiny_model_dir, shards, out, *extra, config=None):
    return [
        "tensorflow/run_mlm.py",
        "--pretrained_model_config",
        str(config or tiny_model_dir),
        "--tokenizer",
        str(tiny_model_dir),
        "--no_tpu",
        "--train_dataset",
        str(shards),
        "--max_length",
        "32",
        "--output_dir",
        str(out),
        *extra,
    ]


def test_unknown_flags_bad_values_and_argument_files(request, corpus, tmp_path):
    out = ["--output_dir", str(tmp_path / "out")]
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": str(tmp_path / "out"), "learnig_rate": 1e-3}))
    errors(
        *[
            (
                [script, *out, "--learnig_rate", "1e-3"],
                "unknown argument --learnig_rate; did you mean --learning_rate?",
            )
            for script in (
                "flax/run_mlm_flax.py",
                "flax/run_clm_flax.py",
                "flax/run_t5_mlm_flax.py",
                "flax/run_bart_dlm_flax.py",
                "pytorch/run_mlm.py",
            )
        ],
        (
            ["flax/run_bert_flax.py", "--precison", "bfloat16"],
            "unknown argument --precison; did you mean --precision?",
        ),
        ([MLM, str(tmp_path / "missing.json")], "arguments file", "does not exist"),
        ([MLM, str(tmp_path / "args.json")], "learnig_rate"),
        (["pytorch/run_mlm.py", str(tmp_path / "missing.json")], "does not exist"),
        ([MLM, *out, "--learning_rate", "abc"], "--learning_rate", "invalid float value: 'abc'"),
        (
            ["tokenizers/create_config.py", "--model_type", "roberta", *out, "--vocab_size", "many"],
            "--vocab_size",
            "invalid int",
        ),
        ([MLM, *out, "--lr", "1e-3"], "unknown argument --lr; see --help"),
        (
            mlm(request, corpus, tmp_path / "v", "--validation_split_percentage", "150"),
            "--validation_split_percentage: between 0 and 100",
        ),
        (["tensorflow/run_mlm.py", *out, "--num_epochs", "x"], "--num_epochs"),
        (["tensorflow/run_mlm.py", *out, "--max_steps", "0"], "--max_steps must be a positive integer"),
        (
            mlm(request, corpus, tmp_path / "h", "--heartbeat_timeout_seconds", "0"),
            "--heartbeat_timeout_seconds: at least 1",
        ),
    )


def test_a_table_without_a_text_column(request, corpus, tmp_path, files, tiny_model_dir):
    errors(
        (mlm(request, corpus, tmp_path / "a", train=files / "numbers.json"), "no column named 'text'", "id, value"),
        (mlm(request, corpus, tmp_path / "b", train=files / "numbers.csv"), "no column named 'text'", "id, num"),
        (
            mlm(request, corpus, tmp_path / "clm", train=files / "numbers.json", script=SIBLINGS[0]),
            "no column named 'text'",
        ),
        (pytorch(tiny_model_dir, corpus, tmp_path / "c", train=files / "numbers.json"), "no column named 'text'"),
    )


def test_output_dir_that_cannot_be_written(request, corpus, tmp_path, tiny_model_dir, corpus_shards, trained_flax):
    """Found before any long work (tokenizing, training) in every script that writes. As root, chmod does not stop
    writes; an immutable folder (chattr +i) does, and so does a path under /proc."""
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    subprocess.run(["chattr", "+i", str(frozen)], check=True)
    try:
        target = [str(frozen / "out"), "/proc/no/such/folder"]
        text = str(corpus / "train_slice.txt")
        cases = [
            (mlm(request, corpus, target[0]), "--output_dir", "cannot be written"),
            *[
                (flax_args(script, request, corpus, target[i % 2], "--do_train"), "--output_dir", "cannot be written")
                for i, script in enumerate(SIBLINGS)
            ],
            (pytorch(tiny_model_dir, corpus, target[1]), "--output_dir", "cannot be written"),
            (tf_mlm(tiny_model_dir, corpus_shards, target[0]), "cannot be written"),
            (
                [
                    "tensorflow/prepare_tfrecord_shards.py",
                    "--tokenizer_name_or_path",
                    str(tiny_model_dir),
                    "--train_file",
                    text,
                    "--output_dir",
                    target[1],
                ],
                "cannot be written",
            ),
            (["tensorflow/train_unigram.py", "--train_file", text, "--output_dir", target[0]], "cannot be written"),
            (["tokenizers/prepare_corpus.py", "--output_dir", target[1]], "cannot be written"),
            (["tokenizers/train_tokenizer.py", "--train_file", text, "--output_dir", target[0]], "cannot be written"),
            (
                ["tokenizers/create_config.py", "--model_type", "roberta", "--output_dir", target[1]],
                "cannot be written",
            ),
            (
                ["flax/export_to_pytorch.py", "--model_dir", str(trained_flax), "--output_dir", target[0]],
                "cannot be written",
            ),
            (["flax/run_bert_flax.py", "--output_file", str(frozen / "r.json")], "--output_file", "cannot be written"),
        ]
        errors(*cases)
        assert not list(frozen.iterdir())
    finally:
        subprocess.run(["chattr", "-i", str(frozen)], check=True)


@pytest.fixture(scope="module")
def corpus_shards(tiny_model_dir, corpus, tmp_path_factory):
    """A real shard folder, so that tensorflow/run_mlm.py gets as far as its output checks."""
    out = tmp_path_factory.mktemp("shards")
    check_ok(
        run(
            [
                "tensorflow/prepare_tfrecord_shards.py",
                "--tokenizer_name_or_path",
                str(tiny_model_dir),
                "--train_file",
                str(corpus / "validation_slice.txt"),
                "--split",
                "train",
                "--max_length",
                "32",
                "--output_dir",
                str(out),
            ]
        )
    )
    return out / "train"


@pytest.fixture(scope="module")
def trained_flax(request, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    check_ok(
        run(
            flax_args(
                MLM,
                request,
                corpus,
                out,
                "--do_train",
                "--max_steps",
                "2",
                "--report_to",
                "none",
                "--overwrite_output_dir",
            )
        )
    )
    return out


def test_truncated_or_corrupt_weights(request, corpus, tmp_path, trained_flax, tiny_model_dir):
    truncated = tmp_path / "truncated"
    shutil.copytree(trained_flax, truncated, ignore=shutil.ignore_patterns("checkpoint-*", ".lock"))
    (truncated / "flax_model.msgpack").write_bytes((trained_flax / "flax_model.msgpack").read_bytes()[:5000])
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(trained_flax / "flax_model.msgpack", no_config)
    corrupt_pt = tmp_path / "corrupt_pt"
    shutil.copytree(tiny_model_dir, corrupt_pt)
    (corrupt_pt / "model.safetensors").write_text("garbage")
    args = [
        a for a in flax_args(MLM, request, corpus, tmp_path / "a", "--do_eval") if a not in ("--model_type", "roberta")
    ]
    errors(
        (args + ["--model_name_or_path", str(truncated)], "cannot load the model", "is its weights file complete?"),
        (
            ["flax/export_to_pytorch.py", "--model_dir", str(truncated), "--output_dir", str(tmp_path / "b")],
            "cannot read",
            "complete?",
        ),
        (
            ["flax/export_to_pytorch.py", "--model_dir", str(no_config), "--output_dir", str(tmp_path / "c")],
            "no config.json",
        ),
        (
            pytorch(tiny_model_dir, corpus, tmp_path / "d", "--do_train", "--model_name_or_path", str(corrupt_pt)),
            "cannot load the model",
            "SafetensorError",
        ),
    )


def test_attention_heads_that_do_not_divide_the_hidden_size(request, corpus, tmp_path, tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**config, "hidden_size": 65}))
    errors(
        (
            [
                "tokenizers/create_config.py",
                "--model_type",
                "roberta",
                "--output_dir",
                str(tmp_path / "cfg"),
                "--config_overrides",
                "hidden_size=65,num_attention_heads=2",
            ],
            "not divisible by 2 attention heads",
        ),
        (
            mlm(request, corpus, tmp_path / "a", "--config_name", str(odd)),
            "hidden size 65 is not divisible by its 2 attention heads",
        ),
    )
    assert not (tmp_path / "cfg").exists()


def test_disk_full_while_checkpointing(request, corpus, tmp_path):
    """A 6 MB disk holds the first checkpoint of the tiny model (its train state and model, and the model's copy in
    output_dir), not the second: one line, and the first stays complete, named in the message."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6M", "tmpfs", str(disk)], check=True)
    try:
        line = error_line(
            run(
                flax_args(
                    MLM,
                    request,
                    corpus,
                    disk / "out",
                    "--do_train",
                    "--max_steps",
                    "20",
                    "--save_steps",
                    "2",
                    "--report_to",
                    "none",
                )
            ),
            "run_mlm_flax.py",
        )
        assert (
            "cannot write" in line and "checkpoint-4" in line and f"{disk / 'out' / 'checkpoint-2'}, is intact" in line
        )
        assert (disk / "out" / "checkpoint-2" / "trainer_state").is_dir() and not list(
            (disk / "out").glob("checkpoint-4*")
        )
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_disk_too_small_for_one_checkpoint_is_refused_before_the_first_step(request, corpus, tmp_path):
    """A 2 MB disk cannot hold the tiny model's checkpoint (its train state, its model and the copy in output_dir):
    one line before the first step, not at the first save; --fsdp over one device warns that it shards nothing."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(disk)], check=True)
    try:
        args = flax_args(MLM, request, corpus, disk / "out", "--do_train", "--max_steps", "20", "--save_steps", "10")
        result = run([*args, "--report_to", "none", "--fsdp", "full_shard"])
        line = error_line(result, "run_mlm_flax.py")
        assert f"cannot write {disk / 'out' / 'checkpoint-10'}: it needs about" in line and "run again" in line
        assert "Step 1/" not in result.stdout + result.stderr and not list((disk / "out").glob("checkpoint-*"))
        assert "--fsdp full_shard over one device: nothing to shard" in result.stderr
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_tool_given_a_script_that_does_not_train():
    """dump_noised_examples.py given export_to_pytorch.py (an AttributeError on parse_args): one line."""
    result = run(
        ["flax/dump_noised_examples.py", "flax/export_to_pytorch.py", "--rows", "2", "--", "--output_dir", "x"]
    )
    line = error_line(result, "dump_noised_examples.py")
    assert "flax/export_to_pytorch.py is not a Flax training script: it has no parse_args" in line


def test_setup_on_a_disk_too_small_for_the_environment(tmp_path):
    """run.sh refuses to install into a 4 MB disk before pip starts: one line, and no half-made environment."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(disk)], check=True)
    try:
        for name in ("run.sh", "requirements.txt"):
            shutil.copy(f"{ROOT}/{name}", disk / name)
        result = subprocess.run(["bash", "run.sh", "setup"], cwd=disk, capture_output=True, text=True)
        assert result.returncode == 1 and result.stdout == "", result
        assert result.stderr.splitlines() == [
            "run.sh: installing requirements.txt into .venv needs about 6 GB of free disk; "
            "0 GB left here: free some space"
        ]
        assert not (disk / ".venv").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_streaming_without_what_a_stream_needs(request, corpus, tmp_path):
    """--streaming without --max_steps, evaluating without --validation_file (a stream has no percentage to split
    off, with files or a dataset of no validation split), with flax/dump_noised_examples.py (in memory), with windows
    of 0 rows: one line each, nothing written."""
    out, train, folder = tmp_path / "out", corpus / "train_slice.txt", tmp_path / "train_only"
    folder.mkdir()
    shutil.copy(train, folder / "train.txt")
    dataset = mlm(request, corpus, tmp_path / "locked", "--streaming", train=train)  # refused after the lock
    dataset[dataset.index("--train_file") : dataset.index("--train_file") + 2] = ["--dataset_name", str(folder)]
    errors(
        (dataset, "--do_eval needs a validation split and the data has none; give --validation_file"),
        (mlm(request, corpus, out, "--streaming", "--max_steps", "-1"), "--streaming needs --max_steps"),
        (mlm(request, corpus, out, "--streaming", train=train), "--streaming with --do_eval needs --validation_file"),
        (
            ["flax/dump_noised_examples.py", MLM, "--", *mlm(request, corpus, out, "--streaming")[1:]],
            "leave out --streaming",
        ),
        (
            mlm(request, corpus, out, "--streaming", "--shuffle_buffer_size", "0"),
            "--shuffle_buffer_size must be positive",
        ),
    )
    assert not out.exists() and not (tmp_path / "locked").exists()  # made after the lock, removed at exit


def test_data_flags_that_do_nothing_in_this_mode_are_named(request, corpus, tmp_path, caplog):
    """Workers, cache and split options do nothing to a stream, windows nothing in memory, evaluation options nothing
    without --do_eval: a warning names them."""
    module = script_module(MLM)
    for extra, expected in (
        (
            [
                "--streaming",
                "--preprocessing_num_workers",
                "2",
                "--overwrite_cache",
                "--validation_split_percentage",
                "9",
            ],
            "--preprocessing_num_workers: no effect with",
        ),
        (["--shuffle_buffer_size", "64"], "--shuffle_buffer_size: no effect without --streaming"),
    ):
        module.validate_args(*module.parse_args(mlm(request, corpus, tmp_path / "out", *extra)[1:]))
        assert expected in caplog.text
    assert "--overwrite_cache, --validation_split_percentage, --preprocessing_num_workers" in caplog.text
    assert "--do_eval" not in caplog.text
    # Upstream's Flax scripts evaluate every --eval_steps unasked; here that needs --do_eval.
    args = [arg for arg in mlm(request, corpus, tmp_path / "out", "--eval_steps", "5") if arg != "--do_eval"]
    module.validate_args(*module.parse_args(args[1:]))
    assert "--eval_steps: no effect without --do_eval (no evaluation will run)" in caplog.text
    # Upstream's MLM, T5 and BART scripts take whole-word reference files, which nothing here reads.
    for path in ("flax/run_t5_mlm_flax.py", "flax/run_bart_dlm_flax.py"):
        module = script_module(path)
        module.validate_args(
            *module.parse_args(mlm(request, corpus, tmp_path / "out", "--train_ref_file", "r", script=path)[1:])
        )
        assert "--train_ref_file: accepted as upstream, not used" in caplog.text
        caplog.clear()


def test_learning_rate_that_is_not_positive(request, corpus, tmp_path, tiny_model_dir, corpus_shards):
    errors(
        (mlm(request, corpus, tmp_path / "a", "--learning_rate=-1e-3"), "--learning_rate must be positive"),
        (
            pytorch(tiny_model_dir, corpus, tmp_path / "b", "--do_train", "--learning_rate=-1e-3"),
            "--learning_rate must be positive",
        ),
        (
            tf_mlm(tiny_model_dir, corpus_shards, tmp_path / "c", "--learning_rate=-1e-3"),
            "--learning_rate must be positive",
        ),
    )


@pytest.mark.parametrize(
    "script",
    [
        MLM,
        *SIBLINGS,
        "pytorch/run_mlm.py",
        "tensorflow/run_mlm.py",
        "tokenizers/train_tokenizer.py",
        "tokenizers/create_config.py",
    ],
)
def test_a_python_without_the_packages_is_told_how_to_set_up(script):
    """Run by a Python without .venv's packages (here: site-packages left out, -S), a script says so in one line."""
    proc = subprocess.run([sys.executable, "-S", script, "--help"], cwd=ROOT, capture_output=True, text=True)
    [line] = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and line.startswith(f"{script.split('/')[-1]}: error: "), proc.stderr[-2000:]
    assert "transformers" in line.split(" not installed ")[0], line
    assert line.endswith(f"not installed for {sys.executable}: bash run.sh setup, then source .venv/bin/activate")


def test_float16_is_refused_with_the_alternative_and_a_relative_path_names_its_folder(request, corpus, tmp_path):
    """float16 without loss scaling underflows (upstream took it silently); a missing relative path says where it was
    looked for."""
    errors(
        (mlm(request, corpus, tmp_path / "a", "--dtype", "float16"), "--dtype must be one of 'float32', 'bfloat16'"),
        (
            [*mlm(request, corpus, tmp_path / "b"), "--train_file", "data/nowhere.txt"],
            f"--train_file data/nowhere.txt does not exist (relative paths are read from {os.getcwd()})",
        ),
    )


def test_warmup_longer_than_training_warns_with_the_peak_reached(request, corpus, tmp_path, tiny_model_dir):
    def one(args):
        return check_ok(run(args))

    with ThreadPoolExecutor(2) as pool:
        flax, torch = pool.map(
            one,
            [
                flax_args(
                    MLM,
                    request,
                    corpus,
                    tmp_path / "a",
                    "--do_train",
                    "--max_steps",
                    "4",
                    "--warmup_steps",
                    "8",
                    "--learning_rate",
                    "1e-3",
                    "--report_to",
                    "none",
                ),
                pytorch(
                    tiny_model_dir,
                    corpus,
                    tmp_path / "b",
                    "--do_train",
                    "--max_steps",
                    "4",
                    "--warmup_steps",
                    "8",
                    "--learning_rate",
                    "1e-3",
                ),
            ],
        )
    # The last of 4 steps (step 3 from 0) runs at 3/8 of the peak.
    assert "--warmup_steps 8 is not less than the 4 training steps: the learning rate only reaches 0.000375" in (
        flax.stderr
    )
    assert (
        "8 warm-up steps are not fewer than the 4 training steps: the learning rate only reaches 0.000375"
        in torch.stdout + torch.stderr
    )


def test_eval_alone_never_overwrites_results(request, corpus, tmp_path, tiny_model_dir):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval_results.json").write_text('{"eval_loss": 1.0}')
    errors(
        (flax_args(MLM, request, corpus, tmp_path / "a", "--do_eval"), "eval_results.json", "--overwrite_output_dir"),
        (
            pytorch(
                tiny_model_dir,
                corpus,
                tmp_path / "b",
                "--do_eval",
                "--validation_file",
                str(corpus / "validation_slice.txt"),
            ),
            "eval_results.json",
            "--overwrite_output_dir",
        ),
    )
    assert (tmp_path / "a" / "eval_results.json").read_text() == '{"eval_loss": 1.0}'


def test_t5_refuses_a_tokenizer_without_sentinels(request, corpus, tmp_path, tiny_model_dir):
    args = flax_args(
        "flax/run_t5_mlm_flax.py",
        request,
        corpus,
        tmp_path / "a",
        "--do_train",
        "--tokenizer_name",
        str(tiny_model_dir),
    )
    errors((args, "no <extra_id_N> sentinel tokens", "tokenizers/train_tokenizer.py --tokenizer_type unigram"))


def test_a_second_run_into_the_same_output_dir_is_refused(request, corpus, tmp_path, tiny_model_dir, corpus_shards):
    """The lock is an flock on output_dir/.lock: held here, every training script refuses the folder; a lock left
    by a killed process is no lock at all."""
    held = {}
    for name in ("flax", "torch", "tf"):
        (tmp_path / name).mkdir()
        held[name] = open(tmp_path / name / ".lock", "a+")
        fcntl.flock(held[name], fcntl.LOCK_EX)
        held[name].write("pid 1234 on elsewhere\n")
        held[name].flush()
    errors(
        (mlm(request, corpus, tmp_path / "flax"), "another run (pid 1234 on elsewhere) is writing into"),
        (pytorch(tiny_model_dir, corpus, tmp_path / "torch"), "another run (pid 1234 on elsewhere)"),
        (tf_mlm(tiny_model_dir, corpus_shards, tmp_path / "tf"), "another run (pid 1234 on elsewhere)"),
    )
    for lock in held.values():
        lock.close()
    stale = tmp_path / "stale"
    stale.mkdir()
    killed = (
        "import fcntl, os, signal, sys; f = open(sys.argv[1], 'a+'); "
        "fcntl.flock(f, fcntl.LOCK_EX); os.kill(os.getpid(), signal.SIGKILL)"
    )
    subprocess.run([sys.executable, "-c", killed, str(stale / ".lock")], cwd=ROOT)
    check_ok(run(flax_args(MLM, request, corpus, stale, "--do_eval", "--report_to", "none")))


def test_text_that_is_not_utf8_or_is_a_folder(request, corpus, tmp_path, files, tiny_model_dir):
    errors(
        (
            mlm(request, corpus, tmp_path / "a", train=files / "latin1.txt"),
            "is not UTF-8 text (byte 0xe9 on line 1)",
            "iconv",
        ),
        (mlm(request, corpus, tmp_path / "b", train=files / "binary.txt"), "is not UTF-8 text (byte 0x80 on line 3)"),
        (mlm(request, corpus, tmp_path / "c", train=files / "a_folder.txt"), "is a directory"),
        (mlm(request, corpus, tmp_path / "t5", train=files / "latin1.txt", script=SIBLINGS[1]), "is not UTF-8 text"),
        (mlm(request, corpus, tmp_path / "bart", train=files / "binary.txt", script=SIBLINGS[2]), "is not UTF-8 text"),
        (pytorch(tiny_model_dir, corpus, tmp_path / "d", train=files / "latin1.txt"), "is not UTF-8 text"),
        (
            [
                "tensorflow/train_unigram.py",
                "--train_file",
                str(files / "latin1.txt"),
                "--output_dir",
                str(tmp_path / "e"),
            ],
            "is not UTF-8",
        ),
        (
            [
                "tensorflow/prepare_tfrecord_shards.py",
                "--tokenizer_name_or_path",
                str(tiny_model_dir),
                "--train_file",
                str(files / "binary.txt"),
                "--output_dir",
                str(tmp_path / "f"),
            ],
            "is not UTF-8",
        ),
        (
            [
                "tokenizers/train_tokenizer.py",
                "--train_file",
                str(files / "a_folder.txt"),
                "--output_dir",
                str(tmp_path / "g"),
            ],
            "is a directory",
        ),
    )


def test_text_too_short_to_split_off_validation(request, corpus, tmp_path, files, tiny_model_dir):
    errors(
        (
            mlm(request, corpus, tmp_path / "a", train=files / "short.txt"),
            "too short to split 5 % off",
            "--validation_file",
        ),
        (
            pytorch(tiny_model_dir, corpus, tmp_path / "b", "--do_train", "--do_eval", train=files / "short.txt"),
            "too short to split 5 % off",
        ),
    )


def test_a_model_type_alone_names_the_default_sizes(caplog, tiny_model_dir):
    model_args = script_module(MLM).ModelArguments(model_type="roberta", tokenizer_name=str(tiny_model_dir))
    script_module(MLM).load_config_and_tokenizer(model_args)
    assert "the default roberta config (hidden size 768, 12 layers, vocab_size 50265)" in caplog.text


def test_a_config_folder_without_config_json(request, corpus, tmp_path, files, tiny_model_dir, corpus_shards):
    no_config = str(files / "no_config")
    checkpoint = tmp_path / "run" / "checkpoint-4"
    (checkpoint / "trainer_state").mkdir(parents=True)  # an earlier release's: the train state, no model
    bert = mlm(request, corpus, tmp_path / "f")
    bert[bert.index("--model_type") + 1] = "bert"
    errors(
        (bert, f"--model_type bert, but {tiny_model_dir} holds a roberta config"),
        (
            pytorch(tiny_model_dir, corpus, tmp_path / "g", "--do_train", "--model_type", "bert"),
            "--model_type bert, but",
        ),
        (
            mlm(request, corpus, tmp_path / "a", "--config_name", no_config),
            f"--config_name {no_config} holds no config.json",
        ),
        (
            pytorch(tiny_model_dir, corpus, tmp_path / "b", "--do_train", "--config_name", no_config),
            "holds no config.json",
        ),
        (["flax/run_bert_flax.py", "--config_name", no_config], "holds no config.json"),
        (
            ["flax/run_bert_flax.py", "--config_name", str(tiny_model_dir)],
            "is a roberta config; this script times BERT",
        ),
        (  # checked before the data is tokenized, not when the weights are loaded
            mlm(request, corpus, tmp_path / "e", "--model_name_or_path", str(tiny_model_dir)),
            (
                f"--model_name_or_path {tiny_model_dir} holds no flax_model.msgpack or pytorch_model.bin "
                "or model.safetensors"
            ),
        ),
        (
            mlm(request, corpus, tmp_path / "k", "--model_name_or_path", str(checkpoint)),
            f"--model_name_or_path {checkpoint} is a training checkpoint of an earlier release, which held no model: "
            f"evaluate it with --do_eval --resume_from_checkpoint {checkpoint}, continue its run with --output_dir "
            f"{checkpoint.parent} --resume_from_checkpoint {checkpoint}",
        ),
        (tf_mlm(tiny_model_dir, corpus_shards, tmp_path / "c", config=no_config), "holds no config.json"),
        (
            tf_mlm(tiny_model_dir, corpus_shards, tmp_path / "d", "--model_name_or_path", str(tiny_model_dir)),
            "holds no TensorFlow or PyTorch weights",
        ),
    )


def test_hub_names_with_the_hub_unreachable_in_the_helper_scripts(monkeypatch, tmp_path):
    """A name that is not a local path while the hub cannot be reached: one line at once, not the hub client's retries
    (47 s and 23 lines of them before)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # a closed local port stands for the hub
    out = ["--output_dir", str(tmp_path / "config")]
    errors(
        (
            ["tokenizers/create_config.py", "--model_type", "roberta", "--tokenizer_name", "out/nowhere", *out],
            "--tokenizer_name 'out/nowhere' is not a local path and the Hugging Face Hub is unreachable",
        ),
        (["flax/run_bert_flax.py", "--config_name", "out/nowhere"], "--config_name 'out/nowhere' is not a local path"),
    )


def test_fill_mask_on_a_folder_without_tf_weights_or_no_folder(trained_flax, tiny_model_dir, tmp_path):
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    (tmp_path / "model.safetensors").write_text("weights, but no vocabulary beside them")
    errors(
        (
            ["tensorflow/fill_mask.py", "--model_dir", str(trained_flax), "the <mask> fell"],
            "no TensorFlow or PyTorch weights",
            "flax/export_to_pytorch.py",
        ),
        (
            ["tensorflow/fill_mask.py", "--model_dir", "out/nowhere", "the <mask> fell"],
            "--model_dir out/nowhere does not exist (relative paths are read from",
        ),
        (
            ["tensorflow/fill_mask.py", "--model_dir", str(tmp_path), "the <mask> fell"],
            f"--model_dir {tmp_path} holds no complete tokenizer: it lacks tokenizer.json, vocab.json, merges.txt",
        ),
    )


def test_a_tokenizer_folder_without_its_files(request, corpus, tmp_path, tiny_model_dir, corpus_shards):
    """A folder with the tokenizer's settings (tokenizer_config.json) and a config, but neither tokenizer.json nor the
    vocabulary its class reads: one line naming the files, in every script that takes a tokenizer folder (transformers
    raised a TypeError on a None path)."""
    half = tmp_path / "half"
    half.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, half / name)
    lacks = f"{half} holds no complete tokenizer: it lacks tokenizer.json, vocab.json, merges.txt; write one with"
    torch = pytorch(tiny_model_dir, corpus, tmp_path / "a")
    torch[torch.index("--tokenizer_name") + 1] = str(half)
    tf = tf_mlm(tiny_model_dir, corpus_shards, tmp_path / "b")
    tf[tf.index("--tokenizer") + 1] = str(half)
    flax = mlm(request, corpus, tmp_path / "e")
    flax[flax.index("--tokenizer_name") + 1] = str(half)
    errors(
        (flax, f"--tokenizer_name {lacks}", "tokenizers/train_tokenizer.py"),
        (torch, f"--tokenizer_name {lacks}", "tokenizers/train_tokenizer.py"),
        (
            [
                "tensorflow/prepare_tfrecord_shards.py",
                "--tokenizer_name_or_path",
                str(half),
                "--train_file",
                str(corpus / "validation_slice.txt"),
                "--output_dir",
                str(tmp_path / "c"),
            ],
            f"--tokenizer_name_or_path {lacks}",
            "tensorflow/train_unigram.py",
        ),
        (tf, f"--tokenizer {lacks}"),
        (
            ["tokenizers/create_config.py", "--model_type", "roberta", "--tokenizer_name", str(half)]
            + ["--output_dir", str(tmp_path / "d")],
            f"--tokenizer_name {lacks}",
        ),
    )


def test_benchmark_counts_that_are_not_positive(tmp_path):
    """Refused as parsed, before the corpus and tokenizer work: a negative batch got as far as the batches (an
    AttributeError after 14 s), and 0 read as "not given" (a full run started)."""
    out = ["--output_dir", str(tmp_path / "bench")]
    errors(
        *[
            (["benchmarks/run_benchmark.py", "--quick", flag, value, *out], f"{flag} must be a positive integer")
            for flag, value in (("--batch_size", "-8"), ("--steps", "0"), ("--batch_size", "0"), ("--seq_len", "0"))
        ],
        (["benchmarks/run_benchmark.py", "--end_to_end", "--eval_steps", "0", *out], "--eval_steps"),
    )
    assert not (tmp_path / "bench").exists()


def test_a_config_of_fewer_tokens_than_the_tokenizer(corpus, tmp_path, tiny_model_dir, corpus_shards):
    """A config made for a smaller tokenizer, refused in every training script (TensorFlow's took the tokenizer's
    size without a word)."""
    small = tmp_path / "small"
    small.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 500}))
    smaller = "the config's vocab_size (500) is smaller than the tokenizer's 1000 tokens; rebuild the config"
    errors(
        (tf_mlm(tiny_model_dir, corpus_shards, tmp_path / "a", "--max_steps", "1", config=small), smaller),
        (pytorch(tiny_model_dir, corpus, tmp_path / "b", "--do_train", "--config_name", str(small)), smaller),
    )


def test_config_sizes_below_one(tmp_path):
    """No positions, width, heads or vocabulary: refused where the config is written, naming the override."""
    out = ["--output_dir", str(tmp_path / "config")]
    errors(
        *[
            (
                ["tokenizers/create_config.py", "--model_type", model_type, *out, "--config_overrides", override],
                f"--config_overrides {override}: a model's sizes",
            )
            for model_type, override in (
                ("gpt2", "n_positions=0"),
                ("roberta", "max_position_embeddings=0"),
                ("roberta", "num_attention_heads=0"),
                ("t5", "d_model=-1"),
                ("bart", "encoder_ffn_dim=0"),
            )
        ]
    )
    assert not (tmp_path / "config").exists()


def test_pytorch_logs_its_arguments_after_its_checks(corpus, tmp_path, tiny_model_dir, capsys):
    """A refusal after the arguments are parsed is its one line, not the end of 170 lines of TrainingArguments."""
    line = refusal(pytorch(tiny_model_dir, corpus, tmp_path / "a", "--do_train", "--model_type", "bert"))
    assert "--model_type bert, but" in line
    assert "Training/evaluation parameters" not in capsys.readouterr().out


@pytest.mark.parametrize("code, warned", [("xx", True), ("nb", True), ("RU", True), ("ru", False), ("ab", False)])
def test_a_sentence_language_without_rules_of_its_own_warns(caplog, code, warned):
    """sentencex splits a code it has no rules for (nb, a typo, the wrong case) by its English rules without a word;
    one with rules of its own (ru) or a fallback to some (ab, to ru) splits by those."""
    bart = script_module("flax/run_bart_dlm_flax.py")
    bart.validate_objective(bart.DataTrainingArguments(sentence_language=code))
    assert (f"--sentence_language {code!r}: sentencex has no rules for it" in caplog.text) == warned
