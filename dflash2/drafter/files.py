"""A drafter's files and copies: built for a target, written and read in our layout or the published one
(`reference_format`), copied with another config, selector, draft vocabulary or depth. `DrafterFiles` is
a mixin of `DFlash2Drafter`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from dflash2.config import DFlash2Config
from dflash2.decoding.checks import hub_failure, looks_like_hub_id
from dflash2.drafter import reference_format
from dflash2.targets.adapter import TargetAdapter

if TYPE_CHECKING:
    from dflash2.interfaces import Selector

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
ARCHITECTURE = "DFlash2Drafter"


class DrafterFiles:
    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: nn.Module, **fields: Any) -> Self:
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
                        dtype: torch.dtype | None = None) -> Self:
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

    def with_config(self, **changes: Any) -> Self:
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

    def with_selector(self, selector: "str | Selector") -> Self:
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

    def _reselect(self, config: DFlash2Config, state: dict[str, Tensor], given, fresh_ok: bool) -> Self:
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

    def with_draft_vocab(self, token_ids: Tensor | list[int]) -> Self:
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
        copy = type(self)(config).to(device=weight.device, dtype=weight.dtype).train(self.training)
        return copy, copy.load_state_dict(state, strict=strict)

    def grown(self, num_layers: int) -> Self:
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
