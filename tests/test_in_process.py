"""The suite runs the Flax scripts' single-device runs in its own process (conftest's in_process): such a run is the
run a process of its own makes, and leaves nothing of itself behind."""

import json
import logging
import os
import signal
import subprocess
import sys

from conftest import ROOT, check_ok, error_line, flax_args, in_process, losses_by_step, script_env

CLM = "flax/run_clm_flax.py"


def test_a_run_in_process_is_the_run_a_process_makes_and_leaves_nothing_behind(request, corpus, tmp_path):
    """The same logged losses and evaluation, bit for bit, as the same command started as a process; logging's
    handlers, the SIGTERM handler, sys.excepthook, sys.argv and the environment as they were; a refusal's exit code
    and one line as a process gives them."""

    def args(output_dir, *extra):
        steps = ("--max_steps", "3", "--logging_steps", "1", "--save_steps", "3", "--report_to", "none")
        return flax_args(CLM, request, corpus, output_dir, "--do_train", "--do_eval", *steps, *extra)

    def state():
        root = logging.getLogger()
        return (
            root.handlers[:],
            root.level,
            signal.getsignal(signal.SIGTERM),
            sys.excepthook,
            sys.argv[:],
            {**os.environ},
        )

    import jax  # noqa: F401  (its import sets variables of its own in the environment, as in any in-process test)

    before = state()
    here = check_ok(in_process(args(tmp_path / "here")))
    assert state() == before
    there = check_ok(
        subprocess.run(
            [sys.executable, *args(tmp_path / "there")], cwd=ROOT, env=script_env(), capture_output=True, text=True
        )
    )
    losses = losses_by_step(here.stdout + here.stderr)
    assert sorted(losses) == ["1", "2", "3"] and losses == losses_by_step(there.stdout + there.stderr)
    scores = [json.loads((tmp_path / run / "eval_results.json").read_text()) for run in ("here", "there")]
    untimed = [{k: v for k, v in score.items() if "runtime" not in k and "per_second" not in k} for score in scores]
    assert untimed[0] == untimed[1] and "eval_loss" in untimed[0]
    refused = in_process(args(tmp_path / "refused", "--max_steps", "0"))
    assert refused.returncode == 1 and "--max_steps" in error_line(refused, "run_clm_flax.py")
    assert state() == before and not (tmp_path / "refused").exists()
