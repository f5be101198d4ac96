"""Shared fixtures: a slice of the real default corpus (Penn Treebank), a tiny tokenizer and config."""

import atexit
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from unittest import mock

import pytest
from filelock import FileLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ROBERTA = "hidden_size=64,num_hidden_layers=2,num_attention_heads=2,intermediate_size=128"
TINY_GPT2 = "n_embd=64,n_layer=2,n_head=2"
TINY_T5 = "d_model=64,d_kv=32,d_ff=128,num_layers=2,num_decoder_layers=2,num_heads=2"
TINY_BART = (
    "d_model=64,encoder_layers=2,decoder_layers=2,encoder_attention_heads=2,decoder_attention_heads=2,"
    "encoder_ffn_dim=128,decoder_ffn_dim=128"
)

# benchmarks/run_benchmark.py's tests check the harness, not the speed: batches of 16 x 32 tokens in place of --quick's
# 64 x 64 (on a Zen 1: its quick run 243 s of CPU in place of 341, its end-to-end run 282 s in place of 453).
BENCHMARK_BATCH = ("--batch_size", "16", "--seq_len", "32")


# The suite's programs are tiny and run a few steps, so LLVM's optimisation of XLA's CPU code costs more than it
# saves: about half of each compile. The suite, and every process it starts, compiles at optimisation level 0 (on a
# Zen 1, a tiny MLM run of 60 steps took 25 s of CPU in place of 33), and with XLA:CPU's older fusion emitters (on an
# Intel Xeon, family 6 model 167, a tiny MLM train step compiled in 1.1-1.3 s in place of 1.6-2.0): the same programs,
# less optimised machine code. A flag already in XLA_FLAGS (such as --xla_cpu_max_isa=AVX2, or another level) is kept.
# jaxlib 0.11 and later have only the new emitters, and stop at the start on a flag they do not know.
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0",)
if tuple(map(int, importlib.metadata.version("jaxlib").split(".")[:2])) < (0, 11):
    SUITE_XLA_FLAGS += ("--xla_cpu_use_fusion_emitters=false",)
for flag in SUITE_XLA_FLAGS:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


@pytest.fixture(scope="module")
def optimised_xla():
    """XLA_FLAGS without the suite's flags for every process a file's tests start: for the files whose XLA programs
    spend their time in steps, not compiles (the benchmarks' larger batches, 2.5 times slower a step at level 0, and
    TensorFlow's jit_compile runs: a test of them took 182 s in a suite run at level 0, 75 s in one before it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(
            "XLA_FLAGS", " ".join(flag for flag in os.environ["XLA_FLAGS"].split() if flag not in SUITE_XLA_FLAGS)
        )
        yield


# The scripts hide the frameworks they do not use from transformers (os.environ.setdefault("USE_TF", "0")
# and the like). Imported here, that must not leak into this process or the scripts it starts.
FRAMEWORK_SWITCHES = ("USE_TF", "USE_TORCH", "USE_FLAX")


def load_script(relpath, name):
    """Import a script by path under a name that cannot shadow a package (the folders can), with every
    framework left visible and the environment restored afterwards."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    saved = dict(os.environ)
    os.environ.update({switch: "AUTO" for switch in FRAMEWORK_SWITCHES})
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def script_env(env=None):
    """The environment of a script the suite starts: this one's (its caches in the session's folder, scripts_caches)
    without the framework switches, updated with `env`. An `env` that names its own Hugging Face home (hub_cache,
    datasets_cache) gets that home's datasets cache, not the session's."""
    inherited = {k: v for k, v in os.environ.items() if k not in FRAMEWORK_SWITCHES}
    if "HF_HOME" in (env or {}) and "HF_DATASETS_CACHE" not in env:
        inherited.pop("HF_DATASETS_CACHE", None)
    return {**inherited, **(env or {})}


def run(args, env=None, cwd=ROOT, timeout=900, python=sys.executable):
    """Run a project script as a file, as a user would; returns the CompletedProcess. A run of one of the four Flax
    training scripts that needs nothing of a process of its own (no environment of its own, this Python, one device,
    called from the main thread: output and signals are the process's) calls its main() in this process
    (in_process), sparing a start: SUITE_IN_PROCESS=0 starts every run."""
    here = args[0] in IN_PROCESS_SCRIPTS and env is None and cwd == ROOT and python == sys.executable
    if here and threading.current_thread() is threading.main_thread() and one_device():
        return in_process(args)
    return subprocess.run(
        [python, *args], cwd=cwd, env=script_env(env), capture_output=True, text=True, timeout=timeout
    )


# The scripts whose tiny runs the suite makes in process: importing jax, transformers and datasets again is 4 to 8 s
# of each start. The runs that test a process (signals, kill -9, several devices or hosts, an environment of their
# own) and every copy of a script stay processes of their own.
FLAX_SCRIPTS = ("flax/run_mlm_flax.py", "flax/run_clm_flax.py", "flax/run_t5_mlm_flax.py", "flax/run_bart_dlm_flax.py")
IN_PROCESS_SCRIPTS = () if os.environ.get("SUITE_IN_PROCESS") == "0" else FLAX_SCRIPTS


def one_device():
    """Whether this process's jax has one device, as a script started without XLA_FLAGS of its own would."""
    import jax

    return jax.device_count() == 1


def in_process(args, module=None):
    """Run args (a project script and its command line) through the script's main() in this process, as a process
    of its own would run it (its output captured, from ROOT), and put back what a run changes here: logging's
    handlers and levels, the SIGTERM and SIGINT handlers, sys.excepthook, os.environ and the compile listeners it
    registered with jax. What the script registered to run at exit runs at the end, as at a process's end (removing
    a folder it made). Returns a CompletedProcess: exit 0, a SystemExit's code (its message last on stderr, as
    Python prints it), or 1 and the traceback."""
    from jax._src import monitoring

    args = [str(arg) for arg in args]
    path, stdout, stderr, at_exit, register = args[0], io.StringIO(), io.StringIO(), [], atexit.register
    loggers = [
        logging.getLogger(),
        *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)),
    ]
    saved_loggers = [(x, x.handlers[:], x.level, x.propagate, x.disabled) for x in loggers]
    saved_signals = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    saved_env, saved_hook, listeners = dict(os.environ), sys.excepthook, monitoring.get_event_duration_listeners()
    module = module or load_script(path, f"in_process_{os.path.basename(path)[:-3]}")
    code = 0
    try:
        with (
            mock.patch.object(sys, "argv", args),
            contextlib.chdir(ROOT),
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
            mock.patch.object(
                atexit,
                "register",
                lambda f, *a, **k: (
                    at_exit.append(f) if getattr(f, "__module__", "") == module.__name__ else register(f, *a, **k)
                ),
            ),
        ):
            module.main()
    except SystemExit as exit:
        code = exit.code
        traceback.clear_frames(exit.__traceback__)  # main()'s locals go now, as at a process's end: the folder's lock
    except Exception:
        code = 1
        stderr.write(traceback.format_exc())
    finally:
        for logger, handlers, level, propagate, disabled in saved_loggers:
            logger.handlers[:], logger.level, logger.propagate, logger.disabled = handlers, level, propagate, disabled
        for signum, handler in saved_signals.items():
            if signal.getsignal(signum) is not handler:  # (signal.signal works in the main thread only)
                signal.signal(signum, handler)
        sys.excepthook = saved_hook
        os.environ.clear()
        os.environ.update(saved_env)
        for listener in monitoring.get_event_duration_listeners():
            if listener not in listeners:
                monitoring.unregister_event_duration_listener(listener)
    for hook in at_exit:
        hook()
    message = f"{code}\n" if isinstance(code, str) else ""
    return subprocess.CompletedProcess(
        args, 1 if message else code or 0, stdout.getvalue(), stderr.getvalue() + message
    )


def start(args, log, env=None):
    """Start a project script as a file, its output (stdout and stderr) going to the file `log`, not to a pipe: a
    process stops once a pipe nobody reads is full (64 KiB), and XLA:CPU can log 3 KB at each load of a cached
    program (where LLVM tunes for the CPU with +prefer-no-gather, as on Intel Xeons with AVX-512)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def finish(procs, timeout=600):
    """Wait for each process that start() started; returns what each printed."""
    for proc in procs:
        proc.wait(timeout)
    return [Path(proc.log).read_text() for proc in procs]


def kill_after_first_checkpoint(args, output_dir, env=None, signum=signal.SIGKILL):
    """Start a training run and send it `signum` (kill -9) once its first checkpoint (checkpoint-4) is complete;
    return what it printed."""
    proc = start(args, output_dir.with_name(output_dir.name + ".log"), script_env(env))
    deadline = time.time() + 300
    while not (output_dir / "checkpoint-4" / "trainer_state").is_dir():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    os.kill(proc.pid, signum)
    [output] = finish([proc])
    assert proc.returncode == (-signum if signum == signal.SIGKILL else 128 + signum), output[-3000:]
    return output


def renamed_copy(script, directory):
    """A copy of a Flax training script under a name of its own (run_clm_flax.py: my_clm_flax.py), as a researcher
    makes one to change it."""
    copy = Path(directory) / os.path.basename(script).replace("run_", "my_")
    shutil.copy(os.path.join(ROOT, script), copy)
    return str(copy)


def check_names_itself(copy, log, output_dir):
    """A renamed copy refuses bad input under its own name, and nothing it logged or wrote names the original."""
    name = os.path.basename(copy)
    with pytest.raises(SystemExit) as refused:
        load_script(copy, "copy_" + name[:-3]).main(["--output_dir", str(output_dir), "--no_such_flag"])
    assert str(refused.value.code).startswith(f"{name}: error: unknown argument --no_such_flag")
    written = "".join(p.read_text() for p in Path(output_dir).rglob("*") if p.suffix in (".json", ".txt", ".md"))
    assert name.replace("my_", "run_")[:-3] not in log + written


def hub_cache(home, repo_id, folder):
    """The environment of a machine without internet whose Hugging Face cache (HF_HOME=home) holds `folder` as the
    hub's model `repo_id`, laid out as a download leaves it (models--org--name/snapshots/<revision>, refs/main)."""
    repo, revision = Path(home) / "hub" / f"models--{repo_id.replace('/', '--')}", "0123456789abcdef" * 2 + "01234567"
    shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def datasets_cache(home, repo_id, files):
    """hub_cache's environment, for a dataset: the hub's dataset `repo_id` (text, its splits from `files`) in the
    datasets cache under `home`, laid out as a load of it online leaves it (namespace___name/default/0.0.0/<hash>)."""
    import datasets

    built = datasets.load_dataset("text", data_files={k: str(v) for k, v in files.items()}, cache_dir=str(home / "b"))
    source = Path(built["train"].cache_files[0]["filename"]).parent
    target = Path(home) / "datasets" / repo_id.replace("/", "___") / "default" / "0.0.0" / source.name
    shutil.copytree(source, target)
    for split in files:
        (target / f"text-{split}.arrow").rename(target / f"{repo_id.split('/')[1]}-{split}.arrow")
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def check_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def error_line(result, prefix):
    """A bad input must give exactly one line on stderr, starting with the script's name, and exit non-zero."""
    assert result.returncode != 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    last = lines[-1]
    assert last.startswith(f"{prefix}: error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return last


@functools.cache
def script_module(path):
    return load_script(path, "refusing_" + path.replace("/", "_")[:-3])


def refusal(args):
    """Run args (a script and its command line) through the script's main() here (in_process); returns the one error
    line it must end with."""
    result = in_process(args, script_module(args[0]))
    assert result.returncode != 0, f"{args[0]} accepted {args[1:]}"
    return error_line(result, args[0].split("/")[-1])


def bad_input(make_args, prefix, default_output):
    """A caller for bad-input tests: runs make_args(output_dir, *extra) (with --train_file replaced when
    train_file is given) and returns the one error line the script must print; in this process (refusal), but for an
    `env` of its own."""

    def call(*extra, env=None, train_file=None, output_dir=None):
        args = make_args(output_dir or default_output, *extra)
        if train_file is not None:
            args[args.index("--train_file") + 1] = str(train_file)
        return error_line(run(args, env=env), prefix) if env else refusal(args)

    return call


def session_folder(tmp_path_factory):
    """The folder of the whole pytest session: shared by its pytest-xdist workers, each of which has its own below
    it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name, build, *args):
    """The folder `name` in the session's folder, written by build(folder, *args) once for all the session's
    workers: the first to ask builds it under a file lock, the others wait for it, then read it (no test writes to
    it)."""
    folder = session_folder(tmp_path_factory) / name
    done = folder.with_name(name + ".done")
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker whose build failed left
            folder.mkdir()
            build(folder, *args)
            done.touch()
    return folder


def write_corpus(out):
    check_ok(run(["tokenizers/prepare_corpus.py", "--corpus", "ptb", "--output_dir", str(out)]))
    for split, lines in (("train", 3000), ("validation", 200)):
        with open(out / f"{split}.txt") as f:
            head = [next(f) for _ in range(lines)]
        (out / f"{split}_slice.txt").write_text("".join(head))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The real PTB splits from the corpus helper, plus small slices of them for fast tests."""
    return built_once(tmp_path_factory, "ptb", write_corpus)


# benchmarks/workload.py's prepare_files, run from the repository root: the corpus and the 8,192-token tokenizer in
# the work folder sys.argv[1] (where each is already, it is kept), and the config of the size --quick trains.
PREPARE_BENCHMARK_FILES = """
import sys
from pathlib import Path
from benchmarks import modes, workload

workload.prepare_files(Path(sys.argv[1]), "tiny", modes.SIZES["tiny"])
"""


def benchmark_work(output_dir, corpus, tmp_path_factory):
    """The work folder of a benchmarks/run_benchmark.py run into `output_dir`, already holding the PTB corpus and
    the 8,192-token tokenizer that the run's preparation would make first and keeps where they are: the suite's
    corpus, and the tokenizer the harness's own prepare_files trained once for the session's benchmark runs.
    test_benchmark.py's cut run keeps the whole preparation of its own."""

    def prepare(folder):
        (folder / "ptb").symlink_to(corpus)
        check_ok(run(["-c", PREPARE_BENCHMARK_FILES, str(folder)]))

    shared = built_once(tmp_path_factory, "benchmark-work", prepare)
    work = Path(output_dir) / "work"
    work.mkdir(parents=True)
    for name in ("ptb", "tokenizer"):
        (work / name).symlink_to(shared / name)
    return work


# An evaluation of the same weights in another process, device count or batch size: float32 sums of up to a few
# thousand per-token terms a batch in another order, which round like a random walk (sqrt(n) x 2**-24: 3e-6).
RELOAD_RTOL = 1e-5


def fake_devices(count, optimised=False):
    """The environment for `count` fake CPU devices, keeping the XLA_FLAGS the suite runs under (such as
    --xla_cpu_max_isa=AVX2, to run XLA's code as an AVX2-only CPU would), or with optimised=True all but the suite's
    own (SUITE_XLA_FLAGS): for the runs of a hundred steps and more, whose time goes to steps, not compiles (on an AMD
    EPYC Zen 3, BART's 126 steps of 2 x 8 x 64 took 108 s of CPU at level 0, 56 s at XLA's default level)."""
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if not (optimised and flag in SUITE_XLA_FLAGS)]
    return {"XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])}


TWO_DEVICES, FOUR_DEVICES, TWO_DEVICES_OPTIMISED = fake_devices(2), fake_devices(4), fake_devices(2, optimised=True)


def make_model_dir(out, corpus, model_type, overrides, *tokenizer_args):
    """Train a 1000-piece tokenizer on the PTB train split and write a tiny config beside it."""
    check_ok(
        run(
            [
                "tokenizers/train_tokenizer.py",
                "--train_file",
                str(corpus / "train.txt"),
                "--vocab_size",
                "1000",
                "--output_dir",
                str(out),
                *tokenizer_args,
            ]
        )
    )
    check_ok(
        run(
            [
                "tokenizers/create_config.py",
                "--model_type",
                model_type,
                "--tokenizer_name",
                str(out),
                "--config_overrides",
                overrides,
                "--output_dir",
                str(out),
            ]
        )
    )
    return out


def script_args(script, model_type, model_dir, corpus, output_dir, *extra):
    """A Flax script's command line on the PTB slices with a tiny model (length flags go in extra)."""
    return [
        script,
        "--output_dir",
        str(output_dir),
        "--model_type",
        model_type,
        "--config_name",
        str(model_dir),
        "--tokenizer_name",
        str(model_dir),
        "--train_file",
        str(corpus / "train_slice.txt"),
        "--validation_file",
        str(corpus / "validation_slice.txt"),
        "--per_device_eval_batch_size",
        "16",
        *extra,
    ]


def logged_losses(log):
    """The training losses a script printed ("| loss X")."""
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+)", log)]


def losses_by_step(log):
    """{step: the loss text as logged} from a Flax script's "Step N/T (...) | loss X" lines."""
    return dict(re.findall(r"Step (\d+)/\d+ \([^)]*\) \| loss ([0-9.]+|nan|inf)", log))


# The four Flax training scripts: model type, the fixture of their tiny model folder, their length flag.
FLAX_TRAINING_SCRIPTS = {
    "flax/run_mlm_flax.py": ("roberta", "tiny_model_dir", "--max_seq_length"),
    "flax/run_clm_flax.py": ("gpt2", "gpt2_dir", "--block_size"),
    "flax/run_t5_mlm_flax.py": ("t5", "t5_dir", "--max_seq_length"),
    "flax/run_bart_dlm_flax.py": ("bart", "bart_dir", "--max_seq_length"),
}


def flax_args(path, request, corpus, output_dir, *extra, length="32"):
    """A Flax training script's command line on the PTB slices with its tiny model (length 32 by default)."""
    model_type, fixture, length_flag = FLAX_TRAINING_SCRIPTS[path]
    return script_args(
        path, model_type, request.getfixturevalue(fixture), corpus, output_dir, length_flag, length, *extra
    )


def eval_reloaded(args, trained_dir, output_dir):
    """Evaluate the checkpoint in trained_dir with the same command line minus training, on one
    device, and return its eval_results.json."""
    again = [a for a in args if a != "--do_train"] + ["--model_name_or_path", str(trained_dir)]
    again[again.index("--output_dir") + 1] = str(output_dir)
    again[again.index("--config_name") + 1] = str(trained_dir)
    check_ok(run(again))
    return json.loads((output_dir / "eval_results.json").read_text())


@pytest.fixture(scope="session")
def tiny_model_dir(corpus, tmp_path_factory):
    """A 1000-token byte-level BPE tokenizer and a tiny RoBERTa config in one folder."""
    return built_once(tmp_path_factory, "tiny", make_model_dir, corpus, "roberta", TINY_ROBERTA)


@pytest.fixture(scope="session")
def gpt2_dir(corpus, tmp_path_factory):
    return built_once(tmp_path_factory, "gpt2", make_model_dir, corpus, "gpt2", TINY_GPT2, "--model_type", "gpt2")


@pytest.fixture(scope="session")
def t5_dir(corpus, tmp_path_factory):
    return built_once(tmp_path_factory, "t5", make_model_dir, corpus, "t5", TINY_T5, "--tokenizer_type", "unigram")


@pytest.fixture(scope="session")
def bart_dir(corpus, tmp_path_factory):
    return built_once(tmp_path_factory, "bart", make_model_dir, corpus, "bart", TINY_BART)


# run.sh runs the suite under pytest-xdist, each worker taking whole files in this order (--dist loadfile
# --no-loadscope-reorder): the longest files first, so that none of them is left to run alone at the end.
LONGEST_FIRST = (
    "test_tensorflow.py",
    "test_flax_training.py",
    "test_benchmark_end_to_end.py",
    "test_streaming.py",
    "test_compile_topology.py",
    "test_bf16.py",
    "test_pytorch_run_mlm.py",
    "test_benchmark.py",
    "test_flax_resume.py",
    "test_run_mlm_flax.py",
    "test_bad_input.py",
    "test_objective_block.py",
    "test_architectures.py",
)


def compilation_cache_dir():
    """The persistent XLA compilation cache's folder, kept from one session to the next (and from one CI run to the
    next on the same machine), one folder per key: the CPU (its model and instruction flags: XLA:CPU's code is built
    for the CPU it compiles on), jax's and jaxlib's versions and XLA_FLAGS. jax's own key holds the program, the
    flags and jaxlib, not the CPU: a folder copied or shared to another CPU is never read there."""
    info = cpu_info()
    versions = [importlib.metadata.version(package) for package in ("jax", "jaxlib")]
    cpu = [info.get(field, "") for field in ("vendor_id", "model name", "cpu family", "model", "stepping", "flags")]
    key = json.dumps([*cpu, *versions, os.environ.get("XLA_FLAGS", "")])
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache_home, "lm-pretraining-tests", "jax-cache", hashlib.sha256(key.encode()).hexdigest()[:16])


@pytest.fixture(scope="session", autouse=True)
def compilation_cache():
    """One persistent XLA compilation cache for the suite (both pytest-xdist workers, every script they start, the
    sessions before and after on this CPU and stack): a program compiled once, such as the step of a run and of its
    resumed copy, is loaded the next time. The cache holds what XLA compiled, so results are those of a fresh compile;
    flax/train_compile.py's runs keep it off."""
    settings = dict(compilation_cache_dir=compilation_cache_dir(), compilation_cache_max_size=2**32)  # 4 GiB, LRU
    settings.update(persistent_cache_min_compile_time_secs=0)  # a tiny model's programs compile in under a second
    for name, value in settings.items():
        os.environ[f"JAX_{name.upper()}"] = str(value)
        if "jax" in sys.modules:  # in-process tests too
            sys.modules["jax"].config.update(f"jax_{name}", value)


@pytest.fixture(scope="session", autouse=True)
def scripts_caches(tmp_path_factory):
    """The caches of the scripts the suite starts (and of this process, where it imports datasets after this) in the
    session's own temporary folder, not the home folder's: datasets' Arrow caches (each test's tmp_path a new
    fingerprint, so each run would add new ones under ~/.cache/huggingface/datasets) and torch.compile's inductor
    cache (else under /tmp). pytest keeps the last three sessions' folders and removes older ones."""
    base = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_CACHE", str(base / "hf-datasets-cache"))
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(base / "torchinductor-cache"))
        yield


def pytest_sessionstart(session):
    """The CPU the suite runs on (float results and bf16 speed depend on it), as the first line of every log, -q
    too."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):  # not in pytest-xdist's workers
        reporter.write_line(cpu_line())


def cpu_info():
    """The first CPU's fields in /proc/cpuinfo."""
    first = open("/proc/cpuinfo").read().split("\n\n")[0]
    return {
        key.strip(): value.strip() for key, value in (line.split(":", 1) for line in first.splitlines() if ":" in line)
    }


def cpu_line():
    info = cpu_info()
    bf16 = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in info.get("flags", "").split()]
    isa = "AVX-512" if "avx512f" in info.get("flags", "") else "AVX2" if "avx2" in info.get("flags", "") else "no AVX2"
    return (
        f"CPU: {info.get('model name', 'unknown')} (family {info.get('cpu family', '?')}, "
        f"model {info.get('model', '?')}),"
        f" {isa}, bf16 instructions: {' '.join(bf16) or 'none'}, {os.cpu_count()} cores;"
        f" XLA_FLAGS={os.environ.get('XLA_FLAGS', '') or '(unset)'}"
    )


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
