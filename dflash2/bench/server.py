"""Server mode of the bench: the same suites sent to a running OpenAI-compatible endpoint.

Each `servers` entry of the bench config is an endpoint (vLLM, SGLang) with or without a drafter; one
with `launch` is started by the bench in its own process group, waited for on `/health`, and stopped
(SIGTERM, then SIGKILL) when its tables are done, also on an error or Ctrl-C. The servers take turns
(A B A B, one untimed warm-up request each), and a launched server not being measured is paused with
SIGSTOP: an idle engine busy-polls its cores. Every request carries the bench's own token ids (the
chat template applied here), so servers and our loop see the same prompts; `api: openai` posts to
`/v1/completions`, `api: sglang` to SGLang's `/generate`.

τ comes from the engine: vLLM's Prometheus counters (1 + accepted / drafts, read before and after each
table), SGLang's `spec_verify_ct` per request (completion tokens / verify steps), else None ("unknown");
a server without a drafter has τ 1. `speedup` is against the table's server without a drafter
(docs/bench.md, "Server mode").
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2.engines.vllm import add_counters
from dflash2.bench.config import ServerSpec
from dflash2.bench.stats import quartiles, ratios, tokens_per_s

# -- the server's life ------------------------------------------------------------------------------------
class Launched:
    """A server process started by the bench: waits until it answers, stops its whole process group."""

    def __init__(self, spec: ServerSpec, log: Path) -> None:
        self.spec, self.log, self.paused = spec, log, False
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        command = shlex.split(spec.launch) if isinstance(spec.launch, str) else [str(a) for a in spec.launch]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{k: str(v) for k, v in (spec.env or {}).items()})
        try:
            self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env)
        except OSError as error:
            self._log.close()
            raise ValueError(f"cannot launch server {spec.name}: {error}") from None

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(f"server {self.spec.name} exited with {self.proc.returncode} before it answered; "
                                 f"the end of {self.log}:\n{_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.spec.url.rstrip("/") + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        raise ValueError(f"server {self.spec.name} did not answer within {self.spec.startup_timeout_s:.0f} s; "
                         f"the end of {self.log}:\n{_tail(self.log)}")

    def pause(self) -> None:
        """SIGSTOP the whole group: a paused server uses no CPU (an idle vLLM busy-polls its cores).
        Returns once the group's processes are stopped (signals arrive asynchronously): the next
        measurement must not start beside a server still running."""
        if self.proc.poll() is None and not self.paused:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True
            _wait_group_state(self.proc.pid, stopped=True)

    def resume(self) -> None:
        if self.proc.poll() is None and self.paused:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.paused = False
            _wait_group_state(self.proc.pid, stopped=False)

    def cpu_s(self) -> float:
        """CPU seconds the server's process group has used so far (its processes still alive)."""
        return _group_cpu_s(self.proc.pid)

    def stop(self) -> float:
        """Stop the group; returns the CPU seconds it used that this process's own rusage will not count
        (its live processes' time, minus what reaping the launched process adds to RUSAGE_CHILDREN)."""
        import resource

        self.resume()  # a stopped process would hold SIGTERM until continued
        used = self.cpu_s()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        reaped = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        return max(0.0, used - reaped)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _group_stats(pgid: int) -> list[list[str]]:
    """The /proc/PID/stat fields after the name (state ppid pgrp ... utime stime ...) of every live
    process in process group `pgid` ([] where /proc is absent)."""
    stats = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            after = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(after) > 12 and int(after[2]) == pgid:
            stats.append(after)
    return stats


def _wait_group_state(pgid: int, stopped: bool, timeout_s: float = 5.0) -> None:
    """Wait until every process of the group is stopped (state T) or none is; gives up after timeout_s
    (a process in uninterruptible sleep stops when it wakes) and where /proc is absent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [f[0] for f in _group_stats(pgid) if f[0] not in ("Z", "X")]  # zombies neither run nor stop
        if all((s in ("T", "t")) == stopped for s in states):
            return
        time.sleep(0.005)


def _group_cpu_s(pgid: int) -> float:
    """utime + stime of every live process in process group `pgid`, from /proc (0 where /proc is absent)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return sum(int(f[11]) + int(f[12]) for f in _group_stats(pgid)) / tick


# -- requests -------------------------------------------------------------------------------------------
def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as error:
        raise ValueError(f"{url} answered {error.code}: {error.read()[:300].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as error:
        raise ValueError(f"{url} did not answer: {error}") from None


def _get(url: str, timeout: float = 30) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as error:
        raise ValueError(f"{url} did not answer: {error}") from None


@dataclass
class Reply:
    text: str
    tokens: int
    seconds: float
    verify_steps: int | None = None  # SGLang's spec_verify_ct


class Client:
    """One server's requests: a prompt of token ids in, the answer's text and token count out."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec, self.base = spec, spec.url.rstrip("/")
        self.model = spec.model
        if spec.api == "openai" and self.model is None:
            models = json.loads(_get(self.base + "/v1/models"))["data"]
            self.model = models[0]["id"]

    def version(self) -> str | None:
        try:
            return json.loads(_get(self.base + "/version", timeout=5)).get("version")
        except (ValueError, json.JSONDecodeError, AttributeError):
            return None

    def generate(self, ids: list[int], max_new_tokens: int, setting: dict, stops: list[int], seed: int) -> Reply:
        # min_p 0: llama-server's default (0.05) would cut the distribution our loop and vLLM sample from
        sampling = dict(temperature=setting["temperature"], top_p=setting["top_p"], min_p=0.0)
        if setting["top_k"] > 0:
            sampling["top_k"] = setting["top_k"]
        t0 = time.perf_counter()
        if self.spec.api == "openai":
            out = _post(self.base + "/v1/completions", dict(model=self.model, prompt=ids, max_tokens=max_new_tokens,
                                                            stop_token_ids=stops, seed=seed, **sampling),
                        self.spec.request_timeout_s)
            seconds = time.perf_counter() - t0
            return Reply(out["choices"][0]["text"], int(out["usage"]["completion_tokens"]), seconds)
        out = _post(self.base + "/generate", dict(input_ids=ids, sampling_params=dict(
            max_new_tokens=max_new_tokens, stop_token_ids=stops, sampling_seed=seed, **sampling)),
            self.spec.request_timeout_s)
        seconds = time.perf_counter() - t0
        out = out if isinstance(out, dict) else out[0]
        meta = out.get("meta_info") or {}
        steps = meta.get("spec_verify_ct")
        return Reply(out["text"], int(meta["completion_tokens"]), seconds, None if steps is None else int(steps))

    def counters(self) -> dict[str, Any] | None:
        """vLLM's (or llama-server's, with --metrics) cumulative spec-decode counters from /metrics (None where
        the server has none)."""
        try:
            text = _get(self.base + "/metrics", timeout=10)
        except ValueError:
            return None
        return parse_spec_metrics(text)


def parse_spec_metrics(text: str) -> dict[str, Any] | None:
    """Prometheus text → {drafts, accepted, accepted_per_position} summed over engines (None: no counters):
    vLLM's `vllm:spec_decode_num_*_total`, llama-server's `llamacpp:spec_decode_num_*_total` (no positions)."""
    out: dict[str, Any] = {"drafts": 0.0, "accepted": 0.0, "accepted_per_position": {}}
    seen = False
    for line in text.splitlines():
        m = re.match(r"^((?:vllm|llamacpp):spec_decode_num_(drafts|accepted_tokens|accepted_tokens_per_pos)_total)"
                     r"(\{[^}]*\})?\s+([0-9.eE+-]+)$", line.strip())
        if not m:
            continue
        seen, kind, value = True, m.group(2), float(m.group(4))
        if kind == "drafts":
            out["drafts"] += value
        elif kind == "accepted_tokens":
            out["accepted"] += value
        else:
            pos = re.search(r'position="(\d+)"', m.group(3) or "")
            if pos:
                key = int(pos.group(1))
                out["accepted_per_position"][key] = out["accepted_per_position"].get(key, 0.0) + value
    return out if seen else None


# -- the tables -----------------------------------------------------------------------------------------
def run_servers(cfg, prompter, sets: dict, stops: list[int], tables: list[dict],
                servers_cpu: list[float] | None = None) -> list[dict[str, Any]]:
    """Every server over every (dataset, concurrency, setting) table, interleaved: all servers are up
    together and each conversation (each repetition of the set, above concurrency 1) goes to every
    server back to back, so slow drifts of the machine hit them alike. Rows as the bench writes them.
    `servers_cpu` gets the CPU seconds of each launched server (its start-up included), which the
    whole run's load record counts as the bench's own."""
    from dflash2.bench.config import SETTINGS
    from dflash2.bench.machine import LoadMonitor

    runs: dict[tuple, dict[str, list]] = {}  # (dataset, conc, setting) → server name → [(rep, p, Run)]
    info: dict[tuple, dict[str, dict]] = {}
    launched: dict[str, Launched] = {}
    try:
        for spec in cfg.servers.values():
            if spec.launch:
                log = Path(cfg.out) / f"server_{spec.name}.log"
                print(f"starting server {spec.name} (log: {log})", flush=True)
                launched[spec.name] = Launched(spec, log)
        for server in launched.values():
            server.wait_ready()
        clients = {spec.name: Client(spec) for spec in cfg.servers.values()}
        versions = {name: c.version() for name, c in clients.items()}
        for server in launched.values():
            server.pause()  # only the server being measured runs (_only)
        first = next(iter(sets.values()))
        for name, client in clients.items():  # untimed: first-call costs
            _only(launched, name)
            _conversation(client, prompter, first, first.conversations[0], cfg, SETTINGS[cfg.settings[0]], stops,
                          cfg.seed)
        own = (lambda: sum(s.cpu_s() for s in launched.values())) if launched else None
        for dataset, prompts in sets.items():
            for conc in cfg.server_concurrency or cfg.concurrency:
                for setting_name in cfg.settings:
                    key = (dataset, conc, setting_name)
                    monitor = LoadMonitor(server_cpu=own)
                    items, steps, spec_decode = _table(clients, launched, prompter, prompts, cfg, SETTINGS[setting_name],
                                                       stops, conc)
                    load = monitor.record()
                    tables.append(dict(dataset=dataset, concurrency=conc, setting=setting_name,
                                       servers=list(clients), launched=list(launched), **load))
                    runs[key] = items
                    info[key] = {name: dict(spec=cfg.servers[name], version=versions[name], load=load,
                                            steps=steps[name], spec_decode=spec_decode[name])
                                 for name in clients}
    finally:
        for name, server in launched.items():
            spent = server.stop()
            if servers_cpu is not None:
                servers_cpu.append(spent)
            print(f"stopped server {name}", flush=True)
    return [row for key in runs for row in _rows(key, runs[key], info[key], cfg)]


def _conversation(client: Client, prompter, prompts, conv, cfg, setting: dict, stops: list[int], seed: int):
    """One conversation's turns in order, each prompt holding the server's earlier answers: (Run, verify steps)."""
    from dflash2.bench.methods import Run

    answers, total, steps = [], Run(0, 0.0), 0
    for k in range(len(conv.turns)):
        reply = client.generate(prompter.ids(prompts, conv, answers), cfg.max_new_tokens, setting, stops,
                                seed + 100_000 * k)
        answers.append(reply.text)
        total = total + Run(reply.tokens, reply.seconds)
        steps = None if steps is None or reply.verify_steps is None else steps + reply.verify_steps
    return total, steps


def _only(launched: dict[str, Launched], name: str) -> None:
    """Let server `name` run and pause every other launched server (an idle engine may spin on its cores,
    which would slow the one being measured; a server the bench did not launch cannot be paused)."""
    for other, server in launched.items():
        if other != name:
            server.pause()
    if name in launched:
        launched[name].resume()


def _table(clients: dict[str, Client], launched: dict[str, Launched], prompter, prompts, cfg, setting: dict,
           stops: list[int], conc: int):
    """`cfg.repetitions` passes over the set, the servers taking turns pass by pass (A B A B: slow drifts
    hit them alike), each alone with the others paused and after one untimed short request (a resumed
    server's first request is slow). Per server: [(rep, p, Run)] (p: the conversation at concurrency 1,
    0 for the whole set above), its SGLang verify steps (None where not reported) and its spec-decode
    counters over the timed requests only."""
    from dflash2.bench.methods import Run

    items: dict[str, list] = {name: [] for name in clients}
    steps: dict[str, int | None] = {name: 0 for name in clients}
    spec: dict[str, dict | None] = {name: None for name in clients}
    add = lambda name, s: None if steps[name] is None or s is None else steps[name] + s  # noqa: E731
    convs = prompts.conversations
    warm = prompter.ids(prompts, convs[0], [])
    for rep in range(cfg.repetitions):
        seed = lambda p: cfg.seed + 1000 * rep + p  # noqa: E731
        for name, client in clients.items():
            _only(launched, name)
            client.generate(warm, 8, setting, stops, cfg.seed)  # untimed
            before = client.counters()
            if conc == 1:  # each conversation alone
                for p, conv in enumerate(convs):
                    run, s = _conversation(client, prompter, prompts, conv, cfg, setting, stops, seed(p))
                    items[name].append((rep, p, run))
                    steps[name] = add(name, s)
            else:  # the whole set, conc conversations in flight
                t0 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=conc) as pool:
                    done = list(pool.map(lambda pc: _conversation(client, prompter, prompts, pc[1], cfg, setting,
                                                                  stops, seed(pc[0])), enumerate(convs)))
                items[name].append((rep, 0, Run(sum(r.new_tokens for r, _ in done), time.perf_counter() - t0)))
                for _, s in done:
                    steps[name] = add(name, s)
            spec[name] = add_counters(spec[name], _delta(before, client.counters()))
    return items, steps, spec


def _delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    positions = sorted(after["accepted_per_position"])
    return dict(drafts=after["drafts"] - before["drafts"], accepted=after["accepted"] - before["accepted"],
                accepted_per_position=[after["accepted_per_position"][i] - before["accepted_per_position"].get(i, 0.0)
                                       for i in positions])


def _rows(key: tuple, runs: dict[str, list], info: dict[str, dict], cfg) -> list[dict[str, Any]]:
    from dflash2.bench.config import SETTINGS

    dataset, conc, setting_name = key
    plain = next((n for n in runs if info[n]["spec"].block_size is None), None)
    base = {(rep, p): r for rep, p, r in runs[plain]} if plain else {}
    rows = []
    for name, items in runs.items():
        spec, data = info[name]["spec"], info[name]
        per_prompt = ratios(items, base)
        tokens = sum(r.new_tokens for _, _, r in items)
        row = dict(method=name, dataset=dataset, block_size=spec.block_size, concurrency=conc, setting=setting_name,
                   **SETTINGS[setting_name], engine="server" + (f" {data['version']}" if data["version"] else ""),
                   url=spec.url, api=spec.api, tokens_per_s=tokens_per_s(items), new_tokens=tokens, runs=len(items),
                   speedup=statistics.median(per_prompt) if per_prompt else None,
                   speedup_vs=plain, busy=data["load"]["busy"])
        spread = quartiles(per_prompt)
        if spread is not None:
            row["speedup_q1"], row["speedup_q3"] = spread
        sd, steps = data["spec_decode"], data["steps"]
        if spec.block_size is None:
            row["tau"] = 1.0
        elif sd and sd["drafts"] > 0:
            row["tau"] = 1 + sd["accepted"] / sd["drafts"]
            row["acceptance_by_position"] = [a / sd["drafts"] for a in sd["accepted_per_position"]]
        elif steps:
            row["tau"] = tokens / steps
        else:
            row["tau"] = None  # the server reports no acceptance
        rows.append(row)
    return rows
