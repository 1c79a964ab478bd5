"""A training run's configuration: `TrainConfig` (and its `data:` section, `DataConfig`), read from YAML
and dotted overrides, checked before anything loads; the data recipe (the fields that change the
regenerated data); the --dry-run plan."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2.decoding.checks import looks_like_hub_id
from dflash2.overrides import load_yaml_with_overrides
from dflash2.targets.gguf import SMOLLM2, is_gguf


@dataclass
class DataConfig:
    prompts: str = "random"  # fixed-length prompts: a .pt file holding a list of token-id lists, or "random"
    num_sequences: int = 64  # fixed-length prompts: how many
    prompt_tokens: int = 16  # fixed-length prompts: their length
    new_tokens: int = 48  # fixed-length prompts: exactly this many (past EOS); conversations: at most, per answer
    temperature: float = 0.0  # of the target when it regenerates the responses
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    cache: str | None = None  # the dataset directory (default <out>/data); runs can share it
    dataset: str | list[str] | None = None  # conversations (replaces `prompts`): .jsonl / .json / .parquet files or hub ids
    split: str = "train"  # of a hub dataset
    subset: str | None = None  # of a hub dataset (its config name)
    max_conversations: int | None = None  # the first N conversations (None: all)
    system_prompt: str | None = None  # for conversations without a system message
    enable_thinking: bool | None = None  # passed to the chat template when set (Qwen3-style thinking switch)
    tokenizer: str | None = None  # whose chat template renders the conversations (default: the target's)
    max_length: int = 4096  # conversations: a sequence is cut at this many tokens
    backend: str = "hf"  # who regenerates: "hf" (batched generate here), "static" (our plain decoding, continuous
    # batching over a StaticTarget: several times faster on CPU) or "vllm" (offline vLLM engine)
    regen_batch: int = 32  # hf: rows per generate call; static: rows in flight
    regen_linear_dtype: str | None = None  # static: the StaticTarget's products (e.g. "bfloat16"; None: the model's)
    shard_size: int = 256  # sequences per shard on disk (the unit of resumption)
    features: str | None = None  # a directory: the target's features cached once (dflash2.train.features); None: each step
    feature_linear_dtype: str | None = None  # the cached features' products (e.g. "bfloat16"; None: the model's)
    feature_dtype: str = "bfloat16"  # how the cached features are stored
    vllm_python: str | None = None  # vllm: the interpreter of a venv with vLLM (default: this one)
    tensor_parallel_size: int = 1  # vllm: GPUs per target

    def resolved_cache(self, out: Path) -> Path:
        """The dataset directory (an older config's `.pt` name means the directory without the suffix)."""
        if not self.cache:
            return out / "data"
        path = Path(self.cache)
        return path.with_suffix("") if path.suffix == ".pt" else path


@dataclass
class TrainConfig:
    target: str = ""  # HF causal LM directory or hub id
    out: str = "runs/drafter"
    init: str | None = None  # a drafter directory to start from (fine-tuning; it may have fewer layers); None: random
    drafter: dict[str, Any] = field(default_factory=dict)  # DFlash2Config fields
    draft_vocab: int | None = None  # the head drafts among the N most frequent label tokens of the data, trained over those
    data: DataConfig = field(default_factory=DataConfig)
    steps: int = 100
    batch_size: int = 8  # sequences per step, over all ranks
    grad_accum: int = 1  # micro-batches per step on each rank (the step's loss and gradient are unchanged)
    anchors_per_seq: int = 8
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    gamma: float | None = None  # position decay; None: 7 for B=16, 4 for B=8, B/2 otherwise
    soft_targets: bool = False
    selector_alpha: float = 0.1
    confidence_alpha: float = 0.1  # weight of the confidence head's loss (drafters with one: DSpark's)
    seed: int = 0
    ckpt_every: int = 50
    dtype: str = "float32"  # of the drafter's weights (and the target's, unless target_dtype is set)
    target_dtype: str | None = None  # of the frozen target (e.g. bfloat16 beside a float32 drafter)
    autocast: str = "auto"  # "auto": bfloat16 autocast on CUDA, none on CPU; "bf16"; "none"
    gradient_checkpointing: bool = False  # recompute each drafter layer in the backward pass
    parallel: str = "ddp"  # under torchrun: "ddp" (replicas) or "fsdp" (sharded parameters and optimizer)
    loss_chunk: int | None = None  # rows whose [rows, V] logits are alive at once in the loss (None: 2^24 / V)
    eval_every: int = 0  # steps between held-out τ estimates (0: none)
    eval_sequences: int = 0  # the last N sequences of the data, never trained on

    def __post_init__(self) -> None:
        if isinstance(self.data, dict):
            unknown = sorted(set(self.data) - {f.name for f in dataclasses.fields(DataConfig)})
            if unknown:
                raise ValueError(f"unknown data keys {unknown}; known: {sorted(f.name for f in dataclasses.fields(DataConfig))}")
            self.data = DataConfig(**self.data)
        # YAML 1.1 reads "6e-4" (no dot) as a string: accept it as the number it means
        for name in ("lr", "warmup_ratio", "weight_decay", "selector_alpha", "confidence_alpha", "gamma"):
            value = getattr(self, name)
            if value is not None:
                try:
                    setattr(self, name, float(value))
                except (TypeError, ValueError):
                    raise ValueError(f"{name} must be a number, got {value!r}") from None
        d = self.data
        d.temperature, d.top_p = float(d.temperature), float(d.top_p)
        if not self.target:
            raise ValueError("config needs `target`: an HF causal LM directory or hub id")
        for name in ("steps", "batch_size", "anchors_per_seq", "ckpt_every", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.loss_chunk is not None and self.loss_chunk < 1:
            raise ValueError(f"loss_chunk must be >= 1 or null, got {self.loss_chunk}")
        for name in ("eval_every", "eval_sequences"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        choices = dict(dtype=("float32", "float64", "bfloat16"), target_dtype=(None, "float32", "float64", "bfloat16"),
                       autocast=("auto", "bf16", "none"), parallel=("ddp", "fsdp"))
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if d.backend not in ("hf", "static", "vllm"):
            raise ValueError(f"data.backend must be 'hf', 'static' or 'vllm', got {d.backend!r}")
        if self.draft_vocab is not None and "draft_vocab_size" in self.drafter:
            raise ValueError("give the draft vocabulary as draft_vocab (its tokens are the data's most frequent), "
                             "not drafter.draft_vocab_size")
        if d.features is not None and self.soft_targets:
            raise ValueError("soft_targets needs the target's last hidden state, which the feature cache does not hold")
        if d.feature_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"data.feature_dtype must be float32, bfloat16 or float16, got {d.feature_dtype!r}")
        if d.regen_linear_dtype is not None and d.backend != "static":
            raise ValueError("data.regen_linear_dtype applies to the static backend only")
        for name in ("num_sequences", "prompt_tokens", "new_tokens", "regen_batch", "shard_size", "max_length",
                     "tensor_parallel_size"):
            if getattr(d, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(d, name)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_reference() -> str:
    """Every config key with its default and the comment beside its field, for --help."""
    import inspect
    import re

    def notes(cls) -> dict[str, str]:
        found = re.findall(r"^    (\w+): [^=\n]+=[^#\n]*#\s*(.+)$", inspect.getsource(cls), flags=re.M)
        return dict(found)

    lines = []
    for cls, prefix in ((TrainConfig, ""), (DataConfig, "data.")):
        comments = notes(cls)
        for f in dataclasses.fields(cls):
            if f.name != "data":
                note = comments.get(f.name, "")
                lines.append(f"  {prefix + f.name} = {_default(f)!r}" + (f"  ({note})" if note else ""))
    return "\n".join(lines)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# -- config files and overrides --------------------------------------------------------------------
def load_config(path: str | Path | None, overrides: list[str]) -> TrainConfig:
    raw = load_yaml_with_overrides(path, overrides)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; known: {sorted(known)}")
    return TrainConfig(**raw)


def data_recipe(cfg: TrainConfig) -> dict[str, Any]:
    """Every field that changes the regenerated data (checked when a dataset directory is reused)."""
    d = dataclasses.asdict(cfg.data)
    for name in ("cache", "vllm_python", "tensor_parallel_size", "features", "feature_linear_dtype", "feature_dtype"):
        d.pop(name)  # where and how, and the features (a recipe of their own)
    if d["regen_linear_dtype"] is None:  # the model's own arithmetic (the recipe as written before the field existed)
        d.pop("regen_linear_dtype")
    if cfg.data.dataset is None:  # fixed-length prompts: the conversation fields change nothing
        for name in ("dataset", "split", "subset", "max_conversations", "system_prompt", "enable_thinking",
                     "tokenizer", "max_length"):
            d.pop(name)
    else:
        for name in ("prompts", "num_sequences", "prompt_tokens"):
            d.pop(name)
    return dict(d, target=cfg.target, seed=cfg.seed)


def describe(cfg: TrainConfig) -> str:
    """What a run of `cfg` would do (the --dry-run output): the checks that need no model, and the plan."""
    from dflash2.config import DFlash2Config

    named = str(cfg.target) == SMOLLM2 or (is_gguf(cfg.target) and Path(cfg.target).is_file())  # resolved when loaded
    if not Path(cfg.target).is_dir() and not looks_like_hub_id(cfg.target) and not named:
        raise FileNotFoundError(f"no such target directory: {cfg.target}")
    unknown = sorted(set(cfg.drafter) - {f.name for f in dataclasses.fields(DFlash2Config)})
    if unknown:
        raise ValueError(f"unknown drafter keys {unknown} (DFlash2Config fields)")
    out, d = Path(cfg.out), cfg.data
    data = d.resolved_cache(out)
    if d.dataset is not None:
        source = f"the conversations of {d.dataset}, answers regenerated by the target (at most {d.new_tokens} tokens each)"
    else:
        source = (f"{d.num_sequences} sequences of {d.prompt_tokens} prompt tokens ({d.prompts}) + {d.new_tokens} "
                  f"tokens regenerated by the target")
    state = "present: reused (a partial one resumes)" if data.is_dir() else "absent: regenerated before the first step"
    resume = " (resumes its checkpoint)" if (out / "ckpt.pt").is_file() else ""
    return "\n".join([
        f"dry run: the config is valid; a run would write {out}{resume}",
        f"  target {cfg.target}; drafter {cfg.drafter or 'defaults'}",
        f"  data {data}: {state}; {source} (backend {d.backend})",
        *([] if d.features is None else [
            f"  features {d.features}: " + ("present: reused (a partial one resumes)" if Path(d.features).is_dir() else
                                            "absent: the target's, computed once before the first step")]),
        f"  {cfg.steps} steps of {cfg.batch_size} sequences × {cfg.anchors_per_seq} anchors, lr {cfg.lr}, "
        f"checkpoint every {cfg.ckpt_every} steps; the drafter lands in {out / 'final'}"])
