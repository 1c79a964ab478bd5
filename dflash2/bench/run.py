"""A bench run: the models, the prompt sets through the chat template, every table's methods
interleaved over repetitions (the engine's rows one repetition after each of ours), then the
servers' rows, then the report."""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any

import torch

from dflash2.decoding.batch import left_pad
from dflash2.decoding.checks import from_pretrained
from dflash2.drafter.model import DFlash2Drafter
from dflash2.train.data import render
from dflash2.bench.config import DTYPES, SETTINGS, BenchConfig, num_tables
from dflash2.bench.machine import LoadMonitor
from dflash2.bench.llama import run_llama
from dflash2.bench.methods import Method, Run, make_batch_methods, make_methods, merge_engine, resolve, run_engine
from dflash2.bench.prompts import PromptSet, load_prompt_set
from dflash2.bench.report import fastest_plain, summarize, write_outputs


def load_models(cfg: BenchConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.quick:
        return _quick_models()
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r}: CUDA is not available on this machine")
    target_dir = resolve(cfg.target)
    tokenizer = from_pretrained(AutoTokenizer.from_pretrained, resolve(cfg.tokenizer) if cfg.tokenizer else target_dir)
    dtype = DTYPES[cfg.target_dtype]
    target = from_pretrained(AutoModelForCausalLM.from_pretrained, target_dir, dtype=dtype).to(cfg.device).eval()
    drafters = {name: DFlash2Drafter.from_pretrained(resolve(path), device=cfg.device, dtype=torch.float32).eval()
                for name, path in cfg.drafters.items()}  # cast per drafter_dtypes row by row
    ar_draft = None
    if cfg.ar_draft and "hf_assisted" in cfg.methods:
        ar_draft = from_pretrained(AutoModelForCausalLM.from_pretrained, resolve(cfg.ar_draft), dtype=dtype)
        ar_draft = ar_draft.to(cfg.device).eval()
    return tokenizer, target, drafters, ar_draft


def _quick_models():
    """Tiny random models standing in for the embedded pair (smoke test: files and fields, not speed)."""
    import transformers

    from dflash2.embedded import embedded_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(embedded_path("tokenizer")))
    config = lambda layers, hidden: transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    target = transformers.Qwen3ForCausalLM(config(2, 64)).eval()
    ar_draft = transformers.Qwen3ForCausalLM(config(1, 32)).eval()
    drafters = {kind: DFlash2Drafter.from_target(target, block_size=16, mask_token_id=tokenizer.mask_token_id,
                                                 selector_rank=16, **fields).eval()
                for kind, fields in (("dflash1", dict(conv="none", selector="argmax")),
                                     ("dflash2", dict(conv="two_tap", selector="walk")))}
    return tokenizer, target, drafters, ar_draft


class Prompter:
    """Conversation (+ the model's answers so far) → the ids of its next turn's prompt: through the
    target's chat template for a chat set (enable_thinking when set), the turn's text as it is for a
    raw one."""

    def __init__(self, tokenizer, chat_template: bool | str, enable_thinking: bool | None) -> None:
        self.tokenizer, self.chat_template, self.enable_thinking = tokenizer, chat_template, enable_thinking

    def chat(self, prompts: PromptSet) -> bool:
        return prompts.chat if self.chat_template == "auto" else bool(self.chat_template)

    def check(self, prompts: PromptSet) -> None:
        if not self.chat(prompts) and any(len(c.turns) > 1 for c in prompts.conversations):
            raise ValueError(f"dataset {prompts.name!r} has multi-turn conversations: they need the chat "
                             "template (chat_template: auto or true)")
        if self.chat(prompts) and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"dataset {prompts.name!r} goes through the chat template, and the tokenizer has "
                             "none (chat_template=false sends the turns as raw text)")

    def ids(self, prompts: PromptSet, conv, answers: list[str]) -> list[int]:
        if self.chat(prompts):
            return render(self.tokenizer, conv, answers, self.enable_thinking)
        return self.tokenizer(conv.turns[len(answers)]).input_ids

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def converse(fn, prompter: Prompter, prompts: PromptSet, conv, setting: dict, seed: int) -> Run:
    """One conversation through a batch-1 method, turn by turn: each turn's prompt holds the method's own
    earlier answers; the Run sums its turns (prefill included: end-to-end)."""
    total, answers = None, []
    for k in range(len(conv.turns)):
        r = fn(torch.tensor([prompter.ids(prompts, conv, answers)]), setting, seed + 100_000 * k)
        answers.append(prompter.text(r.outputs[0]))
        total = r if total is None else total + r
    return total


def converse_batch(fn, prompter: Prompter, prompts: PromptSet, pad: int, setting: dict, seed: int) -> Run:
    """The whole set through a batched method, turn by turn: turn k of every conversation that has one,
    served together (continuous batching inside), its prompts holding each row's own earlier answers."""
    convs, total = prompts.conversations, None
    answers: list[list[str]] = [[] for _ in convs]
    for k in range(max(len(c.turns) for c in convs)):
        rows = [i for i, c in enumerate(convs) if len(c.turns) > k]
        batch = left_pad([torch.tensor([prompter.ids(prompts, convs[i], answers[i])]) for i in rows], pad)
        r = fn(batch, setting, seed + 100_000 * k)
        for i, out in zip(rows, r.outputs):
            answers[i].append(prompter.text(out))
        total = r if total is None else total + r
    return total


def stop_ids(tokenizer, target) -> list[int]:
    """The tokenizer's EOS first (also the pad id of left-padded batches), then the target's generation
    config's other EOS ids (an instruct model's end-of-turn token)."""
    ids = [tokenizer.eos_token_id]
    extra = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    for i in extra if isinstance(extra, (list, tuple)) else [extra]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def run_bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    tokenizer, target, drafters, ar_draft = load_models(cfg)
    stops = stop_ids(tokenizer, target)
    prompter = Prompter(tokenizer, cfg.chat_template, cfg.enable_thinking)
    sets = {d: load_prompt_set(d, cfg.num_prompts, cfg.dataset_files.get(d)) for d in cfg.datasets}
    for prompts in sets.values():
        prompter.check(prompts)
    servers_cpu: list[float] = []  # launched servers' CPU seconds: the bench's own in the whole run's record
    rows, tables, whole = [], [], LoadMonitor(server_cpu=lambda: sum(servers_cpu))
    template = ", chat template" + ("" if cfg.enable_thinking is None else f", enable_thinking={cfg.enable_thinking}")
    sources = {d: ps.source + (template if prompter.chat(ps) else ", raw text") for d, ps in sets.items()}
    n_tables = num_tables(cfg)
    made: dict = {}  # compiled StaticTargets and drafters, shared by every table (their warm-ups take minutes)
    exports: dict = {}  # llama.cpp's converted drafters, shared by every table
    for dataset, prompts in sets.items():
        calibrators: dict = {}  # the adaptive rows' acceptance calibration, per drafter and setting, across tables
        for block in cfg.block_sizes:
            for conc in cfg.concurrency:
                if conc == 1:
                    methods = make_methods(cfg, target, drafters, ar_draft, block, stops, calibrators, made)
                    inputs = prompts.conversations
                    call = lambda fn, conv, setting, seed: converse(fn, prompter, prompts, conv, setting, seed)  # noqa: E731
                else:
                    methods = make_batch_methods(cfg, target, drafters, block, stops, conc, calibrators, made)
                    inputs = [None]  # the whole set, conc rows in flight
                    call = lambda fn, _, setting, seed: converse_batch(fn, prompter, prompts, stops[0], setting, seed)  # noqa: E731
                for setting_name in cfg.settings:
                    setting = SETTINGS[setting_name]
                    monitor = LoadMonitor()
                    runs: dict[Method, list[tuple[int, int, Run]]] = {m: [] for m in methods}
                    total = (cfg.repetitions * len(inputs) + 1) * len(methods)
                    progress = Progress(f"table {len(tables) + 1}/{n_tables}: {dataset} B={block} c={conc} "
                                        f"{setting_name}", total)
                    for method, fn in methods.items():  # one untimed run of each first (compiles, first-call costs)
                        progress.step(f"warm-up {method.name} (first calls compile)", always=True)
                        call(fn, inputs[0], setting, cfg.seed)
                    engine: dict[Method, Any] = {}  # the engine's rows: one repetition after each of ours
                    for rep in range(cfg.repetitions):
                        # interleaved: every method back to back, in the table's order on even repetitions and the
                        # reverse on odd ones (ABBA): a row's place after another, and the machine's drift over a
                        # repetition, favour no row
                        order = list(methods.items()) if rep % 2 == 0 else list(methods.items())[::-1]
                        for p, conv in enumerate(inputs):
                            for method, fn in order:
                                progress.step(f"repetition {rep + 1}/{cfg.repetitions}, "
                                              + (f"prompt {p + 1}/{len(inputs)}, " if conc == 1 else "")
                                              + method.name)
                                runs[method].append((rep, p, call(fn, conv, setting, cfg.seed + 1000 * rep + p)))
                        refused = frozenset(m for m, r in engine.items() if r.error)
                        if cfg.vllm_python:
                            progress.step(f"repetition {rep + 1}/{cfg.repetitions}: the engine's rows", always=True,
                                          counts=False)
                        for method, result in run_engine(cfg, drafters, prompter, prompts, block, conc, setting, stops,
                                                         runs, rep, refused):
                            engine[method] = merge_engine(engine[method], result) if method in engine else result
                        if cfg.llama_cpp and conc == 1:
                            progress.step(f"repetition {rep + 1}/{cfg.repetitions}: llama.cpp's rows", always=True,
                                          counts=False)
                        for method, result in run_llama(cfg, drafters, target, prompter, prompts, block, conc, setting,
                                                        runs, rep, refused, exports):
                            engine[method] = engine[method] + result if method in engine else result
                    progress.close()
                    load = monitor.record()
                    tables.append(dict(dataset=dataset, block_size=block, concurrency=conc, setting=setting_name, **load))
                    rows += [dict(r, concurrency=conc, busy=load["busy"])
                             for r in summarize(runs, dataset, block, setting_name, setting, engine)]
                    # every finished table is on disk at once: an interrupted run keeps what it measured
                    write_outputs(cfg, rows, sources, dict(whole.record(), tables=tables),
                                  partial=(len(tables), n_tables))
    if cfg.servers:
        from dflash2.bench.server import run_servers

        for spec in cfg.servers.values():
            launch = spec.launch if isinstance(spec.launch, str) or not spec.launch else shlex.join(spec.launch)
            sources[f"server {spec.name}"] = f"{spec.url} ({spec.api} API" + (
                f", launched by the bench: `{launch}`)" if launch else ", already running)")

        ours = {(r["dataset"], r["concurrency"], r["setting"]): r for r in rows if r["method"] == "ar"}
        served = run_servers(cfg, prompter, sets, stops, tables, servers_cpu)
        for row in served:
            ar = ours.get((row["dataset"], row["concurrency"], row["setting"]))
            row["tokens_per_s_ratio"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        rows += served
        fastest_plain(rows)
    load = whole.record()
    if any(spec.launch for spec in cfg.servers.values()):
        # a launched server's start-up runs in processes that are gone before the run ends, so the whole
        # run's other_cpu cannot tell it from another process: the run is busy when one of its tables is
        load.update(busy=any(t["busy"] for t in tables), busy_judged_by="tables")
    write_outputs(cfg, rows, sources, dict(load, tables=tables))
    return rows


class Progress:
    """Where a long run is: on a terminal a bar whose label names the running row; off one (a log, a
    pipe) a line per step at most every `every` seconds, and always for the steps that can take long
    (warm-up: the first calls compile)."""

    def __init__(self, title: str, total: int, every: float = 10.0) -> None:
        self.title, self.total, self.every, self.done = title, total, every, 0
        self.start = self.last = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=title, leave=False)
        else:
            print(f"{title}: {total} runs", file=sys.stderr, flush=True)

    def step(self, what: str, always: bool = False, counts: bool = True) -> None:
        """Say that `what` starts now (the step before it has finished); `counts`: one of the total."""
        if self.bar is not None:
            self.bar.n = self.done
            self.bar.set_postfix_str(what)
        else:
            now = time.perf_counter()
            if always or now - self.last >= self.every:
                print(f"  [{now - self.start:6.0f} s, {self.done}/{self.total}] {what}", file=sys.stderr, flush=True)
                self.last = now
        self.done += counts

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(f"  [{time.perf_counter() - self.start:6.0f} s] {self.title}: done", file=sys.stderr, flush=True)
