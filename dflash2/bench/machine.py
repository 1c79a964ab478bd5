"""Is the machine quiet? The load record of every table, and the commit a run measured."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

BUSY = 0.1  # other processes' CPU seconds per wall second above which a table is marked busy



class LoadMonitor:
    """CPU use of other processes while a table runs: the machine's busy CPU time (/proc/stat) minus
    this process's and its children's, per second of wall time, and the 1-minute load average
    before and after (for the record: our own threads raise it too)."""

    def __init__(self, server_cpu: Callable[[], float] | None = None) -> None:
        self.server_cpu = server_cpu  # a server the bench launched: its CPU counts as the bench's own
        self.load_before = _loadavg()
        self.start = (time.perf_counter(), _busy_cpu_s(), self._own())

    def _own(self) -> float:
        return _own_cpu_s() + (self.server_cpu() if self.server_cpu else 0.0)

    def record(self) -> dict[str, Any]:
        wall, busy, own = time.perf_counter(), _busy_cpu_s(), self._own()
        other = None
        if busy is not None and self.start[1] is not None and wall > self.start[0]:
            other = max(0.0, (busy - self.start[1]) - (own - self.start[2])) / (wall - self.start[0])
        other = None if other is None else round(other, 3)  # busy is judged on the recorded value
        return dict(load_before=self.load_before, load_after=_loadavg(), threads=torch.get_num_threads(),
                    other_cpu=other, busy=None if other is None else other > BUSY)


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _busy_cpu_s() -> float | None:
    """Seconds of CPU time the whole machine spent busy (all but idle and iowait), from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    import resource

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def load_note(load: dict[str, Any]) -> str:
    """The load record as the markdown header says it; bold when the table ran on a busy machine."""
    other = "unknown" if load.get("other_cpu") is None else f"{load['other_cpu']:.2f}"
    text = (f"load average {load.get('load_before')} before, {load.get('load_after')} after; {load.get('threads')} "
            f"threads; other processes' CPU {other} s per s")
    if load.get("busy"):
        return f"**Busy machine: other processes used {other} CPU s per s while this table ran; its timings are not " \
               f"results.** ({text})"
    if load.get("busy_judged_by") == "tables":  # launched servers' start-up counts as other processes here
        text += " (the servers the bench launched started up in this window; quiet or busy is judged by the tables)"
    return f"Quiet machine: {text}." if load.get("busy") is False else f"Load: {text}."


def commit() -> str | None:
    """The repository's commit (with "+changes" when the tree differs from it), when run from a checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():  # an installed copy: its code is not the enclosing repository's
        return None
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+changes" if dirty else "") if rev else None

