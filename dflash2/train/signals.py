"""The processes of a run: ranks, the stop signals (SIGINT / SIGTERM: a checkpoint at the end of the
step, one line, exit 130 / 143), and the launcher of `--nproc-per-node`."""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Iterator


def _rank() -> int:
    """This process's rank under torchrun or --nproc-per-node (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; `signum` says which."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_signals(deferred: dict[str, int | None]) -> Iterator[None]:
    """SIGINT / SIGTERM: when deferred["defer"] is set, remember the signal in deferred["signum"] (the
    training loop stops at the end of the step it is in); otherwise, or at a second signal, raise
    Interrupted at once (the data regeneration: shards are written atomically). A repeat within
    REPEAT_S of the first is the same request delivered twice (under torchrun a worker gets Ctrl-C from
    the terminal and again from the launcher, which forwards it), not a second one. Once
    deferred["stopping"] is set (the stop agreed), every signal is ignored."""

    def handler(signum, frame):
        if deferred.get("stopping"):  # a stop agreed: the checkpoint and the ranks' leaving are under way
            return
        if deferred.get("defer"):
            if deferred.get("signum") is None:
                deferred["signum"], deferred["at"] = signum, time.monotonic()
                return
            if time.monotonic() - deferred["at"] < REPEAT_S:
                return
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


REPEAT_S = 2.0


def launch(nproc: int, argv: list[str], shutdown_timeout: int = 300) -> int:
    """`python -m dflash2.train --nproc-per-node N ...`: torch.distributed.run's elastic launch of N
    workers (`--standalone`: one machine, a free port), run in this process so that its ending is ours.
    torchrun itself answers Ctrl-C with its SignalException traceback and exit 1; here the launcher
    forwards the signal, waits up to `shutdown_timeout` s for the workers (rank 0 prints the one line
    and writes the checkpoint of the step every rank reached) and exits 128 + the signal."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as elastic_run

    for name in list(logging.Logger.manager.loggerDict):  # rank 0's line says it all (each has its own level)
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    parser = get_args_parser()
    flags = ["--standalone", f"--nproc-per-node={nproc}"]
    if "--shutdown-timeout" in parser._option_string_actions:  # torch >= 2.9: the workers' time to checkpoint
        flags.append(f"--shutdown-timeout={shutdown_timeout}")
    try:
        elastic_run(parser.parse_args([*flags, "-m", "dflash2.train", *argv]))
    except SignalException as stop:  # this process got the signal and forwarded it: the workers have stopped
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        codes = sorted({f.exitcode for f in failed.failures.values()})
        stopped = {130, 143, -signal.SIGINT, -signal.SIGTERM}  # as asked, or ended by the launcher once stopping
        if set(codes) <= stopped and set(codes) & {130, 143}:  # the workers got the signal themselves
            return max(set(codes) & {130, 143})
        print(f"error: {len(failed.failures)} of the {nproc} training processes failed (exit codes {codes}); "
              "their messages are above", file=sys.stderr)
        return 1
    return 0
