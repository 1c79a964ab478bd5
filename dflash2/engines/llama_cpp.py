"""llama.cpp as a peer: its server on the same weights, and with DFlash the same drafter, converted by
its own script.

`llama_dir` holds `src/` (the source tree, with `convert_hf_to_gguf.py`) and `build/bin/` (docs/engines.md);
dflash2 never links it, it starts `llama-server` and talks to it over HTTP on localhost.

    target = convert_model(llama_dir, hf_dir, "target-bf16.gguf", "bf16")
    drafter = convert_drafter(llama_dir, reference_dir, hf_dir, "drafter.gguf")   # save_pretrained(format="reference")
    with LlamaServer(llama_dir, target, drafter=drafter, draft_max=15) as server:
        out = server.complete(prompt_ids, max_new_tokens=128)   # tokens, seconds, verify passes

`LlamaCompletion.tokens` are the ids generated after the prompt, the first from its prefill; `drafts`
counts its verification passes and `accepted` the drafted tokens they kept, so 1 + accepted / drafts
is the same quantity as our τ over rounds. Its timings are its own (`predicted_ms`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LlamaCompletion:
    tokens: list[int]  # generated ids, prompt excluded
    seconds: float  # wall-clock of the request, as a client sees it (prompt processing included)
    prompt_ms: float  # the server's own timings
    predicted_ms: float
    drafts: int = 0  # verification passes that checked a draft
    accepted: int = 0  # drafted tokens those passes kept
    drafted: int = 0  # drafted tokens in all

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def binary(llama_dir: str | Path, name: str) -> Path:
    path = Path(llama_dir).expanduser() / "build" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: build llama.cpp's tools as docs/engines.md says")
    return path


def _convert(llama_dir: str | Path, source: Path, out: Path, outtype: str, extra: list[str],
             wrapper: str | None = None) -> Path:
    out = Path(out)
    if out.is_file():
        return out
    script = Path(llama_dir).expanduser() / "src" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} does not exist: llama_dir must hold llama.cpp's source tree as src/")
    tmp = out.with_name(out.name + ".tmp")
    env = dict(os.environ, PYTHONPATH=str(script.parent / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = [str(script)] if wrapper is None else ["-c", wrapper, str(script.parent)]
    proc = subprocess.run([sys.executable, *run, str(source), "--outfile", str(tmp), "--outtype", outtype, *extra],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {source}:\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def convert_model(llama_dir: str | Path, hf_dir: str | Path, out: str | Path, outtype: str = "bf16") -> Path:
    """An HF model directory as a GGUF of `outtype` (f32, f16, bf16, q8_0), by llama.cpp's own converter."""
    return _convert(llama_dir, Path(hf_dir), Path(out), outtype, [])


def convert_drafter(llama_dir: str | Path, reference_dir: str | Path, target_dir: str | Path, out: str | Path,
                    outtype: str = "f32") -> Path:
    """A drafter saved in the published layout (`save_pretrained(format="reference")`) as a GGUF,
    with the target's tokenizer (`--target-model-dir`), by llama.cpp's own converter. A draft vocabulary
    (`d2t`): llama.cpp's runtime reads it for every DFlash drafter, its converter writes it for DSpark
    only; `D2T_CONVERTER` runs the same converter with DSpark's d2t handling given to DFlash 2 as well."""
    meta = json.loads((Path(reference_dir) / "config.json").read_text())
    wrapper = D2T_CONVERTER if meta.get("draft_vocab_size") not in (None, meta.get("vocab_size")) else None
    return _convert(llama_dir, Path(reference_dir), Path(out), outtype, ["--target-model-dir", str(target_dir)],
                    wrapper)


# llama.cpp's convert_hf_to_gguf.py with DFlash2DraftModel taking a `d2t` tensor as its DSparkModel does:
# held (not mapped), then written as the absolute target ids the runtime reads (src/models/dflash.cpp)
D2T_CONVERTER = """
import sys
import numpy as np
import torch
sys.path.insert(0, sys.argv.pop(1))
import convert_hf_to_gguf as c
import gguf
from conversion.base import LazyTorchTensor, ModelBase
from conversion.qwen import DFlashModel


@ModelBase.register("DFlash2DraftModel", "DFlashDraftModel")
class DFlashWithD2T(DFlashModel):
    model_arch = DFlashModel.model_arch

    def modify_tensors(self, data_torch, name, bid):
        if name in ("d2t", "model.d2t"):
            self._d2t = data_torch
            return
        yield from super().modify_tensors(data_torch, name, bid)

    def prepare_tensors(self):
        super().prepare_tensors()
        d2t = LazyTorchTensor.to_eager(self._d2t).to(torch.int64).cpu().numpy().reshape(-1)
        ids = d2t + np.arange(d2t.size, dtype=np.int64)
        if d2t.size != self.hparams["draft_vocab_size"] or len(np.unique(ids)) != ids.size or ids.min() < 0 \
                or ids.max() >= self.hparams["vocab_size"]:
            raise ValueError("d2t does not give draft_vocab_size distinct target token ids")
        self.gguf_writer.add_tensor("d2t", ids, raw_dtype=gguf.GGMLQuantizationType.I64)


c.main()
"""


class LlamaServer:
    """`llama-server` for one model (and drafter) on a free localhost port, one slot, started on enter
    and stopped on exit; `log` holds its output (where it explains a refusal)."""

    def __init__(self, llama_dir: str | Path, model: str | Path, *, drafter: str | Path | None = None,
                 draft_max: int = 15, threads: int | None = None, context: int = 4096, extra: list[str] = ()) -> None:
        self.port = _free_port()
        threads = threads or len(os.sched_getaffinity(0))
        self.argv = [str(binary(llama_dir, "llama-server")), "-m", str(model), "--port", str(self.port), "--host",
                     "127.0.0.1", "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1", "--metrics",
                     "--no-webui", *extra]
        if drafter is not None:
            self.argv += ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_max),
                          "-td", str(threads), "-tbd", str(threads)]
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def __enter__(self) -> "LlamaServer":
        import tempfile

        handle, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log_path = Path(name)
        self.proc = subprocess.Popen(self.argv, stdout=handle, stderr=subprocess.STDOUT)
        os.close(handle)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log[-3000:]}")
            try:
                if json.loads(self._get("/health")).get("status") == "ok":
                    return self
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                pass
            time.sleep(0.3)
        self.__exit__()
        raise TimeoutError(f"llama-server did not come up in 300 s:\n{self.log[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._final_log = self.log  # kept in memory; the file goes
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    @property
    def log(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return getattr(self, "_final_log", "")
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True) -> LlamaCompletion:
        """One request: the prompt's ids continued by at most max_new_tokens ids (fewer at an end-of-generation
        token, unless stop_at_eos is False), sampled as ours samples (no penalties, no min-p)."""
        before = self.counters()
        body = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": temperature, "top_k": top_k,
                "top_p": top_p, "min_p": 0.0, "seed": seed, "cache_prompt": False, "return_tokens": True,
                "ignore_eos": not stop_at_eos, "samplers": ["top_k", "top_p", "temperature"]}
        t0 = time.perf_counter()
        answer = json.loads(self._post("/completion", body))
        seconds = time.perf_counter() - t0
        after = self.counters()
        timings = answer.get("timings", {})
        delta = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
        return LlamaCompletion(answer["tokens"], seconds, timings.get("prompt_ms", 0.0), timings.get("predicted_ms", 0.0),
                               delta.get("spec_decode_num_drafts_total", 0),
                               delta.get("spec_decode_num_accepted_tokens_total", 0),
                               delta.get("spec_decode_num_draft_tokens_total", 0))

    def counters(self) -> dict[str, float]:
        """The server's Prometheus counters (llamacpp:NAME → value), without the prefix."""
        out = {}
        for line in self._get("/metrics").splitlines():
            if line.startswith("llamacpp:"):
                name, value = line.split()[:2]
                out[name.removeprefix("llamacpp:")] = float(value)
        return out

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            return r.read().decode()

    def _post(self, path: str, body: dict) -> str:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as r:
            return r.read().decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
