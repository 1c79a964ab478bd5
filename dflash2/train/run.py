"""`python -m dflash2.train --config configs/<file>.yaml [dotted.key=value ...]`: train a drafter.

The recipe (docs/training.md): the frozen target regenerates the responses (`dflash2.train.data`);
each step samples random anchors per sequence where the next token is a label and trains all blocks
of a sequence in one masked pass (`dflash2.train.forward`), reading the target's features from the
cache (`dflash2.train.features`) or computing them online; losses in chunks of rows, so that no
[anchors, block, vocabulary] tensor is ever whole.

Resumable: every `ckpt_every` steps the drafter, optimizer and step are written atomically to
`<out>/ckpt.pt`. Batches and anchors are functions of (seed, step, rank), so a killed run restarted
ends bit-identical to one never interrupted. SIGINT or SIGTERM writes a checkpoint of the last
finished step and exits 130 / 143 with one line. Under `torchrun` it trains with DDP or FSDP
(`parallel`). `--export DIR` writes the last checkpoint as a drafter directory.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash2.drafter.model import DFlash2Drafter
from dflash2.targets.adapter import TargetAdapter
from dflash2.train.checkpoint import load_checkpoint, save_checkpoint
from dflash2.train.config import TrainConfig, data_recipe
from dflash2.train.forward import (Losses, accepted_lengths, drafter_losses, expected_tau_from_accuracy, label_weights,
                                   masked_block_forward, position_weights, sample_masked_anchors)
from dflash2.train.prepare import cache_features, load_target, regenerate
from dflash2.train.signals import Interrupted, _rank, _stderr, _world, stop_signals


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


# -- the run ------------------------------------------------------------------------------------------
class Run:
    """Everything one training process holds: the models, the optimizer, the data, and its place."""

    def __init__(self, cfg: TrainConfig, log=_stderr) -> None:
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
        self.target = load_target(cfg).to(self.device)
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
        if self.features is not None:  # cached once for the dataset
            dtype = self.adapter.model.get_input_embeddings().weight.dtype
            return (ids, self.features.batch(indices, ids.shape[1], dtype).to(self.device), anchors.to(self.device),
                    valid.to(self.device), label_mask, None)
        attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long().to(self.device)
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
            self.log_record(record)

    def log_record(self, record: dict[str, Any]) -> None:
        """Append one step's record to <out>/log.jsonl (rank 0)."""
        if self.rank == 0:
            with (self.out / "log.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

    def trim_log(self, step: int) -> None:
        """Drop the log's records past `step`: a resumed run logs them again from its checkpoint."""
        path = self.out / "log.jsonl"
        if self.rank == 0 and path.is_file():
            lines = path.read_text().splitlines()
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
            if len(kept) < len(lines):
                path.write_text("".join(line + "\n" for line in kept))


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
            run.trim_log(step)
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
            elif "heldout_tau" in record:  # an evaluation between checkpoints is logged too
                run.log_record(record)
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
    target = load_target(cfg, dtype=cfg.dtype)
    drafter = DFlash2Drafter.from_target(target, **cfg.drafter, draft_vocab_size=cfg.draft_vocab)
    drafter.load_state_dict(state["drafter"])
    directory = Path(directory)
    drafter.save_pretrained(directory)
    record = {**cfg.to_dict(), "exported_step": state["step"]}
    (directory / "train_config.json").write_text(json.dumps(record, indent=2) + "\n")
    return state["step"]
