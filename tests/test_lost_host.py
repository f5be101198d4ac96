"""A multi-host run whose process dies or stops answering: every other process stops within the heartbeat bound, in
one line naming the lost process, the step and the checkpoint to resume from, with exit code 75; the run resumes."""

import os
import re
import signal
import socket
import subprocess
import time

import pytest
from conftest import TWO_DEVICES, finish, flax_args, losses_by_step, run, script_env, start
from test_flax_training import MLM, start_two_hosts

HEARTBEAT = 6  # seconds: jax's --heartbeat_timeout_seconds, short here (100 by default)


def lost_run(request, corpus, out, tmp_path, lost, signum, when):
    """Two processes of one device each train the tiny RoBERTa with a checkpoint every 3 steps; process `lost` gets
    `signum` (kill -9 or -STOP) once when() holds. Returns the other's output, its time to stop and the arguments."""
    args = flax_args(
        MLM, request, corpus, out, "--do_train", "--per_device_train_batch_size", "2", "--save_steps", "3"
    )
    args += [
        "--max_steps",
        "8",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--heartbeat_timeout_seconds",
        str(HEARTBEAT),
    ]
    procs = start_two_hosts(args, tmp_path)
    deadline = time.time() + 300
    while not when():
        assert all(p.poll() is None for p in procs) and time.time() < deadline, "the run ended before the loss"
        time.sleep(0.005)
    procs[lost].send_signal(signum)
    started, survivor = time.time(), procs[1 - lost]
    [log] = finish([survivor], timeout=120)
    stopped = time.time() - started
    procs[lost].kill()
    assert survivor.returncode == 75, log[-3000:]
    return log, stopped, args


def check_the_line(log, out, survivor, lost):
    """The survivor's last line, naming the lost process, its host, the step and the last complete checkpoint; no
    traceback or C++ output on the terminal: that went to output_dir/process-N.log. Returns the checkpoint's step."""
    line = log.splitlines()[-1]
    coordinator = ", the coordinator" if lost == 0 else ""
    expected = (
        rf"run_mlm_flax\.py: process {lost} \(host {re.escape(socket.gethostname())}{coordinator}\) was lost after "
        rf"step (\d+), so this process stopped; resume from {re.escape(str(out))}/checkpoint-(\d+) with "
        rf"--resume_from_checkpoint \(log: {re.escape(str(out))}/process-{survivor}\.log\)"
    )
    found = re.fullmatch(expected, line)
    assert found, log[-3000:]
    assert not re.search(r"Traceback|stack trace|^[EFW]\d{4} |CoordinationService", log, re.M), log[-3000:]
    assert "CoordinationService" in (out / f"process-{survivor}.log").read_text()
    return int(found[2])


def test_a_coordinator_killed_while_saving_stops_the_other_at_once_and_its_half_checkpoint_is_passed_over(
    request, corpus, tmp_path
):
    """kill -9 to process 0 (the coordinator) while checkpoint-6 is being written: process 1 stops at once, naming
    it; checkpoint-6, half written, is not taken at resume, which continues on one process of two devices (another
    process count): the same losses, to their printed rounding."""
    out = tmp_path / "multi"
    saving = lambda: any(out.glob("checkpoint-6.orbax-*"))  # noqa: E731
    log, stopped, args = lost_run(request, corpus, out, tmp_path, 0, signal.SIGKILL, saving)
    assert check_the_line(log, out, 1, 0) == 3 and stopped < HEARTBEAT, log[-3000:]
    assert not (out / "checkpoint-6").exists() and any(out.glob("checkpoint-6.orbax-*"))
    resumed = run([*args, "--resume_from_checkpoint"], env=TWO_DEVICES)
    assert resumed.returncode == 0 and f"Resuming at step 3 from {out}/checkpoint-3" in resumed.stderr
    before, after = losses_by_step(log), losses_by_step(resumed.stdout + resumed.stderr)
    assert len(after) == 5 and all(abs(float(after[s]) - float(before[s])) <= 1.2e-4 for s in ("4", "5", "6"))


def test_a_stopped_process_stops_the_other_within_the_heartbeat_timeout_and_the_run_resumes(request, corpus, tmp_path):
    """kill -STOP to process 1 once process 0 has logged step 4 (a hung host): process 0 stops within the heartbeat
    timeout of process 1's last heartbeat (10 s more allowed for this loaded machine's delays), naming it; the run
    resumes on the same two processes with the losses the stopped run logged, to the printed digit."""
    out = tmp_path / "multi"
    stepped = lambda: "Step 4/8" in (tmp_path / "host0.log").read_text()  # noqa: E731
    log, stopped, args = lost_run(request, corpus, out, tmp_path, 1, signal.SIGSTOP, stepped)
    assert check_the_line(log, out, 0, 1) == 3 and HEARTBEAT / 2 <= stopped < HEARTBEAT + 10, (stopped, log[-3000:])
    procs = start_two_hosts([*args, "--resume_from_checkpoint"], tmp_path)
    logs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0] and "Resuming at step 3" in logs[0], logs[0][-3000:]
    before, after = losses_by_step(log), losses_by_step(logs[0])
    assert len(after) == 5 and after["4"] == before["4"]  # the same devices: bitwise


def test_a_rank_stopped_under_torchrun_stops_the_other_within_the_ddp_timeout_and_the_run_resumes(
    tiny_model_dir, corpus, tmp_path
):
    """pytorch/run_mlm.py under torchrun (gloo, no accelerator): kill -STOP to one rank once step 6 is logged. The
    other gives up after --ddp_timeout (transformers 4.57 drops it on CPUs: 30 minutes) in one line naming the step and
    the checkpoint, exit 75; torchrun kills the stopped one (SIGTERM, then SIGKILL 30 s on) and exits 1. The same
    command resumes from the newest checkpoint with the losses the stopped run logged after it."""
    from test_pytorch_run_mlm import mlm_args, trainer_losses

    out, launcher, timeout = tmp_path / "ddp", ["-m", "torch.distributed.run", "--nproc_per_node", "2"], 20
    args = mlm_args(
        tiny_model_dir, corpus, out, "--do_train", "--per_device_train_batch_size", "4", "--max_steps", "60"
    )
    args += ["--save_steps", "4", "--logging_steps", "1", "--ddp_timeout", str(timeout)]
    env = script_env({"TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"})  # not a Flax test's USE_TORCH=0
    proc, deadline = start([*launcher, *args], tmp_path / "torchrun.log", env), time.time() + 300
    while len(trainer_losses((tmp_path / "torchrun.log").read_text())) < 6:  # past checkpoint-4
        assert proc.poll() is None and time.time() < deadline, "the run ended before step 6"
        time.sleep(0.005)
    os.kill(max(int(pid) for pid in subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()), signal.SIGSTOP)
    started = time.time()
    [log] = finish([proc], timeout=timeout + 120)
    assert proc.returncode == 1 and time.time() - started < timeout + 45, log[-3000:]
    line = re.search(
        r"run_mlm.py: error: rank 0: another rank was lost after step (\d+) \(gloo: [A-Z][^[]*\), so this rank "
        r"stopped; rerun the command to resume from (.*checkpoint-(\d+))\n",
        log,
    )
    assert line and 4 <= (newest := int(line[3])) <= int(line[1]) and int(line[1]) >= 6, log[-3000:]
    assert "[rank0]: Traceback" not in log and re.search(r"rank      : 0 \(local_rank: 0\)\n  exitcode  : 75", log)
    resumed = run([*launcher, *args], env={"TMPDIR": str(tmp_path)})  # as upstream: the newest whole checkpoint
    assert (
        resumed.returncode == 0 and f"Continuing training from global step {newest}" in resumed.stdout + resumed.stderr
    )
    before, after = trainer_losses(log), trainer_losses(resumed.stdout)
    assert len(after) == 60 - newest and len(before) > newest, (newest, len(before))
    overlap = before[newest:]
    assert after[: len(overlap)] == pytest.approx(overlap, abs=1.2e-4)
