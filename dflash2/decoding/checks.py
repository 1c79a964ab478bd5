"""The argument checks shared by spec_generate and spec_generate_batch: a clear error before any pass."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from dflash2.interfaces import CheckedDrafter, Drafter, TreeDrafter
from dflash2.decoding.sealed import SealedDrafts
from dflash2.targets.adapter import TargetAdapter


def looks_like_hub_id(name: str | Path) -> bool:
    """owner/name as the Hugging Face hub spells a repository: what a missing local path is not."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(name)) is not None


def hub_failure(name: str, error: BaseException) -> str:
    """One line for a hub id that could not be read: the id and why (offline and not in the local
    cache, no such repository, a gated one), where the hub client's own message names neither."""
    from huggingface_hub import constants, errors

    chain, e = [], error
    while e is not None and len(chain) < 8:  # transformers wraps the hub's error in an OSError
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(str(e) for e in chain)
    if any(isinstance(e, errors.GatedRepoError) for e in chain):
        why = "it is a gated repository: accept its terms on the hub and log in (hf auth login)"
    elif any(isinstance(e, errors.RepositoryNotFoundError) for e in chain) or "not a valid model identifier" in text:
        why = "the hub has no such repository (a typo, or a private one: log in)"
    elif constants.HF_HUB_OFFLINE or "outgoing traffic has been disabled" in text:
        why = "offline (HF_HUB_OFFLINE is set): it is not in the local Hugging Face cache"
    elif any(isinstance(e, errors.LocalEntryNotFoundError) for e in chain) or "couldn't connect" in text:
        why = "offline (the hub cannot be reached): it is not in the local Hugging Face cache"
    else:
        why = f"reading it from the hub failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return f"{name}: not a local directory, and {why}"


def from_pretrained(load, name: str | Path, **kwargs):
    """`load(name, **kwargs)` (an HF from_pretrained); a hub id that cannot be read → OSError naming it."""
    try:
        return load(name, **kwargs)
    except OSError as error:
        if Path(name).exists() or not looks_like_hub_id(name):
            raise
        raise OSError(hub_failure(str(name), error)) from None


def adapt_target(drafter: Drafter, target) -> TargetAdapter:
    """The target behind a TargetAdapter that reads the drafter's layers, once the pair is checked."""
    if not isinstance(drafter, Drafter):
        swapped = " (are drafter and target swapped? the drafter comes first)" if isinstance(target, Drafter) else ""
        raise TypeError(f"drafter must be a dflash2.Drafter (block_size, target_layer_ids, new_cache, propose), "
                        f"got {type(drafter).__name__}{swapped}")
    if not isinstance(drafter.block_size, int) or drafter.block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {drafter.block_size!r}")
    tgt = target if isinstance(target, TargetAdapter) else TargetAdapter(target, drafter.target_layer_ids)
    if tgt.layer_ids != tuple(drafter.target_layer_ids):
        raise ValueError(f"the target adapter reads layers {tgt.layer_ids}, the drafter wants {drafter.target_layer_ids}")
    if isinstance(drafter, CheckedDrafter):
        drafter.check_target(tgt)
    return tgt


def check_prompt(input_ids, tgt: TargetAdapter, max_new_tokens) -> Tensor:
    """input_ids [1, T] or [T] long → [1, T] on the target's device."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor, got {type(input_ids).__name__}")
    if input_ids.dtype != torch.long:
        raise TypeError(f"input_ids must have dtype torch.long, got {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, T] (batch 1), got {list(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: input_ids needs at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= tgt.vocab_size:
        raise ValueError(f"input_ids hold token ids outside the target vocabulary [0, {tgt.vocab_size})")
    limit = tgt.max_positions
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"target's {limit} positions (the maximum positions of its config)")
    return input_ids.to(tgt.device)


def check_batch(input_ids, attention_mask, tgt: TargetAdapter, max_new_tokens) -> list[Tensor]:
    """Left-padded input_ids [N, T] (attention_mask [N, T] or None) → the rows' prompts without padding."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise TypeError("input_ids must be a torch.LongTensor of shape [N, T]")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids holds no rows")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}, input_ids {list(input_ids.shape)}")
    mask = attention_mask.bool().cpu()
    if (mask[:, 1:].long() < mask[:, :-1].long()).any():
        raise ValueError("attention_mask must be left padding: zeros, then ones, in every row")
    if not mask[:, -1].all():
        raise ValueError("every row needs at least one prompt token")
    # each row's own prompt checks: dtype, vocabulary, budget, maximum positions
    return [check_prompt(row[m], tgt, max_new_tokens)[0] for row, m in zip(input_ids.cpu(), mask)]


def check_verify(verify: str, tree_nodes: int, drafter: Drafter, tgt: TargetAdapter) -> None:
    if verify not in ("path", "tree"):
        raise ValueError(f"verify must be 'path' or 'tree', got {verify!r}")
    if verify == "path":
        return
    if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 1:
        raise ValueError(f"tree_nodes must be an integer >= 1, got {tree_nodes!r}")
    if not isinstance(drafter, TreeDrafter):
        raise ValueError(f"verify='tree' needs a dflash2.TreeDrafter (propose_tree); {type(drafter).__name__} is not")
    if tgt.hybrid:
        raise ValueError("verify='tree' needs an attention-only target: this one has linear_attention layers, whose "
                         "single recurrent state cannot follow several branches; use verify='path'")


def check_policy(policy) -> None:
    from dflash2.interfaces import VerifyPolicy

    if policy is None:
        return
    if not isinstance(policy, VerifyPolicy):
        raise ValueError(f"policy must be a dflash2.VerifyPolicy (drafts, widths, observe), got {type(policy).__name__}")


def apply_policy(policy, drafts: list, draft_s: float) -> list:
    """Each draft truncated to the width the policy picks (all of it without a policy): a path's first
    tokens, a tree's first nodes. The policy sees the drafts sealed (dflash2.decoding.sealed): their lengths and
    confidences revealed as a stopping rule allows, never their tokens."""
    if policy is None:
        return drafts
    view = SealedDrafts(drafts)
    widths = view.check(policy.widths(view, draft_s))
    return [d.truncate(w) for d, w in zip(drafts, widths)]


def check_concurrency(concurrency) -> None:
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise ValueError(f"concurrency must be a positive int or None, got {concurrency!r}")


def check_stops(stop_token_ids, vocab_size: int) -> frozenset[int]:
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    stops = frozenset(int(t) for t in stop_token_ids)
    bad = sorted(t for t in stops if not 0 <= t < vocab_size)
    if bad:
        raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    return stops
