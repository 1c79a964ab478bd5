"""What a pass costs on the real pair (SmolLM2-135M-Instruct), against this machine's bounds: the target's
verify-cost curve, a drafting round by drafter depth and draft vocabulary, and a training step by the same.

    python experiments/real_target/costs.py [--part verify verify8 draft train] [--out docs/results/real_target/costs.json]
    python experiments/real_target/costs.py --part train_flops --depths 1 2 --vocabs full 8192 \
        --out docs/results/real_target/train_flops.json

Run it quiet (../shared/tools/quiet first; nothing else running). Every number is a median over repeats,
the variants of a part interleaved. Bounds: weight bytes / the measured read bandwidth, and FLOPs / the
measured GEMM throughput of the same dtype, whichever is larger.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import DFlash2Drafter, StaticTarget, TargetAdapter, TorchRandom  # noqa: E402
from dflash2.targets.gguf import resolve_target  # noqa: E402
from dflash2.train.forward import drafter_losses, masked_block_forward, sample_masked_anchors  # noqa: E402

sys.path.insert(0, str(ROOT / "experiments" / "performance"))
from roofline import timed  # noqa: E402  (the median of repeated calls, as the embedded roofline times)

CONTEXT = 300  # cached positions before a measured pass: a typical answer's middle


def median_ms(fn, repeats: int, warm: int = 3) -> float:
    return 1e3 * timed(fn, repeats, warm)


def bandwidth_gbs() -> float:
    x = torch.ones(64 * 2**20)  # 256 MB
    return x.numel() * 4 / median_ms(lambda: x.sum(), 10) / 1e6


def gemm_gflops(dtype: torch.dtype) -> float:
    a, b = torch.randn(512, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    return 2 * 512 * 576 * 1536 / median_ms(lambda: torch.nn.functional.linear(a, b), 30) / 1e6


def load_target():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_target("smollm2"), dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def verify_curve(model, repeats: int, compile: bool = False) -> dict:
    """ms of one target pass of w tokens after CONTEXT cached ones, batch 1, float32 and bfloat16 products
    (compile: the StaticTarget's step through torch.compile, as the bench runs it)."""
    widths = (1, 2, 4, 8, 16, 32, 64)
    out = {}
    targets = {name: StaticTarget(model, capacity=CONTEXT + 80, linear_dtype=dt, compile=compile)
               for name, dt in (("float32", None), ("bfloat16", "bfloat16"))}
    prompt = torch.randint(100, 40000, (1, CONTEXT))
    caches = {}
    for name, t in targets.items():
        caches[name] = t.new_cache()
        t.forward(prompt, caches[name], keep_logits=1)
    for w in widths:
        ids = torch.randint(100, 40000, (1, w))
        for name, t in targets.items():
            cache = caches[name]

            def one():
                t.forward(ids, cache)
                t.crop(cache, CONTEXT)
            out.setdefault(name, {})[w] = median_ms(one, repeats)
    params = sum(p.numel() for n, p in model.named_parameters())
    layer_params = params - model.get_input_embeddings().weight.numel()  # the embedding is read by row
    head = model.get_output_embeddings().weight.numel()  # tied: read whole by the LM head
    return {"ms": out, "weights_read": {"float32": 4 * (layer_params + head), "bfloat16": 2 * (layer_params + head)},
            "flops_per_token": 2 * (layer_params + head)}


@torch.no_grad()
def verify_curve_rows(model, rows: int, repeats: int, compile: bool = False) -> dict:
    """ms of one padded target pass over [rows, 1 + n] after CONTEXT cached positions per row (bfloat16
    products), by tokens a row: what a batched round's verification costs (policy.cost.profile_verify_batch)."""
    from dflash2.policy.cost import profile_verify_batch

    target = StaticTarget(model, linear_dtype="bfloat16", compile=compile)
    cost = profile_verify_batch(target, rows, sizes=(0, 1, 3, 7, 15, 31, 63), context=CONTEXT, repeats=repeats)
    return {"rows": rows, "ms": {tokens // rows: 1e3 * s for tokens, s in cost.points}}


@torch.no_grad()
def draft_costs(model, repeats: int, depths, vocabs) -> dict:
    """ms of one drafting round (B = 16, greedy walk, K = 8) by depth and draft vocabulary, float32."""
    out = {}
    rng = TorchRandom(torch.Generator().manual_seed(0))
    for depth in depths:
        torch.manual_seed(0)
        base = DFlash2Drafter.from_target(model, block_size=16, num_layers=depth, mask_token_id=0, conv="two_tap",
                                          selector="walk", selector_top_k=8, selector_rank=64).eval()
        adapter = TargetAdapter(model, base.target_layer_ids)
        F = len(base.target_layer_ids) * model.config.hidden_size
        context = torch.randn(1, CONTEXT, F)
        for vocab in vocabs:
            d = base if vocab is None else base.with_draft_vocab(torch.arange(vocab))
            cache = d.new_cache()
            d.backbone.extend_context(cache, context)
            one_feature = torch.randn(1, 1, F)

            def round_():  # (the context grows by one position a round: a few dozen in all)
                d.propose(cache, 42, one_feature, adapter, 0.0, rng)
            out[f"{depth}L/{vocab or 'full'}"] = median_ms(round_, repeats)
    return out


def train_steps(model, depths, vocabs, autocasts):
    """(key "depth/vocab/autocast", one optimiser step, its cached features' elements) for 8 sequences of
    520 tokens, 64 anchors each, B = 16, features given (the cache's case)."""
    g = torch.Generator().manual_seed(0)
    N, T = 8, 520
    ids = torch.randint(100, 40000, (N, T), generator=g)
    label_mask = torch.zeros(N, T, dtype=torch.bool)
    label_mask[:, 200:] = True
    anchors, valid = sample_masked_anchors(label_mask, torch.full((N,), T), 16, 64, g)
    for depth in depths:
        torch.manual_seed(0)
        base = DFlash2Drafter.from_target(model, block_size=16, num_layers=depth, mask_token_id=0, conv="two_tap",
                                          selector="walk", selector_top_k=8, selector_rank=64)
        adapter = TargetAdapter(model, base.target_layer_ids)
        feats = torch.randn(N, T, len(base.target_layer_ids) * 576)
        for vocab in vocabs:
            d = (base if vocab is None else base.with_draft_vocab(torch.arange(vocab))).train()
            opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-4)
            for cast in autocasts:
                ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if cast == "bf16" else torch.enable_grad

                def step(d=d, opt=opt, ctx=ctx, adapter=adapter, feats=feats):
                    opt.zero_grad(set_to_none=True)
                    with ctx():
                        o = masked_block_forward(d, adapter, ids, feats, anchors, label_mask=label_mask, valid=valid,
                                                 logits=False)
                        loss = drafter_losses(d, adapter, o, gamma=7.0, selector_alpha=0.1).total
                    loss.backward()
                    opt.step()
                yield f"{depth}L/{vocab or 'full'}/{cast}", step, feats.numel()


def train_costs(model, repeats: int, depths, vocabs, autocasts) -> dict:
    """ms of one optimiser step by depth, draft vocabulary and autocast (train_steps)."""
    return {key: median_ms(step, repeats, warm=1) for key, step, _ in train_steps(model, depths, vocabs, autocasts)}


def train_flops(model, depths, vocabs) -> dict:
    """GFLOP of one optimiser step, forward and backward (torch's FLOP counter: matrix products and
    attention), and the MB of cached features (bfloat16) it reads, by depth and draft vocabulary."""
    from torch.utils.flop_counter import FlopCounterMode

    out = {}
    for key, step, features in train_steps(model, depths, vocabs, ["none"]):
        with FlopCounterMode(display=False) as counter:
            step()
        out[key.rsplit("/", 1)[0]] = {"gflop": counter.get_total_flops() / 1e9, "feature_mb": features * 2 / 1e6}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", default=["verify", "verify8", "draft", "train"],
                   choices=["verify", "verify8", "draft", "train", "train_flops"])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--vocabs", nargs="+", default=["full", "16384", "8192", "4096"])
    p.add_argument("--compile", action="store_true", help="the target's step compiled (minutes of warm-up)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "real_target" / "costs.json")
    args = p.parse_args()
    vocabs = [None if v == "full" else int(v) for v in args.vocabs]
    model = load_target()
    record = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "load_before": os.getloadavg()}
    if set(args.part) - {"train_flops"}:  # the machine's bounds, beside the timed parts
        record["bandwidth_gbs"] = bandwidth_gbs()
        record["gemm_gflops"] = {"float32": gemm_gflops(torch.float32), "bfloat16": gemm_gflops(torch.bfloat16)}
    if "verify" in args.part:
        record["verify"] = verify_curve(model, args.repeats, args.compile)
        record["verify"]["compiled"] = args.compile
    if "verify8" in args.part:
        record["verify_8_rows"] = verify_curve_rows(model, 8, max(3, args.repeats // 3), args.compile)
    if "draft" in args.part:
        record["draft_round_ms"] = draft_costs(model, args.repeats, args.depths, vocabs)
    if "train" in args.part:
        record["train_step_ms"] = train_costs(model, max(3, args.repeats // 5), args.depths, vocabs, ["none", "bf16"])
    if "train_flops" in args.part:  # counted, not timed
        record["train_step_gflop"] = train_flops(model, args.depths, vocabs)
    record["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
