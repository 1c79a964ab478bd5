"""The DFlash-2 drafter: backbone + candidate head + path selector.

One round of drafting (batch 1 at inference):

    new target features [1, n, F] ──extend_context──► ContextCache (per-layer K/V, kept across rounds)
    [anchor, MASK × (B-1)] ──target embedding──► [1, B, H] ──backbone──► hidden [1, B, H]
    hidden[:, 1:] ──target LM head──► logits [1, L, V] ──CandidateHead──► ids, U [L, K]
        (with a draft vocabulary, the head's rows of those V' ids only: logits [1, L, V'])
    (ids, U, hidden[1:], anchor) ──selector──► Draft(tokens [L], q or None)

The drafter holds no embedding or LM head: it borrows the target's (frozen), through the adapter;
unless its config gives it its own (`own_embedding`, `own_lm_head`: a published checkpoint that ships
`embed_tokens` / `lm_head`, which it must when its width differs from the target's, `target_hidden_size`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.drafter import reference_format
from dflash2.decoding.checks import hub_failure, looks_like_hub_id
from dflash2.drafter.backbone import BlockDiffusionBackbone, ContextBatch, ContextCache
from dflash2.config import DFlash2Config
from dflash2.drafter.heads import CandidateHead, Candidates, RoundContext
from dflash2.compile import allow_recompiles, announce_compiling, compile_own, gemm_choice, inductor_gemm
from dflash2.layers import as_rows
from dflash2.decoding.rng import RandomSource
from dflash2.drafter.selectors.codebook import build_selector
from dflash2.targets.adapter import TargetAdapter
from dflash2.decoding.tree import TokenTree, best_first_tree
from dflash2.decoding.verify import Draft

if TYPE_CHECKING:
    from dflash2.interfaces import Selector

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


class RoundScores(NamedTuple):
    """One drafting round. At batch 1 (`DFlash2Drafter.draft_round`): the grown context K/V (per layer
    [1, kv, C, hd]), the L draft positions' hidden states [L, H], their top-K candidates (ids, U
    [L, K]) and the selector's lattice scores (first [K], steps [L-1, K, K]; None when not asked); for a
    selector that reads the round's context, that context (a RoundContext). For R rows
    (`draft_round_batch`): keys and values None (the context stays in the ContextBatch), and every other
    field with a leading row dimension (hidden [R, L, H], candidates [R, L, K], first [R, K], steps
    [R, L-1, K, K])."""

    keys: list[Tensor]
    values: list[Tensor]
    hidden: Tensor
    cands: Candidates | None
    first: Tensor | None
    steps: Tensor | None
    context: RoundContext | None = None
ARCHITECTURE = "DFlash2Drafter"


class DFlash2Drafter(nn.Module):
    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        self.config = config
        self.backbone = BlockDiffusionBackbone(config)
        self.candidates = CandidateHead(config.selector_top_k)
        self.candidate_selector = build_selector(config)
        self._warmed: set | None = None  # compiled: the kinds of round warmed up so far (lattice or not; batched)
        n = config.draft_vocab_size  # the token ids the LM head drafts among (None: all of them)
        self.register_buffer("draft_vocab", None if n is None else torch.arange(n))
        # the drafter's own embedding and LM head (a checkpoint that ships them, e.g. one narrower than its
        # target); None: it reads the target's
        V, H = config.vocab_size, config.hidden_size
        self.embed_tokens = nn.Embedding(V, H) if config.own_embedding else None
        self.lm_head = nn.Linear(H, V, bias=False) if config.own_lm_head else None

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: nn.Module, **fields: Any) -> "DFlash2Drafter":
        """A randomly initialised drafter sized for an HF causal LM, on its device and dtype.

        Hidden size, vocabulary, number of target layers and RoPE parameters come from
        `target.config`; a target whose embedding module scales its output (Gemma: × √H) sets
        `input_embedding_scale` to that factor, since the drafter embeds with the raw matrix.
        `fields` sets any other DFlash2Config field (and may override the head layout). A negative
        `mask_token_id` counts from the end of the vocabulary (-1: its last row, which a padded
        vocabulary such as Qwen's never produces).
        """
        adapter = TargetAdapter(target)
        tc = adapter.config
        heads = int(getattr(tc, "num_attention_heads", 0) or max(1, adapter.hidden_size // 64))
        sizes = dict(
            hidden_size=adapter.hidden_size,
            vocab_size=adapter.vocab_size,
            num_target_layers=adapter.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(tc, "head_dim", None) or adapter.hidden_size // heads),
            intermediate_size=int(getattr(tc, "intermediate_size", None) or 4 * adapter.hidden_size),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6),
            rope_parameters=_rope_parameters(tc),
            max_position_embeddings=adapter.max_positions or 32768,
        )
        scale = adapter.embedding_scale() if "input_embedding_scale" not in fields else None
        if scale is not None:
            sizes["input_embedding_scale"] = scale
        clash = sorted(k for k in ("vocab_size", "num_target_layers") if k in fields and fields[k] != sizes[k])
        if clash:
            raise ValueError(f"{clash} must equal the target's ({[sizes[k] for k in clash]})")
        if fields.get("hidden_size", adapter.hidden_size) != adapter.hidden_size:  # a narrower or wider drafter:
            sizes.update(target_hidden_size=adapter.hidden_size, own_embedding=True, own_lm_head=True)  # its own
            sizes.pop("head_dim"), sizes.pop("intermediate_size")  # embedding and head; its sizes, not the target's
        sizes.update(fields)
        if isinstance(sizes.get("mask_token_id"), int) and sizes["mask_token_id"] < 0:
            sizes["mask_token_id"] += sizes["vocab_size"]
        weight = target.get_input_embeddings().weight
        drafter = cls(DFlash2Config(**sizes)).to(device=weight.device, dtype=weight.dtype)
        head = target.get_output_embeddings()
        with torch.no_grad():  # an own embedding or head as wide as the target's starts as a copy of it
            for own, theirs in ((drafter.embed_tokens, weight), (drafter.lm_head, getattr(head, "weight", None))):
                if own is not None and theirs is not None and own.weight.shape == theirs.shape:
                    own.weight.copy_(theirs)
                elif own is not None:  # another width: random, at the scale of the target's rows
                    nn.init.normal_(own.weight, std=float(weight.float().std()))
        return drafter

    def save_pretrained(self, directory: str | Path, *, format: str = "dflash2", target: nn.Module | None = None) -> None:
        """Write `config.json` and `model.safetensors` (HF-style directory).

        format="dflash2": our own layout. format="reference": the published layout of the drafter's method
        (DFlashDraftModel, DFlash2DraftModel, Qwen3DSparkModel, LiLiCorrDraftModel) that the engines load
        (docs/checkpoints.md). A draft vocabulary is written as the format has it (EAGLE-3's): its rows of
        the LM head as `lm_head.weight`, `d2t`, `draft_vocab_size`; a drafter that shares the target's head
        needs the `target` (an HF causal LM) to take them from.
        """
        if format not in ("dflash2", "reference"):
            raise ValueError(f"format must be 'dflash2' or 'reference', got {format!r}")
        directory = Path(directory)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if format == "reference":
            meta = reference_format.reference_from_config(self.config, self.backbone.fc.weight.dtype)
            vocab = tensors.pop("draft_vocab", None)
            tensors = reference_format.reference_from_state(tensors, reference_format.reference_architecture(self.config))
            if vocab is not None:
                head = self.lm_head.weight if self.lm_head is not None else \
                    None if target is None else target.get_output_embeddings().weight
                if head is None:
                    raise ValueError("the reference format ships a draft vocabulary's rows of the LM head, and this "
                                     "drafter shares the target's: pass target=<the HF model>")
                tensors = reference_format.join_draft_head(tensors, vocab, head.detach().cpu().to(self.backbone.fc.weight.dtype))
                meta["draft_vocab_size"] = int(vocab.numel())
        else:
            meta = {"architectures": [ARCHITECTURE], **self.config.to_dict()}
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None) -> "DFlash2Drafter":
        """Read our directory format or the reference one; every tensor must fit, none may be missing.

        device="meta": the drafter its config.json describes, with no weights read (parameter names
        and shapes of a checkpoint of any size, without allocating it). A hub id (owner/name) that is
        not a local directory is read from the Hugging Face cache, or downloaded when the hub is reachable."""
        directory = _local_directory(directory)
        meta_only = device is not None and torch.device(device).type == "meta"
        for name in (CONFIG_NAME,) if meta_only else (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name} does not exist")
        meta = json.loads((directory / CONFIG_NAME).read_text())
        if meta_only:
            weights = directory / WEIGHTS_NAME  # its tensor names (not their data), when the file is there
            names = None
            if weights.is_file():
                with safe_open(str(weights), framework="pt") as f:
                    names = list(f.keys())
            config = (reference_format.config_from_reference(meta, names) if reference_format.is_reference(meta)
                      else DFlash2Config.from_dict({k: v for k, v in meta.items() if k != "architectures"}))
            declared = reference_format.DTYPES.get(meta.get("dtype") or meta.get("torch_dtype"), torch.float32)
            with torch.device("meta"):
                return cls(config).to(dtype or declared)
        state = load_file(str(directory / WEIGHTS_NAME))
        stored = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
        if reference_format.is_reference(meta):
            config = reference_format.config_from_reference(meta, state.keys())
            model = cls(config).to(stored)
            vocab = None
            if config.draft_vocab_size is not None:  # the reduced head spread over the vocabulary, zero elsewhere
                state, vocab = reference_format.split_draft_head(state, config.vocab_size)
            expected = {k: v for k, v in model.state_dict().items() if k != "draft_vocab"}
            state = reference_format.state_from_reference(state, expected, reference_format.architecture(meta))
            if vocab is not None:
                state["draft_vocab"] = vocab
        else:
            arch = meta.pop("architectures", [ARCHITECTURE])
            if arch != [ARCHITECTURE]:
                raise ValueError(f"{directory} holds {arch}, neither a {ARCHITECTURE} nor a reference DFlash directory")
            model = cls(DFlash2Config.from_dict(meta)).to(stored)  # load without a lossy cast
            expected = model.state_dict()
            missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            if missing or unexpected:
                raise ValueError(f"checkpoint keys do not match the config: missing {missing}, unexpected {unexpected}")
            wrong = [k for k in expected if expected[k].shape != state[k].shape]
            if wrong:
                raise ValueError(f"checkpoint tensors with wrong shapes: {wrong}")
        model.load_state_dict(state, strict=True)
        if model.draft_vocab is not None:
            _check_draft_vocab(model.draft_vocab, model.config.vocab_size, model.config.selector_top_k)
        return model.to(device=device, dtype=dtype or stored)

    def with_config(self, **changes: Any) -> "DFlash2Drafter":
        """A copy with some config fields changed and the same weights: block size, selector among
        walk/viterbi (or argmax, which drops the codebooks: the selector ablation; a selector whose
        parameters this drafter lacks is refused: `with_selector` starts them fresh), top-K, context
        window (fields that change no parameter shape)."""
        config = self.config.replace(**changes)
        if config.draft_vocab_size not in (None, self.config.draft_vocab_size):
            raise ValueError("a draft vocabulary needs its token ids: use with_draft_vocab(ids)")
        state = self.state_dict()
        if config.draft_vocab_size is None:
            state.pop("draft_vocab", None)
        if config.selector == self.config.selector:
            return self._copy(config, state)[0]
        return self._reselect(config, state, None, fresh_ok=False)

    def with_selector(self, selector: "str | Selector") -> "DFlash2Drafter":
        """A copy with another path selector and the same backbone and head weights. `selector` is a name
        (walk, viterbi, argmax, one given to `dflash2.register_selector`, or "package.module:Name") or a
        selector object whose class is registered (the config must name it, so that a saved drafter can
        be loaded again). The new selector keeps the old one's tensors where their names and shapes
        agree (walk ↔ viterbi share the codebooks) and starts from its own init elsewhere (then train it:
        `drafter.selector=NAME` in a training config)."""
        from dflash2.registry import SELECTORS

        if isinstance(selector, str):
            name, given = selector, None
        else:
            name, given = SELECTORS.name_of(type(selector)), selector
            if name is None:
                kind = type(selector).__qualname__
                raise ValueError(f"with_selector: {kind} is not registered; register it first (dflash2.register_selector("
                                 f"'my_name', {kind})) so that the drafter's config can name it")
        return self._reselect(self.config.replace(selector=name), self.state_dict(), given, fresh_ok=True)

    def _reselect(self, config: DFlash2Config, state: dict[str, Tensor], given, fresh_ok: bool) -> "DFlash2Drafter":
        """A copy of `config` (another selector) with `state`'s backbone and head; its selector (`given`, or
        the one its config builds) takes `state`'s selector tensors where names and shapes agree. A tensor
        left at its init is refused unless `fresh_ok` (untrained codebooks would draft as argmax does)."""
        from dflash2.drafter.selectors.contract import complete_selector

        copy, _ = self._copy(config, {k: v for k, v in state.items() if not k.startswith("candidate_selector.")},
                             strict=False)
        if given is not None:  # the object itself, not the fresh one its factory built
            weight = self.backbone.fc.weight
            copy.candidate_selector = complete_selector(given, config.selector)
            if isinstance(given, nn.Module):
                given.to(device=weight.device, dtype=weight.dtype)
        theirs = copy.state_dict()
        shared = {k: v for k, v in state.items() if k.startswith("candidate_selector.") and k in theirs
                  and theirs[k].shape == v.shape}
        untrained = sorted(k for k in theirs if k.startswith("candidate_selector.") and k not in shared)
        if untrained and not fresh_ok:
            raise ValueError(f"selector {config.selector!r} needs trained parameters that this drafter's "
                             f"{self.config.selector!r} selector does not have ({untrained}); with_selector("
                             f"{config.selector!r}) starts them from their init, for training")
        copy.load_state_dict(shared, strict=False)
        return copy

    def with_draft_vocab(self, token_ids: Tensor | list[int]) -> "DFlash2Drafter":
        """A copy whose LM head drafts among `token_ids` only (FR-Spec: e.g. `draft_vocab.most_frequent(
        counts, n)`), with the same weights. Drafting reads n rows of the target's head instead of V,
        and top-K runs over n logits; verification is unchanged, so outputs are still the target's own,
        only acceptance may drop where the target picks a token outside the set."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
        _check_draft_vocab(ids, self.config.vocab_size, self.config.selector_top_k)
        state = {k: v for k, v in self.state_dict().items() if k != "draft_vocab"}
        state["draft_vocab"] = ids.to(self.backbone.fc.weight.device)
        return self._copy(self.config.replace(draft_vocab_size=ids.numel()), state)[0]

    def _copy(self, config: DFlash2Config, state: dict[str, Tensor], strict: bool = True):
        """A new drafter of `config` on this one's device, dtype and train mode, loaded with `state`
        → (drafter, load_state_dict's missing/unexpected keys)."""
        weight = self.backbone.fc.weight
        copy = DFlash2Drafter(config).to(device=weight.device, dtype=weight.dtype).train(self.training)
        return copy, copy.load_state_dict(state, strict=strict)

    def grown(self, num_layers: int) -> "DFlash2Drafter":
        """A copy with `num_layers` backbone layers: this drafter's layers first, then new layers
        that start as the identity (their attention and MLP output projections zero, so both
        residual branches add nothing; the rest random). The copy drafts exactly what this one
        does, and training can then use the extra depth: how a fine-tune grows a drafter. The new
        layers take the last layer's attention type."""
        if num_layers < self.config.num_layers:
            raise ValueError(f"cannot grow a {self.config.num_layers}-layer drafter to {num_layers} layers")
        types = self.config.layer_types
        types = types + types[-1:] * (num_layers - len(types)) if types else ()  # new layers: the last one's type
        copy, (missing, unexpected) = self._copy(self.config.replace(num_layers=num_layers, layer_types=types),
                                                 self.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("backbone.layers.") for k in missing), (missing, unexpected)
        for layer in copy.backbone.layers[self.config.num_layers:]:
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)
        return copy

    # -- dflash2.interfaces: Drafter, TreeDrafter, BatchDrafter, CheckedDrafter --------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    def check_target(self, target: TargetAdapter) -> None:
        """The target must have the hidden size (the drafter's target_hidden_size, else its own),
        vocabulary and number of layers this drafter was built for."""
        c = self.config
        width = ("target_hidden_size", c.target_hidden_size) if c.target_hidden_size is not None else \
            ("hidden_size", c.hidden_size)
        for (name, ours), theirs in ((width, target.hidden_size), (("vocab_size", c.vocab_size), target.vocab_size),
                                     (("num_target_layers", c.num_target_layers), target.num_layers)):
            if ours != theirs:
                raise ValueError(f"drafter and target do not fit: drafter {name} = {ours}, target "
                                 f"{name.removeprefix('target_')} = {theirs}")

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def new_cache(self) -> ContextCache:
        return ContextCache()

    def new_context_batch(self) -> ContextBatch:
        """The context of a batch of rows for `propose_batch` / `propose_tree_batch` (no rows yet)."""
        return ContextBatch()

    @torch.no_grad()
    def propose(self, cache: ContextCache, anchor: int, new_features: Tensor, target: TargetAdapter,
                temperature: float, rng: RandomSource) -> Draft:
        """Extend the context by new_features [1, n, F] (positions cache.length..), then draft the
        block that starts with `anchor` at position cache.length. Returns L = B - 1 draft tokens
        (config.draft_len if set)."""
        if self.config.block_size == 1:
            self.backbone.extend_context(cache, new_features)
            return Draft(torch.zeros(0, dtype=torch.long, device=new_features.device))
        s = self.draft_round(cache, anchor, new_features, target, lattice=False)
        return self.candidate_selector(s.cands, s.hidden, anchor, temperature, rng, **self._reads(s.context))

    @torch.no_grad()
    def propose_batch(self, context: ContextBatch, anchors: list[int], new_features: list[Tensor],
                      target: TargetAdapter, temperature: float, rng: RandomSource) -> list[Draft]:
        """Row r as `propose(row r's cache, anchors[r], new_features[r], ...)`, every row in one
        backbone pass over the rows' shared context (a ContextBatch, its padding masked)."""
        L = self.config.num_draft_positions if self.config.block_size > 1 else 0
        self.backbone.extend_batch(context, new_features, self.config.block_size)
        if L == 0:
            return [Draft(torch.zeros(0, dtype=torch.long, device=f.device)) for f in new_features]
        s = self.draft_round_batch(context, anchors, new_features, target, L, lattice=False)
        selector = self.candidate_selector
        if temperature == 0:  # deterministic: all rows at once
            return selector.select_batch(s.cands, s.hidden, anchors, **self._reads(s.context))
        ctx = s.context
        return [selector(Candidates(s.cands.ids[r], s.cands.scores[r]), s.hidden[r], anchors[r], temperature, rng,
                         **self._reads(None if ctx is None else RoundContext(*(t[r] for t in ctx))))
                for r in range(len(anchors))]

    @torch.no_grad()
    def propose_tree(self, cache: ContextCache, anchor: int, new_features: Tensor, target: TargetAdapter,
                     max_nodes: int, max_depth: int) -> TokenTree:
        """Like `propose`, but returns the `max_nodes` most probable nodes of the B×K lattice (depth
        <= max_depth) as a token tree for `verify="tree"`. Deterministic at every temperature: the
        tree verifier's one-decision-per-node rule handles sampling."""
        L = min(self.config.num_draft_positions, max_depth, max_nodes)  # M nodes reach depth M at most
        if self.config.block_size == 1 or L <= 0:
            self.backbone.extend_context(cache, new_features)
            return TokenTree.empty(new_features.device)
        s = self.draft_round(cache, anchor, new_features, target)
        return best_first_tree(s.cands.ids[:L], s.first, s.steps[: L - 1], max_nodes)

    @torch.no_grad()
    def propose_tree_batch(self, context: ContextBatch, anchors: list[int], new_features: list[Tensor],
                           target: TargetAdapter, max_nodes: int, max_depths: list[int]) -> list[TokenTree]:
        """Row r as `propose_tree(row r's cache, anchors[r], new_features[r], target, max_nodes,
        max_depths[r])`, every row in one backbone pass (as `propose_batch`)."""
        self.backbone.extend_batch(context, new_features, self.config.block_size)
        depths = [min(self.config.num_draft_positions, d, max_nodes) for d in max_depths]  # M nodes: depth <= M
        L = max(depths)
        if L <= 0:
            return [TokenTree.empty(f.device) for f in new_features]
        s = self.draft_round_batch(context, anchors, new_features, target, L)  # [R, L, K], [R, L-1, K, K]
        return [best_first_tree(s.cands.ids[r, :d], s.first[r], s.steps[r, : d - 1], max_nodes) if d > 0
                else TokenTree.empty(f.device) for r, (d, f) in enumerate(zip(depths, new_features))]

    # -- one drafting round at batch 1 (propose, propose_tree): one call, one graph when compiled ------
    def compile(self, *args: Any, gemm: str = "auto", **kwargs: Any) -> None:
        """torch.compile the batch-1 drafting round in place (`draft_round`'s tensor work, `_round`):
        context projection, block pass, LM head, top-K and the lattice's scores run as one graph, one
        call per round. Arguments go to torch.compile; `dynamic=True` suits decoding, where the
        context grows every round. (`backbone.compile` compiles the block pass and the projection
        separately: two calls per round, and the batched path's passes.) `gemm` (dflash2.compile.gemm_choice):
        "inductor" (the default on CPU) freezes the drafter's weights, and the target's LM head it reads,
        into the graphs as constants: the graphs do not see later changes to them (compile after loading
        or training, and compile a copy per target)."""
        if args:
            raise TypeError("DFlash2Drafter.compile takes torch.compile's options as keywords")
        devices = {p.device for p in self.parameters()}
        gemm = gemm_choice(gemm, devices)  # (checked before anything changes)
        allow_recompiles(64)  # a graph per shape that specialises
        for device in devices:  # the rotary table as a decode finds it (a graph
            self.backbone.rotary.inverse_frequencies(device)     # traced before it is filled is traced again after)
        self._round = compile_own(self._round, **kwargs)
        self._round_batch = compile_own(self._round_batch, **kwargs)
        self._warmed, self._gemm = set(), gemm

    def _warm_up(self, target: TargetAdapter, like: Tensor, lattice: bool) -> None:
        """Compile the round's graphs before the first real round, on scratch caches, so that no
        compilation lands inside a timed decode: a first round (no context yet) over several features
        and over one, later rounds over several and over one, after a context of one (a one-token
        prompt) too. Sizes 0 and 1 of the context and of the features compile apart; the sizes between
        are dynamic."""
        self._warmed.add(lattice)
        done = announce_compiling("the drafter's round")
        features = lambda n: torch.zeros(1, n, like.shape[-1], dtype=like.dtype, device=like.device)  # noqa: E731
        with inductor_gemm(self._gemm):
            for sizes in ((3, 2, 1), (1, 1), (1, 2)):  # the features each round reads, from an empty context on
                scratch = self.new_cache()
                for n in sizes:
                    self.draft_round(scratch, 0, features(n), target, lattice)
        done()

    def _warm_up_batch(self, target: TargetAdapter, like: Tensor, lattice: bool) -> None:
        """`_warm_up` for the batched round, on scratch ContextBatches: at three rows and at one (a
        batch's last row), over contexts of one position and of several. like: a tensor of the real
        batch's context (its device and dtype)."""
        self._warmed.add(("batch", lattice))
        done = announce_compiling("the drafter's batched round")
        features = lambda n: torch.zeros(1, n, self.config.feature_size, dtype=like.dtype, device=like.device)  # noqa: E731
        with inductor_gemm(self._gemm):
            for rounds in (((1, 1, 1), (3, 2, 1), (1, 2, 1)), ((1,), (2,), (1,))):  # per round, each row's features
                scratch = self.new_context_batch()
                scratch.add_rows(len(rounds[0]))
                for sizes in rounds:
                    feats = [features(n) for n in sizes]
                    self.backbone.extend_batch(scratch, feats, self.config.block_size)
                    self.draft_round_batch(scratch, [0] * len(sizes), feats, target,
                                           self.config.num_draft_positions, lattice)
        done()

    def draft_round(self, cache: ContextCache, anchor: int, new_features: Tensor, target: TargetAdapter,
                    lattice: bool = True) -> "RoundScores":
        """Extend `cache` by new_features [1, n, F] (positions cache.length..), then score the block
        [anchor, MASK, ...] at the positions after them: RoundScores of its L = num_draft_positions
        draft positions (with the selector's lattice when `lattice`)."""
        B, device = self.config.block_size, new_features.device
        dtype = self.backbone.fc.weight.dtype
        if self._warmed is not None and lattice not in self._warmed:  # compiled, this kind not warmed up yet
            self._warm_up(target, new_features, lattice)
        if not cache.keys:  # the first round: no context yet
            empty = lambda: torch.zeros(1, self.config.num_key_value_heads, 0, self.config.head_dim,  # noqa: E731
                                        dtype=dtype, device=device)
            cache.keys, cache.values = [empty() for _ in self.backbone.layers], [empty() for _ in self.backbone.layers]
        start, n = cache.length, new_features.shape[1]
        window = self.config.context_keep
        kept = cache.keys[0].shape[2] + n  # the context entries the block sees: the kept ones and the new ones,
        kept = kept if window is None else min(kept, window)  # or the last `window` of them
        ids = torch.full((1, B), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor
        length = start + n  # the block's first position
        s = self._round(cache.keys, cache.values, new_features.to(dtype), torch.arange(start, length, device=device),
                        self.embed_block(ids, target), torch.arange(length, length + B, device=device),
                        torch.arange(length - kept, length + B, device=device),  # the context it sees, the block
                        self.head_weights(target, dtype), torch.tensor(anchor, device=device), lattice)
        # contiguous, as eager's concatenation gives them (a compiled first round may hand back a view of the
        # projection): a layout that changes from round to round would be a graph per layout
        cache.keys, cache.values = [k.contiguous() for k in s.keys], [v.contiguous() for v in s.values]
        cache.length = length
        if s.cands is None:  # a head with its own forward, or a selector that reads the round's context
            cands, first, steps, ctx = self._outside_graph(s.hidden, anchor, lambda: new_features[0, -1], target,
                                                           lattice)
            return s._replace(cands=cands, first=first, steps=steps, context=ctx)
        return s

    def _round(self, keys: list[Tensor], values: list[Tensor], features: Tensor, feature_positions: Tensor,
               x: Tensor, positions: Tensor, key_positions: Tensor, head: tuple[Tensor, Tensor | None] | None,
               anchor: Tensor, lattice: bool) -> "RoundScores":
        """The tensor work of `draft_round` (what `compile` compiles). keys/values: per layer the kept
        context [1, kv, C, hd]; features [1, n, F] at feature_positions [n]; x [1, B, H] the embedded
        block at positions [B]; key_positions [C + n + B]; head: the LM head (weight, bias) in the
        drafter's dtype, or None; anchor [] long. Returns the context K/V the next round starts from
        (the last `config.context_keep` entries when the drafter's layers need no more)."""
        new = self.backbone.context_kv(features, feature_positions)
        keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(keys, new)]  # [1, kv, C + n, hd]
        values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(values, new)]
        window = self.config.context_keep  # the block sees, and the cache keeps, only the last `window` (0: none)
        if window is not None:
            keys, values = [k[:, :, k.shape[2] - min(k.shape[2], window):] for k in keys], \
                           [v[:, :, v.shape[2] - min(v.shape[2], window):] for v in values]
        L = self.config.num_draft_positions
        hidden = self.backbone(x, positions, list(zip(keys, values)), rows=L + 1, key_positions=key_positions)[0, 1:]
        if head is None or self.candidate_selector.reads_context:
            return RoundScores(keys, values, hidden, None, None, None)  # [L, H]
        ids, scores = self.candidates(self._finish_logits(F.linear(hidden, *head)))  # [L, K]
        cands = Candidates(ids if self.draft_vocab is None else self.draft_vocab[ids], scores)
        first, steps = self.candidate_selector.lattice(cands, hidden, anchor) if lattice else (None, None)
        return RoundScores(keys, values, hidden, cands, first, steps)

    # -- one drafting round of a batch (propose_batch, propose_tree_batch): one graph when compiled ---
    def draft_round_batch(self, context: ContextBatch, anchors: list[int], new_features: list[Tensor] | None,
                          target: TargetAdapter, L: int, lattice: bool = True) -> "RoundScores":
        """Score the blocks [anchors[r], MASK, ...] of R rows after their contexts in `context` (already
        extended): RoundScores of the first L draft positions (hidden [R, L, H], candidates [R, L, K],
        with `lattice` the selector's lattice: first [R, K], steps [R, L-1, K, K]); keys and values None
        (the context stays in the ContextBatch). Row r's block sits at positions lengths[r].. and sees its
        own context (its last `context_window` positions) and its whole block, within each layer's layout.
        With a selector that reads the round's context, its RoundContext (the rows' anchors' states from
        `new_features`, their last positions)."""
        if self._warmed is not None and ("batch", lattice) not in self._warmed:  # compiled, not warmed up yet
            self._warm_up_batch(target, context.keys[0], lattice)
        R, B, device = len(anchors), self.config.block_size, context.keys[0].device
        dtype = self.backbone.fc.weight.dtype
        ids = torch.full((R, B), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.tensor(anchors, device=device)
        s = self._round_batch(context.keys, context.values, self.embed_block(ids, target),
                              torch.tensor(context.lengths, device=device)[:, None],
                              torch.arange(max(context.lengths), device=device), self.head_weights(target, dtype),
                              ids[:, 0], lattice)
        if s.cands is None:  # a head with its own forward, or a selector that reads the round's context
            hidden = s.hidden[:, :L]
            cands, first, steps, ctx = self._outside_graph(
                hidden, ids[:, 0], lambda: torch.cat([f[0, -1:] for f in new_features]), target, lattice)  # last: [R, F]
            return RoundScores(None, None, hidden, cands, first, steps, ctx)
        return RoundScores(None, None, s.hidden[:, :L], Candidates(s.cands.ids[:, :L], s.cands.scores[:, :L]),
                           s.first, None if s.steps is None else s.steps[:, : L - 1])

    def _outside_graph(self, hidden: Tensor, anchors, last: Callable[[], Tensor], target: TargetAdapter,
                       lattice: bool) -> tuple[Candidates, Tensor | None, Tensor | None, RoundContext | None]:
        """A round's candidates and lattice outside its graph, where the graph stops at the hidden states (a
        candidate head with its own forward, or a selector that reads the round's context): hidden [L, H]
        (batch 1) or [R, L, H]; anchors as the selector takes them (an int, or [R]); last() the features of
        the position before each anchor ([F] or [R, F]), read only by a selector that reads the round's
        context → (candidates, first, steps, that RoundContext or None)."""
        if self.candidate_selector.reads_context:
            cands, log_z = self.draft_candidates(hidden, target, with_log_z=True)
            ctx = self.round_context(cands, log_z, last(), target)
        else:
            cands, ctx = self.draft_candidates(hidden, target), None
        first, steps = self.candidate_selector.lattice(cands, hidden, anchors, **self._reads(ctx)) if lattice \
            else (None, None)
        return cands, first, steps, ctx

    def _round_batch(self, keys: list[Tensor], values: list[Tensor], x: Tensor, lengths: Tensor, key_slots: Tensor,
                     head: tuple[Tensor, Tensor | None] | None, anchors: Tensor, lattice: bool) -> "RoundScores":
        """The tensor work of `draft_round_batch` (what `compile` compiles), for every draft position.
        keys/values: per layer the ContextBatch's buffers [R, kv, capacity, hd], row r's context in slots
        0 .. lengths[r]-1 (slot = position); x [R, B, H] the embedded blocks; lengths [R, 1]; key_slots
        [C] the slots 0 .. C-1 of the longest context; head as in `_round`; anchors [R].

        The block's K/V are concatenated after the first C slots rather than written into the buffers:
        a compiled graph that writes into its inputs copies them back whole after every layer."""
        R, B, _ = x.shape
        C = key_slots.shape[0]
        positions = lengths + torch.arange(B, device=x.device)  # [R, B]
        visible = key_slots < lengths  # [R, C]: its own context
        if self.config.context_window is not None:
            visible = visible & (key_slots >= lengths - self.config.context_window)
        mask = torch.cat([visible, visible.new_ones(R, B)], 1)[:, None, None, :].expand(R, 1, B, C + B)
        key_positions = torch.cat([key_slots.expand(R, C), positions], 1)  # [R, C + B]
        context = [(k[:, :, :C], v[:, :, :C]) for k, v in zip(keys, values)]  # [R, kv, C, hd]
        L = self.config.num_draft_positions
        hidden = self.backbone(x, positions, context, mask, rows=L + 1, key_positions=key_positions)[:, 1:]
        if head is None or self.candidate_selector.reads_context:
            return RoundScores(None, None, hidden, None, None, None)  # [R, L, H]
        logits = F.linear(as_rows(hidden), *head).view(R, L, -1)  # (as rows: a 3-d slice multiplies as a batch)
        ids, scores = self.candidates(self._finish_logits(logits))  # [R, L, K]
        cands = Candidates(ids if self.draft_vocab is None else self.draft_vocab[ids], scores)
        first, steps = self.candidate_selector.lattice(cands, hidden, anchors) if lattice else (None, None)
        return RoundScores(None, None, hidden, cands, first, steps)

    def _candidates(self, cache: ContextCache, anchor: int, target: TargetAdapter, L: int) -> tuple[Tensor, Candidates]:
        """The first L draft positions of the block after `anchor`: hidden [L, H], candidates [L, K]."""
        hidden = self.block_hidden(cache, anchor, target, rows=L + 1)[0, 1:]  # [L, H]
        return hidden, self.draft_candidates(hidden, target)  # ids, U: [L, K]

    def draft_candidates(self, hidden: Tensor, target: TargetAdapter, with_log_z: bool = False):
        """hidden [..., H] → the top-K candidates (ids, U [..., K]) of each position: over the whole
        vocabulary, or over the draft vocabulary (its logits [..., V'], ids mapped back to token ids).
        with_log_z: (candidates, log Σ exp of each position's logits [...], float32)."""
        if with_log_z:
            if self.draft_vocab is not None:
                raise ValueError("the candidates' log-probabilities need the whole vocabulary: no draft vocabulary")
            logits = self.draft_logits(hidden, target)
            return self.candidates(logits), logits.float().logsumexp(-1)
        if self.draft_vocab is None:
            return self.candidates(self.draft_logits(hidden, target))
        ids, scores = self.candidates(self.draft_logits(hidden, target, vocab=self.draft_vocab))
        return Candidates(self.draft_vocab[ids], scores)

    def round_context(self, cands: Candidates, log_z: Tensor, last_features: Tensor, target: TargetAdapter) -> RoundContext:
        """What a selector that reads the round's context gets: cands [..., L, K], log_z [..., L], the
        target features of the position before each anchor last_features [..., F] → RoundContext."""
        dtype = self.backbone.fc.weight.dtype
        return RoundContext(log_z, self.backbone.fuse(last_features.to(dtype)), target.embed(cands.ids).to(dtype))

    def _reads(self, context: RoundContext | None) -> dict[str, RoundContext]:
        """The keyword a selector that reads the round's context is called with (none for the others)."""
        return {"context": context} if self.candidate_selector.reads_context else {}

    def embed_block(self, block_ids: Tensor, target: TargetAdapter) -> Tensor:
        """block ids [...] → [..., H]: rows of the embedding matrix (the drafter's own, else the target's)
        × input_embedding_scale."""
        if self.embed_tokens is not None:
            x = F.embedding(block_ids, self.embed_tokens.weight)
        else:
            x = target.embed(block_ids).to(self.backbone.fc.weight.dtype)
        scale = self.config.input_embedding_scale
        return x if scale is None else x * scale

    def head_weights(self, target: TargetAdapter, dtype: torch.dtype) -> tuple[Tensor, Tensor | None] | None:
        """The LM head the draft logits come from, as (weight [V or V', H], bias or None) in `dtype` (the
        draft vocabulary's rows when there is one): the drafter's own, else the target's (None for a
        target head with its own forward, which only `draft_logits` runs)."""
        if self.lm_head is None:
            return target.head_weights(dtype, self.draft_vocab)
        weight = self.lm_head.weight if self.draft_vocab is None else self.lm_head.weight[self.draft_vocab]
        return weight.to(dtype), None

    def draft_logits(self, hidden: Tensor, target: TargetAdapter, vocab: Tensor | None = None) -> Tensor:
        """hidden [..., H] → logits [..., V] through the LM head (the drafter's own, else the target's; or
        [..., V'] of the token ids `vocab` [V'] only), then the reference's output multiplier and
        soft-capping when configured."""
        if self.lm_head is None:
            return self._finish_logits(target.lm_logits(hidden, vocab))
        weight = self.lm_head.weight if vocab is None else self.lm_head.weight[vocab]
        return self._finish_logits(F.linear(hidden, weight))

    def candidate_logits(self, hidden: Tensor, cand: Tensor, target: TargetAdapter) -> Tensor:
        """hidden [..., H], cand [..., K] token ids → [..., K]: the draft logits of those tokens only
        (equal to draft_logits(hidden).gather(-1, cand), without the [..., V] logits)."""
        if self.lm_head is None:
            return self._finish_logits(target.lm_logits_at(hidden, cand))
        return self._finish_logits(torch.einsum("...h,...kh->...k", hidden, F.embedding(cand, self.lm_head.weight)))

    def _finish_logits(self, logits: Tensor) -> Tensor:
        """The reference's output multiplier and soft-capping, when configured."""
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def block_hidden(self, cache: ContextCache, anchor: int, target: TargetAdapter, rows: int | None = None) -> Tensor:
        """Hidden states [1, B, H] of the block [anchor, MASK, ...] at positions cache.length.., or of
        its first `rows` positions only ([1, rows, H]; the same values, less work)."""
        B, device = self.config.block_size, cache.keys[0].device
        ids = torch.full((1, B), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor
        positions = torch.arange(cache.length, cache.length + B, device=device)
        keys = torch.arange(cache.length - cache.keys[0].shape[2], cache.length + B, device=device)  # kept context, block
        x = self.embed_block(ids, target)  # [1, B, H]
        return self.backbone(x, positions, list(zip(cache.keys, cache.values)), rows=rows, key_positions=keys)


def _local_directory(name: str | Path) -> Path:
    """`name` itself when it exists; else, for a hub id, its snapshot (cached, or fetched)."""
    path = Path(name)
    text = str(name)
    if path.exists() or not looks_like_hub_id(text):
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as error:  # offline and not cached, a typo, a gated repo: one line that names the id
        raise FileNotFoundError(hub_failure(text, error)) from None


def _check_draft_vocab(ids: Tensor, vocab_size: int, top_k: int) -> None:
    """A draft vocabulary is distinct, sorted token ids of the target, at least top-K of them."""
    if ids.dtype != torch.long or ids.dim() != 1:
        raise ValueError(f"a draft vocabulary is a 1-d long tensor of token ids, got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() < top_k:
        raise ValueError(f"a draft vocabulary needs at least selector_top_k = {top_k} token ids, got {ids.numel()}")
    if bool((ids < 0).any() | (ids >= vocab_size).any()):
        raise ValueError(f"draft vocabulary token ids must lie in 0..{vocab_size - 1}")
    if bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError("draft vocabulary token ids must be distinct (and are kept sorted)")


def _rope_parameters(config) -> dict[str, Any]:
    """The target's RoPE parameters (transformers 5 `rope_parameters`, or the older `rope_theta` +
    `rope_scaling`). Per-layer-type parameters (Gemma 3) give the full-attention layers' entry."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    params = {k: v for k, v in dict(params).items() if k != "type"}
    params["rope_type"] = params.get("rope_type") or (getattr(config, "rope_scaling", None) or {}).get("type", "default")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    params["rope_theta"] = float(theta or 10000.0)
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = float(partial)
    if params.get("partial_rotary_factor") == 1.0:
        params.pop("partial_rotary_factor")
    return params
