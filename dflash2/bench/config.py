"""The bench's configuration: `BenchConfig` (every key of a bench YAML or key=value override), the
sampling settings, the dtypes, and what the machine's CPU can do."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from dflash2.bench.prompts import NAMES, SUITES

SETTINGS = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
            "sampling": dict(temperature=1.0, top_k=20, top_p=0.95),  # the model cards' (Qwen3)
            "t1": dict(temperature=1.0, top_k=0, top_p=1.0)}  # the target's own distribution, untruncated

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DTYPE_SUFFIX = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}  # of method names (Method.name)

TARGET_STEPS = ("hf", "static", "static_bf16mm")
STEP_SUFFIX = {"hf": "", "static": "_static", "static_bf16mm": "_static_bf16mm"}  # of method names

HF_BASELINES = ("hf_prompt_lookup", "hf_assisted")  # HF's speculative decoding: the drafters to beat

ALL_METHODS = ("ar", "hf_generate", "hf_prompt_lookup", "hf_assisted", "dflash1", "dflash2_walk", "dflash2_viterbi",
               "dflash2_argmax", "dflash2_tree", "dflash2_goodput", "dflash2_goodput_tree")

VLLM_METHODS = ("vllm_ar", "vllm_dflash1", "vllm_dflash2")  # with vllm_python: the engine, in its own venv
LLAMA_METHODS = ("llama_ar", "llama_dflash1", "llama_dflash2")  # with llama_cpp: llama-server (dflash2.bench.llama)
# the llama rows' weights: a type llama.cpp's converter writes, or "gguf" (the target's own GGUF file)
LLAMA_WEIGHTS = ("f32", "bf16", "f16", "q8_0", "gguf")



APIS = ("openai", "sglang")
LOCAL_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class ServerSpec:
    name: str
    url: str  # the base address, e.g. http://127.0.0.1:8000
    launch: str | list[str] | None = None  # a command the bench starts and stops (the server on 127.0.0.1)
    env: dict[str, str] | None = None  # extra environment of the launched command (OMP_NUM_THREADS, ...)
    api: str = "openai"  # openai: /v1/completions (vLLM, SGLang); sglang: SGLang's /generate
    model: str | None = None  # the served model name of a request; default: the first of /v1/models
    block_size: int | None = None  # the server's draft block (num_speculative_tokens + 1); None: no drafter
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0

    @classmethod
    def parse(cls, name: str, spec: Any) -> ServerSpec:
        if isinstance(spec, ServerSpec):
            return spec
        if isinstance(spec, str):
            spec = {"url": spec}
        if not isinstance(spec, dict) or "url" not in spec:
            raise ValueError(f"servers.{name} must be a URL or a mapping with a url (and launch, api, model, "
                             f"block_size), got {spec!r}")
        known = {f.name for f in fields(cls)} - {"name"}
        bad = sorted(set(spec) - known)
        if bad:
            raise ValueError(f"servers.{name}: unknown keys {bad}; known: {sorted(known)}")
        out = cls(name=name, **spec)
        address = urllib.parse.urlparse(out.url)
        if address.scheme not in ("http", "https") or not address.hostname:
            raise ValueError(f"servers.{name}.url must be an http(s) address, got {out.url!r}")
        if out.launch is not None and address.hostname not in LOCAL_HOSTS:
            raise ValueError(f"servers.{name}: a server the bench launches must listen on 127.0.0.1 or "
                             f"localhost, not {address.hostname}")
        if out.api not in APIS:
            raise ValueError(f"servers.{name}.api must be one of {list(APIS)}, got {out.api!r}")
        if out.block_size is not None and (not isinstance(out.block_size, int) or out.block_size < 2):
            raise ValueError(f"servers.{name}.block_size must be an integer >= 2 (or absent: no drafter)")
        return out


@dataclass
class BenchConfig:
    target: str = "embedded"  # an HF directory / hub id, or "embedded"
    tokenizer: str | None = None  # default: the target's
    device: str = "cpu"  # where the target and drafters run: cpu, cuda, cuda:1, ...
    target_dtype: str = "float32"  # of the target (bfloat16 on a GPU: the dtype the cards serve in)
    drafters: dict[str, str] = field(default_factory=lambda: {"dflash1": "embedded:dflash1",
                                                               "dflash2": "embedded:dflash2"})
    ar_draft: str | None = "embedded:ar_draft"
    datasets: list[str] = field(default_factory=lambda: ["humaneval", "stdlib_heldout"])
    # name → a local .jsonl of {"turns": [...]} rows, used as written (the reference benchmark's cache
    # format); any name, so dataset_files.gsm8k=PATH replaces the hub download (dflash2/bench/prompts.py)
    dataset_files: dict[str, str] = field(default_factory=dict)
    # "auto": the suites (gsm8k, math500, humaneval-instruct, mbpp, mt-bench, alpaca, local files) go
    # through the target's chat template, the raw sets (humaneval, stdlib_heldout) do not; true / false: all
    chat_template: bool | str = "auto"
    enable_thinking: bool | None = None  # passed to the chat template when set (the cards: thinking on)
    # name → {url: http://127.0.0.1:PORT, launch: "command" (optional: started and stopped by the bench),
    # api: openai | sglang, block_size: the server's draft block (None: plain decoding)}: server mode
    # (dflash2/bench/server.py), the same suites sent to an OpenAI-compatible endpoint
    servers: dict[str, dict] = field(default_factory=dict)
    server_concurrency: list[int] | None = None  # the servers' concurrency levels (default: `concurrency`)
    num_prompts: int = 40
    max_new_tokens: int = 128
    block_sizes: list[int] = field(default_factory=lambda: [8, 16])
    settings: list[str] = field(default_factory=lambda: ["greedy", "sampling"])
    methods: list[str] = field(default_factory=lambda: list(ALL_METHODS))
    tree_nodes: list[int] = field(default_factory=lambda: [32])
    draft_lens: list[int] = field(default_factory=list)  # extra dflash2_walk_L<n> rows
    draft_vocabs: list[int] = field(default_factory=list)  # extra dflash2_walk_V<n>, dflash2_tree<M>_V<n> rows
    token_counts: str = "embedded"  # ranks the draft vocabularies: "embedded" or a draft_vocab.save_counts file
    # Also run the walk and tree rows (and their _V<n> rows) with the drafter's round compiled
    # (DFlash2Drafter.compile: each round's drafting as one graph, torch.compile with dynamic shapes;
    # names end in _compiled), at every concurrency; the target's step is chosen by target_steps.
    compile_drafters: bool = False
    # StaticTarget steps compiled (torch.compile): minutes of warm-up a target; false runs them eager
    compile_target: bool = True
    concurrency: list[int] = field(default_factory=lambda: [1])
    # Each dtype runs every drafter method (suffix _bf16 / _fp16 after float32's plain name); the target
    # stays float32, so what is committed never changes, only how fast drafts come and how often they pass.
    drafter_dtypes: list[str] = field(default_factory=lambda: ["float32"])
    repetitions: int = 3
    # The python of a venv with vLLM: adds the vllm_* rows (the engine in a subprocess; never imported here),
    # once per dtype in vllm_dtypes (float32 as our target; bfloat16 rows end in _bf16).
    vllm_python: str | None = None
    vllm_dtypes: list[str] = field(default_factory=lambda: ["float32"])
    # A llama.cpp build (docs/engines.md: its src/ and build/bin/): adds the llama_* rows, llama-server on the
    # target's weights converted by llama.cpp's own script, once per type in llama_weights ("gguf": the target's
    # own file, e.g. SmolLM2's shipped Q4_1), and with our drafters; at batch 1 (dflash2/bench/llama.py).
    llama_cpp: str | None = None
    llama_weights: list[str] = field(default_factory=lambda: ["bf16"])
    # How our loop runs the target: "hf" (TargetAdapter: the model's forward), "static" (StaticTarget: its
    # layers written out over a preallocated cache, compiled; rows end in _static) and/or
    # "static_bf16mm" (the same with bfloat16 matrix products, StaticTarget(linear_dtype="bfloat16"): another
    # arithmetic than the model's, lossless with respect to itself; rows end in _static_bf16mm).
    target_steps: list[str] = field(default_factory=lambda: ["hf"])
    seed: int = 0
    out: str | None = None  # None: runs/bench/<the config file's name> (outside the tracked tree)
    quick: bool = False

    def __post_init__(self) -> None:
        self.out = self.out or "runs/bench/default"
        self.drafter_dtypes = [resolve_dtype(d) for d in self.drafter_dtypes]
        if self.target_dtype not in DTYPES:
            raise ValueError(f"target_dtype must be one of {list(DTYPES)}, got {self.target_dtype!r}")
        if self.device != "cpu" and self.quick:
            raise ValueError("--quick runs on the CPU")
        bad = sorted(set(self.methods) - set(ALL_METHODS) - set(VLLM_METHODS) - set(LLAMA_METHODS))
        if bad:
            raise ValueError(f"unknown methods {bad}; known: {list(ALL_METHODS + VLLM_METHODS + LLAMA_METHODS)}")
        bad = sorted(set(self.target_steps) - set(TARGET_STEPS))
        if bad or not self.target_steps:
            raise ValueError(f"target_steps must be among {list(TARGET_STEPS)}, got {self.target_steps}")
        bad = sorted(set(self.vllm_dtypes) - {"float32", "bfloat16"})
        if bad or not self.vllm_dtypes:
            raise ValueError(f"vllm_dtypes must be among ['float32', 'bfloat16'], got {self.vllm_dtypes}")
        if self.vllm_python is not None:
            if not Path(self.vllm_python).is_file():
                raise ValueError(f"vllm_python {self.vllm_python!r} is not a file (the python of a venv with vLLM)")
            if self.quick:
                raise ValueError("vllm_python needs a real target directory; --quick runs random in-memory models")
            if not set(self.methods) & set(VLLM_METHODS):  # naming none of them asks for all of them
                self.methods = [*self.methods, *VLLM_METHODS]
        elif set(self.methods) & set(VLLM_METHODS):
            raise ValueError(f"methods {sorted(set(self.methods) & set(VLLM_METHODS))} need vllm_python "
                             "(the python of a venv with vLLM)")
        bad = sorted(set(self.llama_weights) - set(LLAMA_WEIGHTS))
        if bad or not self.llama_weights:
            raise ValueError(f"llama_weights must be among {list(LLAMA_WEIGHTS)}, got {self.llama_weights}")
        if self.llama_cpp is not None:
            if not (Path(self.llama_cpp).expanduser() / "build" / "bin" / "llama-server").is_file():
                raise ValueError(f"llama_cpp {self.llama_cpp!r} holds no build/bin/llama-server (docs/engines.md)")
            if self.quick:
                raise ValueError("llama_cpp needs a real target; --quick runs random in-memory models")
            if "gguf" in self.llama_weights and not (self.target == "smollm2" or self.target.endswith(".gguf")):
                raise ValueError("llama_weights 'gguf' is the target's own GGUF file: the target must be smollm2 or a .gguf")
            if not set(self.methods) & set(LLAMA_METHODS):  # naming none of them asks for all of them
                self.methods = [*self.methods, *LLAMA_METHODS]
        elif set(self.methods) & set(LLAMA_METHODS):
            raise ValueError(f"methods {sorted(set(self.methods) & set(LLAMA_METHODS))} need llama_cpp (a llama.cpp build)")
        if self.chat_template not in ("auto", True, False):
            raise ValueError(f"chat_template must be auto, true or false, got {self.chat_template!r}")
        bad = sorted(set(self.datasets) - set(NAMES) - set(SUITES) - set(self.dataset_files))
        if bad:
            raise ValueError(f"unknown datasets {bad}; known: {[*NAMES, *SUITES]}, or any name given a local "
                             "file in dataset_files")
        bad = sorted(set(self.dataset_files) - set(self.datasets))
        if bad:
            raise ValueError(f"dataset_files names {bad}, which are not in datasets {self.datasets}")
        self.servers = {name: ServerSpec.parse(name, spec) for name, spec in self.servers.items()}
        if self.server_concurrency is not None and any(not isinstance(c, int) or c < 1 for c in self.server_concurrency):
            raise ValueError(f"server_concurrency must be positive integers, got {self.server_concurrency}")
        if self.servers and self.quick:
            raise ValueError("servers need a real target directory; --quick runs random in-memory models")
        bad = sorted(set(self.settings) - set(SETTINGS))
        if bad:
            raise ValueError(f"unknown settings {bad}; known: {list(SETTINGS)}")
        if any(not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be positive integers, got {self.concurrency}")
        if any(not isinstance(m, int) or m < 1 for m in self.tree_nodes):
            raise ValueError(f"tree_nodes must be positive integers, got {self.tree_nodes}")
        bad = [d for d in self.drafter_dtypes if d not in DTYPES]
        if bad or not self.drafter_dtypes or len(set(self.drafter_dtypes)) != len(self.drafter_dtypes):
            raise ValueError(f"drafter_dtypes must be distinct names among {[*DTYPES, 'auto']}, "
                             f"got {self.drafter_dtypes} (auto resolved)")
        if any(not isinstance(n, int) or n < 1 for n in self.draft_lens):
            raise ValueError(f"draft_lens must be positive integers, got {self.draft_lens}")
        if any(not isinstance(n, int) or n < 1 for n in self.draft_vocabs):
            raise ValueError(f"draft_vocabs must be positive integers, got {self.draft_vocabs}")
        if self.draft_vocabs and self.token_counts != "embedded" and not Path(self.token_counts).is_file():
            raise ValueError(f"token_counts {self.token_counts!r} is neither 'embedded' nor a file")


def num_tables(cfg: "BenchConfig") -> int:
    """How many tables a run of `cfg` measures: one per dataset, block size, concurrency and setting."""
    return len(cfg.datasets) * len(cfg.block_sizes) * len(cfg.concurrency) * len(cfg.settings)


def native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively (oneDNN's bfloat16 kernels: AVX512-BF16, AMX)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check is not None and check())
    except RuntimeError:
        return False


def resolve_dtype(name: str) -> str:
    """A drafter dtype name, with "auto" → bfloat16 where it is native (CUDA, or a CPU with bfloat16
    matmuls), float32 elsewhere."""
    if name != "auto":
        return name
    return "bfloat16" if torch.cuda.is_available() or native_bf16() else "float32"


def cpu_description() -> str:
    """The CPU as the benchmark tables need it: vector extension, bfloat16 support, threads."""
    bf16 = "native bfloat16" if native_bf16() else "no native bfloat16"
    return f"CPU {torch.backends.cpu.get_cpu_capability()}, {bf16}, {torch.get_num_threads()} threads"

