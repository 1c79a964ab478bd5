"""A faster target step for decoding: the model's own weights over a preallocated KV cache.

`TargetAdapter.forward` calls the HF model's `forward`, whose per-pass bookkeeping (cache update chain,
mask factory, output dataclasses) is most of a small target's step. `StaticTarget` is a TargetAdapter
that skips it: the embedding, rotary embedding, decoder layers (written out by `dflash2.targets.fused`,
or the model's own modules with `fused=False`), final norm and LM head called directly, over key/value
buffers allocated once (slot = position, so a rollback only moves the length back) and a mask built
from positions. `compile=True` puts the step through `torch.compile` with dynamic shapes, each kind of
pass (prefill, one token, verify) with graphs of its own; the eager path is the same function.

Supported: decoder-only Llama-family layouts (`SUPPORTED`: Qwen3, Qwen2, Llama, Mistral; sliding
windows masked by position); anything else raises NotImplementedError: use TargetAdapter. Batches run
through the same step (`forward_masked`, [R, W] ids at per-row positions over a [rows, kv_heads,
slots, hd] cache per layer): accepted slots move down in place, a finished row's buffer row goes to
the next prompt, and the buffers double only when rows or slots outrun them.
"""

from __future__ import annotations

import inspect
from collections import Counter

import torch
from torch import Tensor, nn

from dflash2.targets.adapter import TargetAdapter, TargetStep
from dflash2.targets.static_cache import StaticCache, StaticCacheOps, _Writer
from dflash2.targets.attention import masked_gqa
from dflash2.targets.fused import FusedDecoder, Linear
from dflash2.compile import allow_recompiles, announce_compiling, compile_own, gemm_choice, inductor_gemm
from dflash2.decoding.tree import TokenTree

# the kinds of pass that compile apart (StaticTarget._runs): prefills; batch 1's passes after the prefill; a
# batch's one-token passes (plain steps, rounds not drafted) and its wider ones (verification)
PASS_KINDS = ("prefill", "single", "one", "wide")

SUPPORTED = ("qwen3", "qwen2", "llama", "mistral")


class StaticTarget(StaticCacheOps, TargetAdapter):
    """A TargetAdapter that runs the model's layers directly over a StaticCache (module docstring).

    capacity: slots per sequence (default: max_position_embeddings, or 4096). compile: the step through
    torch.compile, dynamic rows, widths and slots, each kind of pass with graphs of its own. fused: the
    decoder written out (dflash2.targets.fused) where the model allows it (`fused_reason` says why not);
    False: the model's own layer modules. linear_dtype: the fused step's matrix products, the LM head's
    included ("bfloat16" on a float32 model: another arithmetic, lossless with respect to itself).
    gemm: how the compiled fused step multiplies (dflash2.compile.gemm_choice: "inductor", its own C++
    kernels over weights frozen into each graph; "aten", the prepacked oneDNN call shared by every graph).
    """

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = (), *, capacity: int | None = None,
                 compile: bool = False, fused: bool = True, linear_dtype: torch.dtype | str | None = None,
                 gemm: str = "auto") -> None:
        super().__init__(model, layer_ids)
        linear_dtype = _dtype(linear_dtype)
        kind = getattr(self.config, "model_type", None)
        if kind not in SUPPORTED or self.hybrid:
            raise NotImplementedError(f"StaticTarget runs {', '.join(SUPPORTED)} targets; this is {kind!r}. "
                                      "Use TargetAdapter (any HF causal LM)")
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in ("eager", "sdpa"):
            raise NotImplementedError(f"StaticTarget builds its own attention mask: it needs attn_implementation "
                                      f"'eager' or 'sdpa', the target uses {impl!r}")
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.head = model.get_output_embeddings()
        # the device and dtype read once, as the step reads (the fused step: copies) the weights once; the
        # model's own lookup costs microseconds in every pass
        embeddings = model.get_input_embeddings().weight
        self._device, self._dtype = embeddings.device, embeddings.dtype
        self.capacity = int(capacity or self.max_positions or 4096)
        self.kinds = self._attention_kinds()  # layer kind → sliding window (None: full)
        self.layer_kinds = list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers)
        layer_params = inspect.signature(self.decoder.layers[0].forward).parameters
        self._layer_cache_kw = "cache" if "cache" in layer_params else "past_key_values"
        self.fused: FusedDecoder | None = None
        self.fused_reason: str | None = "fused=False"  # why the model's own layers run (None: they do not)
        if fused:
            try:
                self.fused = FusedDecoder(model, self.layer_kinds, self.layer_ids, linear_dtype)
                self.fused_reason, self.head = None, Linear(self.head.weight, self.head.bias, linear_dtype)
            except NotImplementedError as why:
                self.fused_reason = str(why)
        if linear_dtype is not None and self.fused is None:
            raise NotImplementedError(f"linear_dtype={linear_dtype} needs the fused step, which does not run this "
                                      f"target ({self.fused_reason}); leave linear_dtype unset to run the model's layers")
        self.gemm = _gemm(gemm, compile, self.fused, self._device)
        if self.gemm == "inductor":
            for lin in (*self.fused.linears(), self.head):
                lin.in_graph = "inductor"
        if compile:
            allow_recompiles(64)  # a graph per pass kind and per shape that specialises (one row, one token)
        self._compiled, self.warmed = compile, set()  # the kinds of pass warm_up compiled so far ("single", "batch")
        self.passes: Counter[str] = Counter()  # the passes run, by kind: PASS_KINDS and "eager" (a one-token prefill)
        # automatic dynamic shapes, the sizes a decode varies marked dynamic while warming up (warm_up): the
        # weights and the model's constants stay static, so a call's guards are few (dynamic=True made every
        # size symbolic, the weights' too, and Python-evaluated guards on them cost more than a layer's work)
        # each kind of pass compiles apart, graphs of its own whose guards a call checks only against its own
        # kind's (docs/architecture.md, "Performance choices"): prefills (batch 1 and batches), batch 1's passes
        # after the prefill, a batch's one-token passes, a batch's wider passes (verification)
        self._runs = {kind: compile_own(self._step, dynamic=None) if compile else self._step for kind in PASS_KINDS}

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    # -- passes -----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: Tensor, cache: StaticCache, keep_logits: int | None = None) -> TargetStep:
        """ids [1, T] after the cached positions: each sees the cache and the pass's earlier tokens."""
        if input_ids.shape[0] != 1:
            raise ValueError("StaticTarget runs batch 1; use TargetAdapter for batches")
        start, T = cache.length, input_ids.shape[1]
        self._reserve(cache, start + T)
        positions = torch.arange(start, start + T, device=self.device)[None]
        logits, features = self._pass(input_ids.to(self.device), positions, cache, None, keep_logits)
        return TargetStep(logits, features, input_ids, start, None)

    @torch.no_grad()
    def forward_tree(self, anchor: int, tree: TokenTree, cache: StaticCache) -> TargetStep:
        """[anchor, tree nodes] in one pass: node i at position start + depth(i) sees the cache, the
        anchor and its ancestors (slots start.. hold the pass in node order)."""
        start, M = cache.length, tree.tokens.shape[0]
        if M == 0:  # the anchor alone: a plain one-token step
            return self.forward(torch.tensor([[anchor]]), cache)
        self._reserve(cache, start + M + 1)
        ids = torch.cat([torch.tensor([anchor]), tree.tokens.cpu()])[None].to(self.device)  # [1, M+1]
        depth, visible = tree.block()  # [M+1], [M+1, M+1]
        positions = (start + depth)[None].to(self.device)
        allowed = torch.cat([torch.ones(M + 1, start, dtype=torch.bool), visible.cpu()], dim=1).to(self.device)
        logits, features = self._pass(ids, positions, cache, allowed, None)
        return TargetStep(logits, features, ids, start, None)

    def _pass(self, ids: Tensor, positions: Tensor, cache: StaticCache, allowed: Tensor | None,
              keep_logits: int | None) -> tuple[Tensor, Tensor | None]:
        start, T = cache.length, ids.shape[1]
        if self._compiled and "single" not in self.warmed:
            self.warm_up("single")
        key_positions = torch.arange(start + T, device=self.device)
        if allowed is not None:  # a tree: key slots start.. hold the nodes, at their depths' positions
            key_positions = torch.cat([key_positions[:start], positions[0]])
        masks = self._masks(positions[0], key_positions, allowed)
        step = self._runner(start, T, batch=False)
        if self.fused is not None:  # no transformers layer runs: neither its hooks nor its attention table matter
            normed, features = step(ids, positions, masks, cache.keys, cache.values, start)
        else:
            with _quiet_output_hooks(), masked_gqa(self.config):  # grouped heads without copying K/V per head
                normed, features = step(ids, positions, masks, cache.keys, cache.values, start)
        cache.length = start + T
        return self.head(normed[:, -(keep_logits or T):]), features

    def _runner(self, start: int, width: int, batch: bool):
        """The step a pass of `width` tokens per row after `start` cached slots runs through: its kind's
        compiled graphs (PASS_KINDS), or eager for a one-token prompt's prefill."""
        if start == 0:
            kind = "prefill" if width > 1 else "eager"
        else:
            kind = ("one" if width == 1 else "wide") if batch else "single"
        self.passes[kind] += 1
        return self._runs.get(kind, self._step)

    def warm_up(self, kind: str) -> None:
        """Compile the step's graphs for one kind of pass on a scratch cache before the first real one,
        so no compilation lands inside a timed decode: "single" (batch 1: one token; two or more) or
        "batch" (a batch's one-token pass, at several rows and at one, which compiles apart). While
        warming up, every size a decode varies (rows, pass width, slots; the start changes between
        passes) is marked dynamic on each call, so that those graphs serve every later pass. Nothing to
        do when not compiled."""
        if kind not in ("single", "batch"):
            raise ValueError(f'warm_up takes "single" or "batch", got {kind!r}')
        if not self._compiled:
            return
        self.warmed.add(kind)
        compiled = dict(self._runs)

        def marking(run):
            def call(ids, positions, masks, keys, values, start):
                _vary(ids, positions, *(m for m in masks.values() if m is not None))
                _vary(*keys, *values, dims=(0, 2))  # rows, slots (heads and head size are the model's)
                return run(ids, positions, masks, keys, values, start)
            return call

        self._runs = {name: marking(run) for name, run in compiled.items()}
        try:
            # as the passes run (a graph traced with grad mode on is not theirs); the graphs' products (gemm)
            with torch.no_grad(), inductor_gemm(self.gemm):
                self._warm_up_passes(kind)
        finally:
            self._runs = compiled

    def _warm_up_passes(self, kind: str) -> None:
        done = announce_compiling("the target's StaticTarget step" + (" for batches" if kind == "batch" else ""))
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=self.device)  # noqa: E731
        if kind == "single":
            scratch = StaticCache()
            self._reserve(scratch, 16)
            for n in (2, 2, 3, 1, 1):  # a prefill; wider passes, then one-token ones, at growing starts
                self._pass(zeros(1, n), torch.arange(scratch.length, scratch.length + n, device=self.device)[None],
                           scratch, None, None)
        else:
            # positions as a decode builds them (contiguous: an expanded tensor's strides would be guarded on)
            arange = lambda rows, lo, hi: torch.arange(lo, hi, device=self.device).repeat(rows, 1)  # noqa: E731
            for rows in (3, 1):  # a prefill, one-token passes, wider passes (the last two: the buffers full, then not)
                scratch, pos = StaticCache(), arange(rows, 0, 2)
                self.forward_masked(zeros(rows, 2), pos, pos, torch.ones(rows, 2, 2, dtype=torch.bool).tril(), scratch)
                for S in (2, 3):
                    self.forward_masked(zeros(rows, 1), torch.full((rows, 1), S, device=self.device),
                                        arange(rows, 0, S + 1), torch.ones(rows, 1, S + 1, dtype=torch.bool), scratch)
                for S, W in ((4, 2), (6, 2), (8, 3)):
                    allowed = torch.ones(rows, W, S + W, dtype=torch.bool)
                    allowed[:, :, S:] = torch.ones(W, W, dtype=torch.bool).tril()
                    self.forward_masked(zeros(rows, W), arange(rows, S, S + W), arange(rows, 0, S + W), allowed, scratch)
        done()

    def _masks(self, q_pos: Tensor, k_pos: Tensor, allowed: Tensor | None) -> dict[str, Tensor | None]:
        """Additive masks [1, 1, T, S] per layer kind: causal by position (or the tree's `allowed`),
        and each sliding kind's window by position; None where one query sees every key (a plain
        decoding step), which lets attention read the grouped K/V heads as they are."""
        dtype = self.dtype
        out = {}
        for kind, window in self.kinds.items():
            if q_pos.shape[0] == 1 and allowed is None and (window is None or k_pos.shape[0] <= window):
                out[kind] = None
                continue
            ok = k_pos[None, :] <= q_pos[:, None] if allowed is None else allowed
            if window is not None:
                ok = ok & (q_pos[:, None] - k_pos[None, :] < window)
            out[kind] = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(
                ~ok, torch.finfo(dtype).min)[None, None]
        return out

    def _step(self, ids: Tensor, positions: Tensor, masks: dict[str, Tensor | None], keys: list[Tensor],
              values: list[Tensor], start: int) -> tuple[Tensor, Tensor | None]:
        """The decoder over the pass, fused or the model's layers (K/V written from slot `start`): → final-normed hidden
        states [R, T, H] (the LM head runs outside, on the rows wanted) and features [R, T, F] or None."""
        if self.fused is not None:
            normed, kept = self.fused.step(ids, positions, masks, keys, values, start)
            return normed, (torch.cat(kept, dim=-1) if kept else None)
        cache = _Writer(keys, values, start)
        x = self.decoder.embed_tokens(ids)
        rope = self.decoder.rotary_emb(x, positions)
        kept: dict[int, Tensor] = {}
        wanted = set(self.layer_ids)
        for i, layer in enumerate(self.decoder.layers):
            x = layer(x, attention_mask=masks[self.layer_kinds[i]], position_embeddings=rope, position_ids=positions,
                      use_cache=True, **{self._layer_cache_kw: cache})
            x = x[0] if isinstance(x, tuple) else x
            if i in wanted:
                kept[i] = x
        normed = self.decoder.norm(x)
        if self.num_layers - 1 in wanted:  # HF's last hidden state is the normed one
            kept[self.num_layers - 1] = normed
        features = torch.cat([kept[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        return normed, features

    # -- batches ----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_masked(self, ids: Tensor, q_pos: Tensor, k_pos: Tensor, allowed: Tensor, cache,
                       keep_logits: int | None = None) -> TargetStep:
        """TargetAdapter.forward_masked through the step: ids [R, W] at q_pos [R, W] after the cache's S
        slots, k_pos [R, S+W] every key slot's position, allowed [R, W, S+W] the keys each query sees
        (sliding kinds also drop keys outside their window, by position). The cache grows by W slots."""
        if not isinstance(cache, StaticCache):
            raise TypeError("StaticTarget.forward_masked needs a StaticCache (its new_cache())")
        self._logits_kw(keep_logits)  # the same check of keep_logits as TargetAdapter's
        R, W = ids.shape
        start = cache.length
        if cache.keys and cache.rows != R:
            raise ValueError(f"the pass has {R} rows, the cache {cache.rows}")
        if self._compiled and "batch" not in self.warmed:
            self.warm_up("batch")
        self._reserve_rows(cache, R, start + W)
        masks = self._masks_per_kind(self.kinds, q_pos, k_pos, allowed)  # [R, 1, W, S+W] per layer kind
        keys, values = cache.views()
        if self.fused is not None:
            step = self._runner(start, W, batch=True)
            normed, features = step(ids.to(self.device), q_pos.to(self.device), masks, keys, values, start)
        else:
            with _quiet_output_hooks(), masked_gqa(self.config):
                normed, features = self._step(ids.to(self.device), q_pos.to(self.device), masks, keys, values, start)
        cache.length = start + W
        return TargetStep(self.head(normed[:, -(keep_logits or W):]), features, ids, start, None)

def _gemm(gemm: str, compile: bool, fused: FusedDecoder | None, device: torch.device) -> str:
    """StaticTarget's `gemm` resolved (dflash2.compile.gemm_choice): "inductor" needs the compiled fused
    step; "aten" is the prepacked oneDNN call on CPU (F.linear elsewhere)."""
    if gemm == "auto" and (not compile or fused is None):
        return "aten"
    gemm = gemm_choice(gemm, [device])
    if gemm == "inductor" and (not compile or fused is None):
        raise ValueError("gemm='inductor' is how the compiled fused step multiplies: it needs compile=True and a "
                         "target the fused step runs" + ("" if fused is not None else ": fused_reason says why it does not"))
    return gemm


def _vary(*tensors: Tensor, dims: tuple[int, ...] | None = None) -> None:
    """Mark `dims` (default: all) of each tensor dynamic for torch.compile, but a dim of size 1 (which
    compiles apart: a graph for one row, one for a one-token pass)."""
    for t in tensors:
        for d in range(t.dim()) if dims is None else dims:
            if t.shape[d] > 1:
                torch._dynamo.maybe_mark_dynamic(t, d)


def _dtype(name: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype given as torch.bfloat16 or "bfloat16" (None: None); ValueError for anything else."""
    if name is None or isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"linear_dtype must be a floating-point torch dtype or its name, got {name!r}")
    return dtype


class _quiet_output_hooks:
    """transformers records hidden states and attentions with forward hooks on the layers, which look
    up the active collector in a ContextVar: torch.compile cannot trace that and breaks the graph at
    every layer. Nothing is collected here (the step keeps what it needs itself), so for the step's
    duration the collector reads as a plain None, as transformers arranges when it compiles a model's
    own forward; afterwards it is as it was."""

    def __enter__(self):
        try:
            from transformers.utils import output_capturing
        except ImportError:
            self.var = None
            return self
        self.var = getattr(output_capturing, "_active_collector", None)
        if self.var is not None and not hasattr(self.var, "compiling"):
            self.var = None
        if self.var is not None:
            self.saved = (self.var.compiling, self.var.global_var)
            self.var.compiling, self.var.global_var = True, None
        return self

    def __exit__(self, *exc):
        if self.var is not None:
            self.var.compiling, self.var.global_var = self.saved


__all__ = ["StaticTarget", "StaticCache", "SUPPORTED"]
