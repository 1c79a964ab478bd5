"""Ctrl-C and SIGTERM under two gloo training processes: one line from rank 0, a checkpoint at the step
every rank reached, every process gone, exit 130 / 143; through `python -m dflash2.train --nproc-per-node 2`
(the launcher in our process) and, for the checkpoint and the processes, under torchrun itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash2.train.checkpoint import load_checkpoint
from tests.helpers import MASK, tiny_target

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target("qwen3").save_pretrained(path)
    return path


LAUNCHED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    yield
    while LAUNCHED:  # a failing test leaves no rank behind (a hung all-reduce would wait forever)
        proc = LAUNCHED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start(target: Path, out: Path, torchrun: bool = False, parallel: str = "ddp") -> subprocess.Popen:
    """The run, once both ranks are in the training loop (rank 0's bar has counted a step)."""
    args = [f"target={target}", f"out={out}", "steps=2000", "batch_size=2", "ckpt_every=1000", "drafter.block_size=4",
            f"drafter.mask_token_id={MASK}", "drafter.num_layers=1", "data.num_sequences=8", "data.prompt_tokens=4",
            "data.new_tokens=8", f"parallel={parallel}"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "dflash2.train", *args]
    else:
        cmd = [sys.executable, "-m", "dflash2.train", "--nproc-per-node", "2", *args]
    out.mkdir(parents=True)
    log = (out.parent / "stderr.txt").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.log = out.parent / "stderr.txt"
    LAUNCHED.append(proc)
    deadline = time.monotonic() + 240
    while max(map(int, re.findall(r" (\d+)/2000 ", proc.log.read_text())), default=0) < 3:
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.1)
    return proc


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def workers(launcher: int) -> dict[int, int]:
    """rank → pid of the training processes under the launcher (torchrun's agent may sit in between)."""
    found, todo = {}, _children(launcher)
    while todo:
        pid = todo.pop()
        try:
            env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        except OSError:
            continue
        if "LOCAL_RANK" in env:
            found[int(env["RANK"])] = pid
        todo += _children(pid)
    return found


def wait(proc: subprocess.Popen, out: Path) -> tuple[int, str, int]:
    proc.wait(timeout=120)
    err = proc.log.read_text()
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left: {left}"
    return proc.returncode, err, load_checkpoint(out / "ckpt.pt")["step"]


def interrupted_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("interrupted by")]


@pytest.mark.parametrize("how, code, parallel", [("SIGINT", 130, "ddp"), ("SIGTERM", 143, "ddp"), ("SIGINT", 130, "fsdp")])
def test_the_launcher_stops_every_rank_with_one_line_and_a_checkpoint(target_dir, tmp_path, how, code, parallel):
    out = tmp_path / "run"
    proc = start(target_dir, out, parallel=parallel)
    os.killpg(proc.pid, getattr(signal, how))  # Ctrl-C in a terminal: the whole process group
    rc, err, step = wait(proc, out)
    assert rc == code, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err and "death signal" not in err
    lines = interrupted_lines(err)
    assert len(lines) == 1, err[-3000:]  # rank 0 only
    assert lines[0] == (f"interrupted by {how} at step {step} of 2000: checkpoint written to {out / 'ckpt.pt'}; "
                        "the same command resumes") and step >= 3
    assert bool(load_checkpoint(out / "ckpt.pt").get("fsdp")) == (parallel == "fsdp")  # every rank gathered it


def test_a_signal_to_one_rank_stops_both_at_the_same_step(target_dir, tmp_path):
    out = tmp_path / "run"
    proc = start(target_dir, out)
    os.kill(workers(proc.pid)[1], signal.SIGTERM)  # rank 1 alone: rank 0 must learn of it at the step's end
    rc, err, step = wait(proc, out)
    assert rc == 143, err[-3000:]
    assert len(interrupted_lines(err)) == 1 and "Traceback" not in err
    assert step >= 3


def test_the_launchers_own_signal_is_forwarded(target_dir, tmp_path):
    out = tmp_path / "run"
    proc = start(target_dir, out)
    os.kill(proc.pid, signal.SIGINT)  # the launcher alone: it forwards the signal to the workers
    rc, err, step = wait(proc, out)
    assert rc == 130 and len(interrupted_lines(err)) == 1 and "Traceback" not in err, err[-3000:]


def test_under_torchrun_itself_the_checkpoint_is_written_and_every_rank_stops(target_dir, tmp_path):
    out = tmp_path / "run"
    proc = start(target_dir, out, torchrun=True)
    os.killpg(proc.pid, signal.SIGINT)
    rc, err, step = wait(proc, out)  # torchrun's own exit status and traceback are torchrun's (docs/training.md)
    assert rc != 0 and step >= 1
    assert len(interrupted_lines(err)) == 1


def test_a_repeated_signal_within_the_window_is_the_same_request(monkeypatch):
    """torchrun's agent forwards the Ctrl-C its workers got from the terminal too: a worker sees two in a row.
    The second must not cut the step's checkpoint short; one after the window stops at once."""
    import dflash2.train.signals as run

    monkeypatch.setattr(run, "REPEAT_S", 0.5)
    signals = {"defer": 1, "signum": None}
    with run.stop_signals(signals):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the forwarded copy
        time.sleep(0.05)
        assert signals["signum"] == signal.SIGINT
        time.sleep(0.6)
        with pytest.raises(run.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)  # the user's second Ctrl-C, later: at once
            time.sleep(0.1)


def test_once_the_stop_is_agreed_no_signal_breaks_into_it(monkeypatch):
    """Under a launcher the first rank to leave gets the others signalled (seconds after the signal that
    stopped the run, on a loaded machine): a rank still in its checkpoint, barrier or process group's
    teardown must finish them, not raise out of them (which left torch's threads to abort the process
    at exit, code -6, and the launcher to report a failure)."""
    import dflash2.train.signals as run

    monkeypatch.setattr(run, "REPEAT_S", 0.1)
    signals = {"defer": 1, "signum": signal.SIGTERM, "at": time.monotonic() - 1.0, "stopping": 1}
    with run.stop_signals(signals):
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, after the window
        time.sleep(0.1)
    signals["stopping"] = 0  # the mutant's case: the same signal with no stop agreed raises at once
    with pytest.raises(run.Interrupted), run.stop_signals(signals):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
