"""`python -m dflash2.train --config configs/<file>.yaml [dotted.key=value ...]`: train a drafter.

The recipe (docs/training.md): the target (frozen, with its embedding and LM head) regenerates the
responses (`dflash2.train.data`: fixed-length prompts, or chat conversations from a dataset; an `hf`
or a `vllm` backend; a sharded Arrow dataset on disk); each step samples random anchors per sequence
(only where the next token is a label: a regenerated token) and trains all blocks of a sequence in
one masked forward pass (`dflash2.train.forward`); position-decay weights, optional soft targets, the
teacher-forced selector loss, all computed in chunks of rows, so that no [anchors, block, vocabulary]
tensor is ever whole.

Resumable: every `ckpt_every` steps the drafter, optimizer and step are written atomically to
`<out>/ckpt.pt` with the resolved config beside it. Batches and anchors are functions of
(seed, step, rank), so a run killed at any moment and restarted ends bit-identical to one that was
never interrupted; the data regeneration resumes at its first missing shard. SIGINT or SIGTERM
during training writes a checkpoint of the last finished step and exits 130 / 143 with one line.
Under `torchrun --nproc-per-node N` it trains with DistributedDataParallel (`parallel: ddp`) or
FSDP (`parallel: fsdp`: parameters, gradients and optimizer state sharded; gloo on CPU, nccl on
CUDA); every rank sees its own shard of each batch. `--export DIR` writes the last checkpoint as a
drafter directory (evaluate a long run while it trains).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dflash2.targets.gguf import SMOLLM2, is_gguf, resolve_target
from dflash2.decoding.checks import from_pretrained, looks_like_hub_id
from dflash2.train.checkpoint import load_checkpoint, save_checkpoint
from dflash2.drafter.model import DFlash2Drafter
from dflash2.overrides import load_yaml_with_overrides
from dflash2.targets.adapter import TargetAdapter
from dflash2.train.forward import (Losses, accepted_lengths, drafter_losses, expected_tau_from_accuracy, label_weights,
                       masked_block_forward, position_weights, sample_masked_anchors)


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


def _rank() -> int:
    """This process's rank under torchrun or --nproc-per-node (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- config files and overrides --------------------------------------------------------------------
def load_config(path: str | Path | None, overrides: list[str]) -> TrainConfig:
    raw = load_yaml_with_overrides(path, overrides)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; known: {sorted(known)}")
    return TrainConfig(**raw)


# -- data: responses regenerated by the target -------------------------------------------------------
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


def fixed_prompts(cfg: TrainConfig, vocab: int) -> list[list[int]]:
    d = cfg.data
    g = torch.Generator().manual_seed(cfg.seed)
    if d.prompts == "random":
        return torch.randint(0, vocab, (d.num_sequences, d.prompt_tokens), generator=g).tolist()
    if not Path(d.prompts).is_file():
        build = " (python experiments/embedded/build_prompts.py writes it)" if "embedded" in d.prompts else ""
        raise FileNotFoundError(f"no such prompts file: {d.prompts}{build}")
    pool = [p for p in torch.load(d.prompts) if len(p) >= d.prompt_tokens]
    if not pool:
        raise ValueError(f"{d.prompts} holds no prompt of at least {d.prompt_tokens} tokens")
    pick = torch.randint(0, len(pool), (d.num_sequences,), generator=g).tolist()
    return [list(pool[i][: d.prompt_tokens]) for i in pick]


def regenerate(cfg: TrainConfig, target, directory: Path, backend=None, log=_stderr) -> Path:
    """Write the run's dataset directory (see `dflash2.train.data`); returns it. Resumes a partial one."""
    from tqdm import tqdm

    from dflash2.train import data as td

    d = cfg.data
    eos = target.generation_config.eos_token_id if target.generation_config is not None else None
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids and target.config.eos_token_id is not None:
        eos_ids = [target.config.eos_token_id]
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else (eos_ids or [0])[0]
    sampling = td.Sampling(d.new_tokens, d.temperature, d.top_p, d.top_k, stop_at_eos=d.dataset is not None)
    tokenizer = None
    if d.dataset is not None:
        from transformers import AutoTokenizer

        source = d.tokenizer or resolve_target(cfg.target)
        tokenizer = from_pretrained(AutoTokenizer.from_pretrained, source)
        td.check_chat_template(tokenizer, source)
        jobs: list = td.load_conversations(d.dataset, d.split, d.subset, d.max_conversations, d.system_prompt)
        if not eos_ids and tokenizer.eos_token_id is not None:
            eos_ids = [tokenizer.eos_token_id]
    else:
        jobs = fixed_prompts(cfg, target.get_input_embeddings().weight.shape[0])
    if backend is None:
        if d.backend == "vllm":
            longest = d.max_length if d.dataset is not None else d.prompt_tokens + d.new_tokens
            limit = getattr(target.config.get_text_config(), "max_position_embeddings", None) or longest
            backend = td.VLLMBackend(d.vllm_python or sys.executable, cfg.target, d.tokenizer, eos_ids,
                                     cfg.target_dtype or cfg.dtype,
                                     min(longest, limit), d.tensor_parallel_size)
        elif d.backend == "static":
            backend = td.StaticBackend(target, eos_ids, d.regen_batch, d.regen_linear_dtype)
        else:
            backend = td.HFBackend(target, eos_ids, pad_id, d.regen_batch)
    what = f"{len(jobs)} conversations of {d.dataset}" if d.dataset else f"{len(jobs)} prompts"
    log(f"data: regenerating {what} with the {d.backend} backend into {directory}")
    answers = [len(c.turns) for c in jobs] if d.dataset is not None else [1] * len(jobs)  # generate calls' rows
    bar = tqdm(total=sum(answers), desc="data", unit="answer", file=sys.stderr)
    backend.progress = bar.update

    def make_shard(i: int, shard: list):
        seed = cfg.seed * 1_000_003 + i  # this shard's draws, whatever ran before
        if d.dataset is not None:
            out = td.chat_shard(backend, tokenizer, shard, sampling, seed, d.max_length, d.enable_thinking)
        else:
            out = td.fixed_shard(backend, shard, d.new_tokens, sampling, seed)
        bar.n = sum(answers[: (i + 1) * d.shard_size])  # exact at every shard, whatever the backend reported
        bar.refresh()
        return out

    recipe = data_recipe(cfg)
    stored = directory / "recipe.json"
    same = stored.is_file() and json.loads(stored.read_text()) == json.loads(json.dumps(recipe))  # else build starts over
    done_before = sum(1 for p in directory.glob("shard_*") if p.is_dir()) if same else 0
    if done_before and not (directory / "complete.json").is_file():
        bar.update(sum(answers[: done_before * d.shard_size]))
        log(f"data: resuming after {done_before} written shards")
    try:
        return td.build(directory, recipe, jobs, d.shard_size, make_shard)
    finally:
        bar.close()


# -- one training step ---------------------------------------------------------------------------------
class TrainStep(nn.Module):
    """Wraps the drafter so that DDP / FSDP see every trainable parameter used inside one forward."""

    def __init__(self, drafter: DFlash2Drafter, target: TargetAdapter, cfg: TrainConfig) -> None:
        super().__init__()
        self.drafter, self.cfg = drafter, cfg
        self._target = target  # not a module: the target is frozen and never synchronised

    def forward(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                label_mask: torch.Tensor, last_hidden: torch.Tensor | None,
                denominators: tuple[float, float] | None = None) -> Losses:
        out = masked_block_forward(self.drafter, self._target, ids, features, anchors, label_mask=label_mask,
                                   valid=valid, logits=False)
        t_hidden = None
        if last_hidden is not None:  # the target's final hidden state where it predicts each label
            N, A, L = out.labels.shape
            pos = (anchors[:, :, None] + torch.arange(L, device=ids.device)).reshape(N, -1)  # predicts pos + 1
            t_hidden = last_hidden.gather(1, pos[..., None].expand(-1, -1, last_hidden.shape[-1])).view(N, A, L, -1)
        return drafter_losses(self.drafter, self._target, out, gamma=self.cfg.gamma, target_hidden=t_hidden,
                              selector_alpha=self.cfg.selector_alpha, confidence_alpha=self.cfg.confidence_alpha,
                              denominators=denominators,
                              chunk=self.cfg.loss_chunk)


    @torch.no_grad()
    def accepted(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 label_mask: torch.Tensor) -> torch.Tensor:
        """[N, A] tokens a greedy verifier would accept per block (see `accepted_lengths`)."""
        out = masked_block_forward(self.drafter, self._target, ids, features, anchors, label_mask=label_mask,
                                   valid=valid, logits=False)
        vocab = self.drafter.draft_vocab  # None: every token id
        top = self.drafter.draft_logits(out.hidden, self._target, vocab).argmax(-1)
        top1 = (top if vocab is None else vocab[top]) == out.labels
        return accepted_lengths(top1, out.weights)


def lr_at(step: int, cfg: TrainConfig) -> float:
    warmup = max(1, round(cfg.warmup_ratio * cfg.steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def batch_indices(step: int, cfg: TrainConfig, num_sequences: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share of the sequences of a step; epochs are seeded permutations."""
    per_step = cfg.batch_size
    start = step * per_step
    epoch, offset = divmod(start, num_sequences)
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
    if offset + per_step > num_sequences:  # wrap into the next epoch
        nxt = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch + 1))
        order = torch.cat([order, nxt])
    chosen = order[offset: offset + per_step]
    return chosen[rank::world]


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


# -- the run ------------------------------------------------------------------------------------------
class Run:
    """Everything one training process holds: the models, the optimizer, the data, and its place."""

    def __init__(self, cfg: TrainConfig, log=_stderr) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg, self.log = cfg, log
        self.world, self.rank = _world(), _rank()
        self.distributed = self.world > 1
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size {cfg.batch_size} is not divisible by the {self.world} processes")
        if (cfg.batch_size // self.world) % cfg.grad_accum:
            raise ValueError(f"the {cfg.batch_size // self.world} sequences per process and step do not split "
                             f"into grad_accum={cfg.grad_accum} micro-batches")
        self.out = Path(cfg.out)
        target = resolve_target(cfg.target)  # "smollm2" and .gguf files: their dequantized directory
        if not Path(target).is_dir() and not looks_like_hub_id(target):
            raise FileNotFoundError(f"no such target directory: {cfg.target}")
        self.target = from_pretrained(AutoModelForCausalLM.from_pretrained, target,
                                      dtype=getattr(torch, cfg.target_dtype or cfg.dtype))
        self.target = self.target.to(self.device).eval()
        self.target.requires_grad_(False)
        torch.manual_seed(cfg.seed)  # identical initial drafter on every rank
        drafter = DFlash2Drafter.from_target(self.target, **cfg.drafter, draft_vocab_size=cfg.draft_vocab)
        drafter = drafter.to(getattr(torch, cfg.dtype)).train()  # (the draft vocabulary's ids: load_data)
        if cfg.init:  # a fine-tune continues the given drafter (optimiser fresh); only depth may grow
            drafter.load_state_dict(_init_state(cfg.init, drafter))
        drafter.backbone.gradient_checkpointing = cfg.gradient_checkpointing
        self.drafter = drafter
        B = drafter.config.block_size
        if cfg.gamma is None:
            cfg.gamma = {16: 7.0, 8: 4.0}.get(B, B / 2)
        check_resume(self.out, cfg)  # before minutes of data regeneration, once the config is fully resolved
        self.adapter = TargetAdapter(self.target, drafter.target_layer_ids)
        self.step_module: nn.Module = TrainStep(drafter, self.adapter, cfg)
        if self.distributed and cfg.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

            for layer in drafter.backbone.layers:  # one group per layer; its K/V projection of the context
                fully_shard(layer.self_attn)       # runs outside the layer's forward, so it is one too
                register_fsdp_forward_method(layer.self_attn, "project_kv")
                fully_shard(layer)
            fully_shard(self.step_module)
            register_fsdp_forward_method(self.step_module, "accepted")
        elif self.distributed:
            unused = cfg.selector_alpha == 0 and drafter.config.selector != "argmax"
            self.step_module = nn.parallel.DistributedDataParallel(self.step_module, find_unused_parameters=unused)
        self.trainable = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        use_bf16 = cfg.autocast == "bf16" or (cfg.autocast == "auto" and self.device.type == "cuda")
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext())

    # -- data --------------------------------------------------------------------------------------
    def load_data(self) -> None:
        from dflash2.train.data import SequenceData

        directory = self.cfg.data.resolved_cache(self.out)
        if self.rank == 0 and not (directory / "complete.json").is_file():
            self.out.mkdir(parents=True, exist_ok=True)
            regenerate(self.cfg, self.target, directory, log=self.log)
        if self.distributed:
            dist.barrier()
        data = SequenceData(directory)
        if data.recipe != json.loads(json.dumps(data_recipe(self.cfg))):
            raise ValueError(f"{directory} was regenerated with a different data recipe: {data.recipe}")
        self.data, self.features = data, None
        if self.cfg.data.features is not None:
            from dflash2.train.features import FeatureCache

            if self.rank == 0:
                cache_features(self.cfg, self.target, directory, self.drafter.target_layer_ids, self.log)
            if self.distributed:
                dist.barrier()
            self.features = FeatureCache(self.cfg.data.features, data, self.drafter.target_layer_ids)
        self.num_train = len(data) - self.cfg.eval_sequences
        if self.num_train < 1:
            raise ValueError(f"eval_sequences={self.cfg.eval_sequences} leaves none of the {len(data)} sequences to train on")
        if self.cfg.draft_vocab is not None:  # the most frequent labels of the training split (a resume: the same)
            from dflash2.drafter.draft_vocab import coverage, most_frequent

            labels = [t for ids, mask in zip(data.rows[: self.num_train]["input_ids"], data.rows[: self.num_train]["label_mask"])
                      for t, m in zip(ids, mask) if m]
            counts = torch.bincount(torch.tensor(labels), minlength=self.drafter.config.vocab_size)
            self.drafter.draft_vocab.copy_(most_frequent(counts, self.cfg.draft_vocab).to(self.drafter.draft_vocab.device))
            self.log(f"draft vocabulary: the {self.cfg.draft_vocab} most frequent label tokens, "
                     f"{coverage(counts, self.drafter.draft_vocab.cpu()):.2%} of the training labels")
        pad = self.target.config.pad_token_id
        self.pad_id = pad if pad is not None else 0

    def batch(self, indices: torch.Tensor, generator: torch.Generator):
        """(ids, features, anchors, valid, label_mask, last_hidden) of these sequences, on the device."""
        B = self.drafter.config.block_size
        ids, lengths, label_mask = self.data.batch(indices, self.pad_id)
        anchors, valid = sample_masked_anchors(label_mask, lengths, B, self.cfg.anchors_per_seq, generator)
        ids, label_mask = ids.to(self.device), label_mask.to(self.device)
        attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long().to(self.device)
        if self.features is not None:  # cached once for the dataset
            dtype = self.adapter.model.get_input_embeddings().weight.dtype
            return (ids, self.features.batch(indices, ids.shape[1], dtype).to(self.device), anchors.to(self.device),
                    valid.to(self.device), label_mask, None)
        with torch.no_grad():  # the frozen target: features of every position, its final hidden state
            t_out = self.adapter.model(input_ids=ids, attention_mask=attention, output_hidden_states=True,
                                       use_cache=False, logits_to_keep=1)
            features = torch.cat([t_out.hidden_states[i + 1] for i in self.drafter.target_layer_ids], dim=-1)
            last = t_out.hidden_states[-1] if self.cfg.soft_targets else None
        return ids, features, anchors.to(self.device), valid.to(self.device), label_mask, last

    # -- steps -------------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[Losses, int, int]:
        """One optimizer step; returns the last micro-batch's losses (metrics averaged over all of them),
        the tokens and the anchors it trained on."""
        cfg = self.cfg
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        indices = batch_indices(step, cfg, self.num_train, self.rank, self.world)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + self.rank)
        micro = [self.batch(part, g) for part in indices.chunk(cfg.grad_accum)]
        L = self.drafter.config.block_size - 1
        dens = _denominators(micro, L, cfg.gamma) if cfg.grad_accum > 1 else None
        self.opt.zero_grad(set_to_none=True)
        metrics: dict[str, Any] = {}
        for n, (ids, feats, anchors, valid, mask, last) in enumerate(micro):
            with self.autocast:
                losses = self.step_module(ids, feats, anchors, valid, mask, last, dens)
            losses.total.backward()
            metrics = _merge(metrics, losses.metrics, n)
        torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
        self.opt.step()
        tokens = sum(int(m[4].shape[0] * m[4].shape[1]) for m in micro)
        anchors = sum(int(m[3].sum()) for m in micro)
        return losses._replace(metrics=metrics), tokens, anchors

    @torch.no_grad()
    def heldout_tau(self) -> float:
        """Mean tokens per block a greedy verifier would accept on the held-out sequences, at fixed
        anchors (1 + the drafted tokens right in a row): the τ of a path drafter, teacher-forced."""
        cfg, total, count = self.cfg, 0.0, 0
        held = torch.arange(self.num_train, len(self.data))
        self.drafter.eval()
        try:
            for part in held.split(max(1, cfg.batch_size // self.world)):
                g = torch.Generator().manual_seed(cfg.seed * 7 + 1)
                ids, feats, anchors, valid, mask, _ = self.batch(part, g)
                module = self.step_module.module if isinstance(self.step_module, nn.parallel.DistributedDataParallel) \
                    else self.step_module
                with self.autocast:
                    total += float(module.accepted(ids, feats, anchors, valid, mask).sum())
                count += int(valid.sum())
        finally:
            self.drafter.train()
        return total / max(count, 1)

    # -- checkpoints -------------------------------------------------------------------------------
    def state(self, step: int) -> dict[str, Any]:
        if self.distributed and self.cfg.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model = get_model_state_dict(self.step_module, options=options)
            optim = get_optimizer_state_dict(self.step_module, self.opt, options=options)
            return dict(drafter={k.removeprefix("drafter."): v for k, v in model.items()}, optimizer=optim,
                        step=step, fsdp=True)
        return dict(drafter=self.drafter.state_dict(), optimizer=self.opt.state_dict(), step=step)

    def restore(self, state: dict[str, Any]) -> int:
        if self.distributed and self.cfg.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            if not state.get("fsdp"):
                raise ValueError("this checkpoint was written without FSDP; resume it with parallel: ddp")
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.step_module, {f"drafter.{k}": v for k, v in state["drafter"].items()},
                                 options=options)
            set_optimizer_state_dict(self.step_module, self.opt, state["optimizer"], options=options)
        else:
            if state.get("fsdp"):
                raise ValueError("this checkpoint was written by FSDP; resume it with parallel: fsdp")
            self.drafter.load_state_dict(state["drafter"])
            self.opt.load_state_dict(state["optimizer"])
        return state["step"]

    def agree_on_stop(self, signum: int | None) -> int | None:
        """The signal any rank received during this step (None: none did), the same on every rank: a
        signal reaches the processes at different moments, and a rank that stopped a step before the others
        would leave them waiting in the next step's all-reduce."""
        if not self.distributed:
            return signum
        flag = torch.tensor([signum or 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) or None

    def save(self, step: int, record: dict[str, Any]) -> None:
        state = self.state(step)  # every rank takes part in gathering a sharded state
        if self.rank == 0:
            save_checkpoint(self.out / "ckpt.pt", state, config=self.cfg.to_dict())
            with (self.out / "log.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")


def _init_state(init: str, drafter: DFlash2Drafter) -> dict[str, torch.Tensor]:
    start = DFlash2Drafter.from_pretrained(init)
    if start.config.num_layers < drafter.config.num_layers:
        start = start.grown(drafter.config.num_layers)
    have, want = start.config.to_dict(), drafter.config.to_dict()
    differ = {k: (have[k], want.get(k)) for k in have if have[k] != want.get(k)}
    if differ:
        raise ValueError(f"init drafter {init} does not fit the run's drafter config "
                         f"(field: init's value, the run's): {differ}")
    return start.state_dict()


def _denominators(micro: list, L: int, gamma: float | None) -> tuple[float, float]:
    """The whole step's Σ w_k·m and Σ m over every micro-batch's label weights (before any forward)."""
    den_b = den_s = 0.0
    for _, _, anchors, valid, mask, _ in micro:
        m = label_weights(anchors, L, mask, valid)
        den_b += float((m * position_weights(L, gamma, m.device)).sum())
        den_s += float(m.sum())
    return den_b, den_s


def _merge(acc: dict[str, Any], new: dict[str, Any], n: int) -> dict[str, Any]:
    """Running mean of metric dicts over micro-batches (n: how many are in acc)."""
    if not acc:
        return dict(new)
    out = {}
    for k, v in new.items():
        a = acc.get(k, v)
        out[k] = [(x * n + y) / (n + 1) for x, y in zip(a, v)] if isinstance(v, list) else (a * n + v) / (n + 1)
    return out


def prepare_data(cfg: TrainConfig, log=_stderr) -> Path:
    """Regenerate (or resume) the run's dataset and nothing else: no drafter, no optimiser. Returns its directory."""
    from transformers import AutoModelForCausalLM

    with stop_signals({"defer": 0}):
        target = resolve_target(cfg.target)
        if not Path(target).is_dir() and not looks_like_hub_id(target):
            raise FileNotFoundError(f"no such target directory: {cfg.target}")
        model = from_pretrained(AutoModelForCausalLM.from_pretrained, target, dtype=getattr(torch, cfg.target_dtype or cfg.dtype))
        directory = cfg.data.resolved_cache(Path(cfg.out))
        if not (directory / "complete.json").is_file():
            regenerate(cfg, model.eval(), directory, log=log)
        if cfg.data.features is not None:
            torch.manual_seed(cfg.seed)
            layer_ids = DFlash2Drafter.from_target(model, **cfg.drafter).target_layer_ids
            cache_features(cfg, model, directory, layer_ids, log)
        return directory


def cache_features(cfg: TrainConfig, model, data_dir: Path, layer_ids: tuple[int, ...], log=_stderr) -> Path:
    """Build (or resume) the run's feature cache of the dataset in data_dir."""
    from tqdm import tqdm

    from dflash2.train.data import SequenceData
    from dflash2.train.features import build_features, feature_recipe

    d = cfg.data
    data = SequenceData(data_dir)
    directory = Path(d.features)
    recipe = feature_recipe(cfg.target, layer_ids, model.config.hidden_size, d.feature_linear_dtype, d.feature_dtype,
                            data.recipe)
    done = sum(hi - lo for s, (lo, hi) in enumerate(data.shard_bounds) if (directory / f"shard_{s:05d}.pt").is_file())
    if done < len(data):
        log(f"features: layers {list(layer_ids)} of {len(data)} sequences into {directory}")
    with tqdm(total=len(data), initial=done, desc="features", unit="seq", file=sys.stderr) as bar:
        return build_features(directory, recipe, data_dir, model, bar.update)


def train(cfg: TrainConfig, stop_after: int | None = None, log=_stderr) -> Path:
    from tqdm import tqdm

    signals: dict[str, int | None] = {"defer": 0, "signum": None, "stopping": 0}
    with stop_signals(signals):
        run = Run(cfg, log)
        run.load_data()
        step = 0
        state = load_checkpoint(run.out / "ckpt.pt")
        if state is not None:
            step = run.restore(state)
            if run.rank == 0:
                log(f"resuming from step {step} of {cfg.steps} ({run.out / 'ckpt.pt'})")
        end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
        bar = tqdm(range(step, end), initial=step, total=cfg.steps, desc="drafter", disable=run.rank != 0)
        signals["defer"] = 1  # from here a signal stops the loop at the end of its step
        started, seen_tokens, seen_anchors = time.perf_counter(), 0, 0
        for step in bar:
            losses, tokens, anchors = run.train_step(step)
            seen_tokens, seen_anchors = seen_tokens + tokens, seen_anchors + anchors
            elapsed = max(time.perf_counter() - started, 1e-9)
            m = losses.metrics
            done = step + 1
            record: dict[str, Any] = dict(step=done, loss=float(losses.total.detach()), **m,
                                          tokens_per_s=seen_tokens * run.world / elapsed,
                                          anchors_per_s=seen_anchors * run.world / elapsed)
            if run.device.type == "cuda":
                record["cuda_peak_gb"] = torch.cuda.max_memory_allocated(run.device) / 2**30
            if cfg.eval_every and cfg.eval_sequences and (done % cfg.eval_every == 0 or done == end):
                record["heldout_tau"] = run.heldout_tau()
            bar.set_postfix(loss=f"{record['loss']:.3f}", top1=f"{m['top1_acc']:.2f}",
                            tau=f"{expected_tau_from_accuracy(m['top1_acc_by_pos']):.2f}",
                            **({"heldout_tau": f"{record['heldout_tau']:.2f}"} if "heldout_tau" in record else {}),
                            tok_s=f"{record['tokens_per_s']:.0f}", anc_s=f"{record['anchors_per_s']:.0f}")
            stop = run.agree_on_stop(signals["signum"])  # every rank stops after the same step
            # from here no signal interrupts the stop: under a launcher, the first rank to exit gets the others
            # signalled, which must not break into their checkpoint, barrier or process group's teardown
            signals["stopping"] = int(stop is not None)
            if done % cfg.ckpt_every == 0 or done == end or stop is not None:
                run.save(done, record)
            if stop is not None:  # saved just above
                bar.close()
                if run.distributed:  # no rank leaves while rank 0 writes (a launcher stops the rest when one exits)
                    dist.barrier()
                    dist.destroy_process_group()
                raise Interrupted(stop, f"{signal.Signals(stop).name} at step {done} of "
                                  f"{cfg.steps}: checkpoint written to {run.out / 'ckpt.pt'}; the same command resumes")
        signals["defer"] = 0
        bar.close()
        fsdp = run.distributed and cfg.parallel == "fsdp"
        full = run.state(end)["drafter"] if fsdp else run.drafter.state_dict()  # under FSDP every rank gathers
        if run.rank == 0 and end == cfg.steps:
            final = run.drafter
            if fsdp:  # the sharded drafter's full weights, in an unsharded copy
                final = DFlash2Drafter(run.drafter.config)
                final.load_state_dict(full)
            final.save_pretrained(run.out / "final")
            (run.out / "final" / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        if run.distributed:
            if not fsdp:  # each replica's own weights (sharded weights are gathered on rank 0 only)
                digest = sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(full.values()))
                (run.out / f"replica_{run.rank}.json").write_text(json.dumps({"rank": run.rank, "step": end,
                                                                              "digest": digest}))
            dist.barrier()
            dist.destroy_process_group()
    return run.out


RESUME_FREE = {"out", "ckpt_every"}  # fields a resumed run may change: they change none of its results


def check_resume(out: Path, cfg: TrainConfig) -> None:
    """A run resumes only with the config that wrote its checkpoint in `out`: with another lr, schedule
    or data, the resumed run would silently differ from the run it continues."""
    path = out / "ckpt.config.json"
    if not (out / "ckpt.pt").is_file() or not path.is_file():
        return
    stored = json.loads(path.read_text())
    now = json.loads(json.dumps(cfg.to_dict()))  # as JSON stores it (tuples become lists)
    differ = {k: (stored[k], now[k]) for k in sorted(stored.keys() & now.keys())
              if k not in RESUME_FREE and stored[k] != now[k]}
    if differ:
        raise ValueError(f"{out / 'ckpt.pt'} was written with another config (field: then, now): {differ}; "
                         "resume with the same config, or train into a new `out`")


def export_checkpoint(cfg: TrainConfig, directory: str | Path) -> int:
    """Write the run's last complete checkpoint (<out>/ckpt.pt) as a drafter directory, like `final`,
    so that a long run can be evaluated while it trains. Returns the checkpoint's step."""
    state = load_checkpoint(Path(cfg.out) / "ckpt.pt")
    if state is None:
        raise FileNotFoundError(f"{Path(cfg.out) / 'ckpt.pt'} does not exist: the run has no checkpoint yet")
    from transformers import AutoModelForCausalLM

    target = from_pretrained(AutoModelForCausalLM.from_pretrained, cfg.target, dtype=getattr(torch, cfg.dtype))
    drafter = DFlash2Drafter.from_target(target, **cfg.drafter)
    drafter.load_state_dict(state["drafter"])
    directory = Path(directory)
    drafter.save_pretrained(directory)
    record = {**cfg.to_dict(), "exported_step": state["step"]}
    (directory / "train_config.json").write_text(json.dumps(record, indent=2) + "\n")
    return state["step"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash2.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="config keys (YAML or dotted.key=value) and their defaults:\n" + config_reference())
    p.add_argument("--config", type=Path, help="YAML of config keys (default: none; the overrides alone)")
    p.add_argument("--stop-after", type=int, help="stop (checkpointed) after this many more steps (default: run to `steps`)")
    p.add_argument("--export", type=Path, metavar="DIR",
                   help="train nothing: write the run's last checkpoint as a drafter directory DIR")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="train with N processes on this machine (parallel: ddp or fsdp), launched like torchrun "
                        "--standalone; Ctrl-C or SIGTERM: one line, a checkpoint at the step reached, every process "
                        "gone, exit 130 / 143")
    p.add_argument("--data-only", action="store_true",
                   help="regenerate (or resume) the dataset and stop; a signal stops it between shards' writes")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and say what a run would do (data, steps, where), then stop: nothing loaded")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. steps=200 drafter.block_size=8")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            print(describe(cfg))
            return 0
        if args.nproc_per_node is not None and "LOCAL_RANK" not in os.environ:  # the launcher, not a worker
            if args.nproc_per_node < 1:
                raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
            forwarded = list(argv if argv is not None else sys.argv[1:])
            i = next(i for i, a in enumerate(forwarded) if a.startswith("--nproc-per-node"))
            del forwarded[i: i + (1 if "=" in forwarded[i] else 2)]
            return launch(args.nproc_per_node, forwarded)
        if args.data_only:
            print(f"dataset: {prepare_data(cfg)}")
            return 0
        if args.export:
            step = export_checkpoint(cfg, args.export)
            print(f"wrote the step-{step} drafter of {cfg.out} to {args.export}")
            return 0
        out = train(cfg, stop_after=args.stop_after)
    except Interrupted as stop:
        if _world() > 1:  # a worker stopped as asked: its launcher's signal changes nothing
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        detail = str(stop) if str(stop) != signal.Signals(stop.signum).name else (
            f"{signal.Signals(stop.signum).name}: stopped before the first training step; the same command resumes")
        if _rank() == 0:  # one line for the whole run, not one per process
            print(f"interrupted by {detail}", file=sys.stderr)
        return 128 + stop.signum
    except (ValueError, TypeError, OSError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if _rank() != 0:  # one report for the whole run
        return 0
    print(f"run directory: {out}")
    final = out / "final"
    if final.is_dir():
        # trained on chat turns: prompt it the same way, with a request rather than the demo's code prefix
        chat = ' --chat --prompt "Write a Python function that reverses a string."' if cfg.data.dataset is not None else ""
        print(f"drafter: {final}\nuse it: python -m dflash2.generate --target {cfg.target} --drafter {final}{chat}")
    else:
        print(f"the run stopped before step {cfg.steps}: the same command resumes it; --export DIR writes its last "
              "checkpoint as a drafter")
    return 0


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
