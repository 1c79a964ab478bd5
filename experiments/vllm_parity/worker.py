"""The vLLM half of experiments/vllm_parity/run.py: runs in a vLLM 0.32 venv (never imports dflash2).

    VLLM_PYTHON worker.py CASES.pt THEIRS.pt TARGET_DIR

For every case (an exported drafter directory and the inputs run.py drew), builds vLLM's own model
class for it on the CPU (DFlash2Qwen3ForCausalLM, Qwen3DSparkForCausalLM or LiLiCorrForCausalLM, as
vLLM's registry names them from the file's `architectures`), loads the file with the class's own
`load_weights`, and runs vLLM's own code on the inputs: the grouped convolution around each sublayer
(its CPU path), the candidate top-K (`compute_candidates`), the DFlash 2 edge scores
(`CandidateSelector` / `_score_edges`), DSpark's Markov head and confidence head in the order its
speculator calls them (`_sample_sequential_topk` at T = 0), LiLiCorr's lattice scores (`LiLiCorrHead`).
The draft's attention layers are not run (their CPU backend needs the engine's forward context);
tests/engines/test_vllm_layouts.py checks how vLLM resolves their layout.
"""

from __future__ import annotations

import os
import sys


def walk_greedy(scores):
    """The published walk at T = 0 over vLLM's [N, L, K, K] scores (row 0 of step 0: the anchor's; its
    rows all agree), as _selector_walk_kernel reads them: the best successor of the current pick."""
    import torch

    N, L, K, _ = scores.shape
    pick = scores[:, 0, 0].argmax(-1)
    picks = [pick]
    rows = torch.arange(N)
    for t in range(1, L):
        pick = scores[rows, t, pick].argmax(-1)
        picks.append(pick)
    return torch.stack(picks, 1)


def build(directory: str, target: str):
    import torch
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    # The V1 runner refuses candidate-head drafts and the V2 runner needs Triton; only the model class is
    # built here, never a runner, so the refusal is lifted for this process.
    VllmConfig._validate_v1_model_runner = lambda self: None
    import json

    arch = json.load(open(os.path.join(directory, "config.json")))["architectures"][0]
    method = {"DFlash2DraftModel": "dflash", "LiLiCorrDraftModel": "dflash", "Qwen3DSparkModel": "dspark"}[arch]
    cfg = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=512,
                     speculative_config={"method": method, "model": directory, "num_speculative_tokens": 15},
                     ).create_engine_config()
    from vllm.model_executor.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls([arch], cfg.speculative_config.draft_model_config)
    with set_current_vllm_config(cfg):
        if not torch.distributed.is_initialized():  # one process, one rank: what the layers' groups need
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 400}")
            initialize_model_parallel(1, 1)
        return cls(vllm_config=cfg, prefix=""), cfg, cls.__name__


def main() -> int:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    cases, out_path, target = torch.load(sys.argv[1]), sys.argv[2], sys.argv[3]
    target_weights = load_file(os.path.join(target, "model.safetensors"))
    theirs = {}
    for name, case in cases.items():
        model, cfg, cls_name = build(case["dir"], target)
        with set_current_vllm_config(cfg), torch.no_grad():
            for p in model.parameters():
                p.data.fill_(float("nan"))  # what load_weights leaves unset stays NaN
            exported = load_file(os.path.join(case["dir"], "model.safetensors"))
            loaded = model.load_weights(iter(exported.items()))
            # embed_tokens and lm_head: the file's own when it ships them, else the target's (the runner
            # shares the target's then, as it does here)
            embed = target_weights["model.embed_tokens.weight"]
            if "embed_tokens.weight" not in exported:
                model.model.embed_tokens.weight.data.copy_(embed)
            if "lm_head.weight" not in exported:
                model.lm_head.weight.data.copy_(target_weights.get("lm_head.weight", embed))
            # as vLLM's loader does after load_weights: each layer's CPU GEMM (and any packing) is set up here
            process_weights_after_loading(model, cfg.speculative_config.draft_model_config, torch.device("cpu"))
            unused = set() if model.model.has_separate_mask_embedding else {"model.mask_embedding"}  # read only when
            # the checkpoint ships mask_embedding.pt; ours use the embedding row of mask_token_id, as the reference
            unset = sorted(n for n, p in model.named_parameters()
                           if n not in unused and p.is_floating_point() and torch.isnan(p).any())
            r = dict(cls=cls_name, exported=len(exported), loaded=len(loaded) if loaded is not None else None,
                     unset=unset)
            m = model.model
            r["fuse"] = m.hidden_norm(m.fc(case["features"]))  # fc, then the norm the context K/V precompute applies
            if "conv" in case:  # per layer: conv(W)(x) around a fixed linear map, conv(mlp)(x) around the layer's MLP
                x, mats = case["conv"]["x"], case["conv"]["maps"]
                outs = []
                for i, layer in enumerate(m.layers):
                    y, c = layer.attention_conv.prepare(x)
                    attn_side = layer.attention_conv.finish(y @ mats[i], c)
                    y, c = layer.mlp_conv.prepare(x)
                    mlp_side = layer.mlp_conv.finish(layer.mlp(y), c)
                    outs.append((attn_side, mlp_side))
                r["conv"] = outs
            hidden = case["hidden"]  # [N, L, H]
            N, L, H = hidden.shape
            flat = hidden.reshape(N * L, H)
            if cls_name == "LiLiCorrForCausalLM":
                values, ids = _top_k(model.compute_candidates(flat))
                r["cand_ids"], r["cand_scores"] = ids.view(N, L, -1), values.view(N, L, -1)  # log-probs
                anchor_hidden = m.hidden_norm(m.fc(case["last_features"]))  # as prepare_context_anchor
                ids_ours = case["cand_ids"]
                target_embed = torch.nn.functional.embedding(ids_ours, embed)  # the speculator's: the target's
                scores = m.lilicorr(target_embed, case["cand_logp"], hidden, anchor_hidden,
                                    torch.ones(N, dtype=torch.bool))
                r["scores"] = scores
                r["path"] = walk_greedy(scores)
            elif cls_name == "DFlash2Qwen3ForCausalLM":
                values, ids = _top_k(model.compute_candidates(flat))
                r["cand_ids"], r["cand_scores"] = ids.view(N, L, -1), values.view(N, L, -1)
                scores = m.candidate_selector(case["cand_ids"], case["cand_scores"], hidden, case["anchors"])
                r["scores"] = scores
                r["path"] = walk_greedy(scores)
            else:  # DSpark: its speculator's _sample_sequential_topk at T = 0
                base = model.compute_draft_logits(flat).view(N, L, -1)
                k = cfg.speculative_config.draft_model_config.hf_config.dspark_draft_topk
                values, index = base.topk(k, dim=-1)
                r["cand_ids"], r["cand_scores"] = index, values
                logits = torch.full_like(base, float("-inf"))
                prev, embeds, tokens, corrected = case["anchors"], [], [], []
                for i in range(L):
                    e = model.markov_embed(prev)
                    embeds.append(e)
                    row = model.apply_markov_bias_gathered(e, logits[:, i], values[:, i], index[:, i])
                    corrected.append(row.gather(1, index[:, i]))
                    prev = row.argmax(-1)
                    tokens.append(prev)
                r["tokens"] = torch.stack(tokens, 1)
                r["corrected"] = torch.stack(corrected, 1)  # [N, L, K]: the step's scores of its candidates
                if m.confidence_head is not None:
                    r["confidence"] = model.compute_confidence(flat, torch.stack(embeds, 1).flatten(0, 1)).view(N, L)
            theirs[name] = r
        print(f"{name}: {cls_name}, {r['exported']} exported tensors, unset {r['unset']}", flush=True)
    torch.save(theirs, out_path)
    return 0


def _top_k(out):
    """compute_candidates returns (values, ids) or (ids, values): ids are the integer tensor."""
    a, b = out[0], out[1]
    return (b, a) if not a.is_floating_point() else (a, b)


if __name__ == "__main__":
    sys.exit(main())
