"""--streaming in the four Flax training scripts: a run killed after a checkpoint resumes bit for bit, passes and
windows included; two processes read disjoint shares that together are what one process reads (its refusals are in
test_bad_input.py)."""

import itertools
import json
import re
import shutil
import threading

import datasets
import pytest
from conftest import (
    FLAX_TRAINING_SCRIPTS,
    check_ok,
    finish,
    flax_args,
    kill_after_first_checkpoint,
    load_script,
    refusal,
    run,
)
from datasets.distributed import split_dataset_by_node
from test_flax_training import start_two_hosts
from transformers import AutoTokenizer

MLM = "flax/run_mlm_flax.py"

# Windows of 24 rows and passes of 44 rows (5 global batches of 8): the checkpoint at step 4 sits inside the second
# window, and the run crosses a window boundary inside a batch and three ends of the stream.
STREAMED = [
    "--do_train",
    "--streaming",
    "--shuffle_buffer_size",
    "24",
    "--max_train_samples",
    "44",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--max_steps",
    "16",
    "--logging_steps",
    "1",
    "--save_steps",
    "4",
    "--learning_rate",
    "1e-3",
    "--report_to",
    "none",
]


@pytest.mark.parametrize("path", FLAX_TRAINING_SCRIPTS)
def test_a_streamed_run_resumes_bit_for_bit(request, corpus, tmp_path, path):
    """MLM's run is killed (kill -9) after its first checkpoint; the others resume from the uninterrupted run's first
    checkpoint, all that a kill right after it leaves (what a kill may leave besides is the same code in the four)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    result = check_ok(run(flax_args(path, request, corpus, full, *STREAMED)))
    log = result.stdout + result.stderr
    assert log.count("over the training stream ended after 44 rows") >= 2, log[-3000:]
    assert "--max_steps 16 goes on with pass 2: the same rows in a new order" in log  # a warning, not only info
    results = json.loads((full / "train_results.json").read_text())
    assert results["global_step"] == 16 and results["train_samples"] is None  # a stream has no length, not 0 rows
    if path == MLM:
        kill_after_first_checkpoint(flax_args(path, request, corpus, resumed, *STREAMED), resumed)
    else:
        shutil.copytree(full / "checkpoint-4", resumed / "checkpoint-4")
    result = check_ok(run(flax_args(path, request, corpus, resumed, *STREAMED, "--resume_from_checkpoint")))
    after = [
        line.split(" | lr")[0] for line in (result.stdout + result.stderr).splitlines() if line.startswith("Step ")
    ]
    assert after and after[-1].startswith("Step 16/16") and all(line in log for line in after), (after, log[-3000:])
    model = "flax_model.msgpack"
    assert (full / model).read_bytes() == (resumed / model).read_bytes()
    if path == MLM:  # the position means nothing in memory: one line (the same code in the four)
        no_stream = [arg for arg in STREAMED if arg != "--streaming"]
        line = refusal(flax_args(path, request, corpus, resumed, *no_stream, "--resume_from_checkpoint"))
        assert "was written for other data (" in line and "streams [1, 1] -> None" in line, line


# Run with a Flax script's arguments (masked LM), printing the rows of each batch a train step takes, as a line: this
# process's rows of the step's global batch, unmasked (the masked positions given their labels back) and cut to their
# real tokens: the rows trained on, not those collated ahead of the step.
ROWS_REPORT = """
import json, sys
import numpy as np
sys.path.insert(0, "tests")
from conftest import load_script

script = load_script(sys.argv[1], "streamed")
step = script.timed_step

def local(array):  # this process's rows (one device a process)
    [shard] = array.addressable_shards
    return np.asarray(shard.data)[0]  # the one micro-batch

def recording(train_step, state, batch, *args, **kwargs):
    ids, real = local(batch["input_ids"]).copy(), local(batch["attention_mask"])
    labels, positions = local(batch["labels"]), local(batch["masked_positions"])
    rows = np.arange(len(ids))[:, None].repeat(labels.shape[1], 1)
    ids[rows[labels != -100], positions[labels != -100]] = labels[labels != -100]
    print("ROWS " + json.dumps([row[mask == 1].tolist() for row, mask in zip(ids, real) if mask.any()]), flush=True)
    return step(train_step, state, batch, *args, **kwargs)

script.timed_step = recording
script.main(sys.argv[2:])
"""


def test_two_hosts_train_on_disjoint_shares_that_make_the_whole_stream(request, corpus, tmp_path):
    """64 distinct lines, one row each (--line_by_line), 8 steps of 8 rows: one process trains on all of them; each of
    two processes, 12 steps of 4 rows, on the 32 of its half of the file (then 16 of them again, the second pass),
    none on the other's (the lines' tokens differ in number, so each step the two pad to one shape): the rows each
    train step takes, not those collated ahead of it (ProcessAgreement's look-ahead).
    Resumed on two processes at step 8, each goes on in its own share as the uninterrupted run did."""
    text = (corpus / "train_slice.txt").read_text()  # ASCII; lines of 40 bytes: each process's half of them is 32
    lines = list(dict.fromkeys(line[:40] for line in text.splitlines() if len(line) >= 40))
    (tmp_path / "lines.txt").write_text("".join(line + "\n" for line in lines[:64]))
    args = flax_args(MLM, request, corpus, tmp_path / "one", *STREAMED[:4], "--line_by_line")
    args[args.index("--train_file") + 1] = str(tmp_path / "lines.txt")
    args += ["--per_device_train_batch_size", "8", "--max_steps", "8", "--save_steps", "8", "--report_to", "none"]

    def rows(log):  # process 0's lines may follow its progress bar's
        return [tuple(row) for batch in re.findall(r"ROWS (\[\[.*?\]\])", log) for row in json.loads(batch)]

    def on_two_hosts(output_dir, *extra):
        args[args.index("--output_dir") + 1] = str(output_dir)
        procs = start_two_hosts(["-c", ROWS_REPORT, *args, *extra], tmp_path)
        logs = finish(procs, timeout=300)
        assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
        return [rows(log) for log in logs]

    one = rows(check_ok(run(["-c", ROWS_REPORT, *args])).stdout)
    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue("tiny_model_dir"))
    assert sorted(one) == sorted(tuple(tokenizer(line)["input_ids"]) for line in lines[:64])  # each line, once
    args[args.index("--per_device_train_batch_size") + 1] = "4"
    args[args.index("--max_steps") + 1] = "12"
    first, second = on_two_hosts(tmp_path / "two")
    assert len(first) == len(second) == 48 and not set(first) & set(second)
    assert sorted(first[:32] + second[:32]) == sorted(one) and set(first[32:]) <= set(first[:32])
    assert len({len(row) for row in first}) > 1
    shutil.copytree(tmp_path / "two" / "checkpoint-8", tmp_path / "resumed" / "checkpoint-8")
    resumed = on_two_hosts(tmp_path / "resumed", "--resume_from_checkpoint")
    assert resumed == [first[32:], second[32:]]


@pytest.fixture(scope="module")
def script():
    return load_script(MLM, "streaming_run_mlm_flax")


def test_read_ahead_ends_its_thread_when_training_stops_reading(script):
    """Training stops reading the stream at --max_steps: the read-ahead thread ends with it, leaving no thread that
    holds a window and the file open in a process that calls main() again."""
    before = set(threading.enumerate())
    windows = script.read_ahead(itertools.count())
    assert [next(windows), next(windows)] == [0, 1]
    windows.close()
    assert set(threading.enumerate()) <= before


def test_a_dataset_folder_loads_and_streams_as_files_do(script, corpus, tmp_path, monkeypatch, caplog):
    """--dataset_name (a local folder here: no hub offline) loads through the same code as files, in memory and
    streamed; streamed by two processes, its one train file is read by both, which is said."""
    folder = tmp_path / "ptb"
    folder.mkdir()
    for split in ("train", "validation"):
        shutil.copy(corpus / f"{split}_slice.txt", folder / f"{split}.txt")
    first = (corpus / "train_slice.txt").read_text().splitlines()[:3]
    for extra in ([], ["--streaming"]):
        args = ["--output_dir", str(tmp_path / "out"), "--dataset_name", str(folder), "--do_train", *extra]
        model_args, data_args, _ = script.parse_args(args)
        raw = script.load_raw_datasets(model_args, data_args)
        assert [row["text"] for row in itertools.islice(raw["train"], 3)] == first and "validation" in raw
    monkeypatch.setattr(script.jax, "process_count", lambda: 2)
    script.load_raw_datasets(model_args, data_args)
    assert "has 1 file(s), not a multiple of the 2 processes: each process reads all of it" in caplog.text


def test_a_text_file_streams_in_byte_ranges_each_process_reading_only_its_own(script, monkeypatch, tmp_path):
    """A streamed --train_file is cut into byte ranges at line starts, their count a multiple of the processes: the
    rows are datasets' text loader's (line breaks kept or not, CRLF too); two processes get disjoint ranges that
    make the file; a resume continues inside a range; and a process never decodes another's range (a byte that is
    not UTF-8 in the second half stops only process 1)."""
    path = tmp_path / "lines.txt"
    path.write_bytes(b"".join(b"line %d %s%s" % (i, b"x" * (i % 7), b"\r\n" if i % 5 else b"\n") for i in range(64)))
    for keep in (True, False):
        loader = datasets.load_dataset("text", data_files=str(path), split="train", keep_linebreaks=keep)
        assert list(script.text_file_stream(str(path), keep, shard_bytes=100)) == list(loader)
    monkeypatch.setattr(script.jax, "process_count", lambda: 2)
    stream = script.text_file_stream(str(path), False, shard_bytes=100)
    assert stream.num_shards > 2 and stream.num_shards % 2 == 0
    shares = [[row["text"] for row in split_dataset_by_node(stream, p, 2)] for p in (0, 1)]
    assert sorted(shares[0] + shares[1]) == sorted(loader["text"]) and not set(shares[0]) & set(shares[1])
    share = split_dataset_by_node(stream, 1, 2)
    rows = iter(share)
    next(rows), next(rows), next(rows)
    share.load_state_dict(share.state_dict())
    assert [row["text"] for row in share] == shares[1][3:]
    size = path.stat().st_size
    path.write_bytes(path.read_bytes() + b"caf\xe9\n")
    halves = [split_dataset_by_node(script.text_file_stream(str(path), False), p, 2) for p in (0, 1)]
    assert len(list(halves[0])) > 30
    with pytest.raises(SystemExit, match=f"not UTF-8 text \\(byte 0xe9 at offset {size + 3}\\); convert it .*resume"):
        list(halves[1])
