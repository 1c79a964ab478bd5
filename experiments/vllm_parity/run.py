"""Parity with vLLM 0.32's own code: our exported DFlash-2, DSpark and LiLiCorr drafters loaded by vLLM's
model classes, and vLLM's CPU code run on the same inputs as ours.

    python experiments/vllm_parity/run.py --vllm-python VENV/bin/python [--out docs/results/vllm_parity]

VENV is a venv with vLLM's CPU build (docs/compatibility.md, "vLLM on the CPU"). For each variant a
drafter on the embedded target, every parameter drawn at random (so that no term is zero, as the
selectors and the convolution are at init), is exported with `save_pretrained(format="reference")`;
experiments/vllm_parity/worker.py, run by VENV's python, builds vLLM's class for the file, loads it
with the class's own `load_weights` (every parameter must be set by it) and runs vLLM's code on the
inputs drawn here. Compared in float32:

* conv:       per layer, the grouped convolution around a fixed linear map (the attention side) and
              around the layer's own MLP (vLLM's Qwen3MLP against our SwiGLU): max |Δ|
* fuse:       the target features' projection and norm (hidden_norm(fc(x)), x of len(target_layer_ids)
              × the target's width): max |Δ|
* candidates: the LM head's top-K ids (equal) and values (max |Δ|; log-probabilities for LiLiCorr)
* scores:     DFlash 2: `CandidateSelector` (its `_score_edges`) against our lattice; LiLiCorr:
              `LiLiCorrHead` against ours; DSpark: the Markov-corrected candidate scores of each step
* path:       the greedy path (DFlash 2 and LiLiCorr: the published walk over vLLM's scores; DSpark:
              its speculator's sequential argmax over its corrected scores) equal to ours
* confidence: DSpark's `compute_confidence` against our Draft.confidence: max |Δ|

Writes OUT/parity.json and OUT/parity.md. tests/engines/test_vllm_parity.py runs the same with
DFLASH2_VLLM_PYTHON set (skipped in CI, which has no vLLM).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import DFlash2Drafter, TargetAdapter  # noqa: E402
from dflash2.embedded import embedded_path  # noqa: E402

VARIANTS = {
    "DFlash-2 (walk)": dict(conv="two_tap", selector="walk"),
    "DSpark (confidence head, Markov input)": dict(conv="none", selector="dspark", confidence_head=True,
                                                   confidence_with_markov=True),
    "DSpark (confidence head)": dict(conv="none", selector="dspark", confidence_head=True),
    "LiLiCorr (DFlash-1 backbone)": dict(conv="none", selector="lilicorr"),
    "LiLiCorr (DFlash-2 backbone)": dict(conv="two_tap", selector="lilicorr"),
    # narrower than the target (target_hidden_size): its own embed_tokens and lm_head ship in the file
    "DFlash-2, half the target's width": dict(conv="two_tap", selector="walk", hidden_size=128, num_attention_heads=4,
                                              num_key_value_heads=2),
    "LiLiCorr with its own LM head": dict(conv="none", selector="lilicorr", own_lm_head=True),
}
TOLERANCE = 1e-5  # float32 agreement asked of every compared tensor (relative to its scale, below)


def drafter_for(fields: dict, model, seed: int) -> DFlash2Drafter:
    torch.manual_seed(seed)
    d = DFlash2Drafter.from_target(model, block_size=16, num_layers=2, mask_token_id=1, selector_top_k=16,
                                   selector_rank=32, lilicorr_factor_dim=32, lilicorr_num_layers=1, **fields)
    with torch.no_grad():  # every parameter away from its init (zeros and ones make terms vanish)
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d.eval()


def cases(out_dir: Path, seed: int = 0) -> tuple[dict, dict]:
    """Export every variant and draw its inputs; returns (cases for the worker, our outputs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_path("target"), dtype=torch.float32).eval()
    target = TargetAdapter(model)
    all_cases, ours = {}, {}
    for i, (name, fields) in enumerate(VARIANTS.items()):
        d = drafter_for(fields, model, seed + i)
        directory = out_dir / f"variant{i}"
        d.save_pretrained(directory, format="reference")
        g = torch.Generator().manual_seed(seed + 100 + i)
        N, L, H, B = 2, d.block_size - 1, d.config.hidden_size, d.block_size
        case: dict = dict(dir=str(directory))
        mine: dict = {}
        with torch.no_grad():
            if d.config.conv == "two_tap":
                x = torch.randn(N * B, H, generator=g)
                maps = [torch.randn(H, H, generator=g) / H ** 0.5 for _ in d.backbone.layers]
                case["conv"] = dict(x=x, maps=maps)
                mine["conv"] = [(layer.attention_conv(x.view(N, B, H), lambda t, w=w: t @ w).reshape(N * B, H),
                                 layer.mlp_conv(x.view(N, B, H), layer.mlp).reshape(N * B, H))
                                for layer, w in zip(d.backbone.layers, maps)]
            hidden = torch.randn(N, L, H, generator=g)
            anchors = torch.randint(2, d.config.vocab_size, (N,), generator=g)
            features = torch.randn(N, d.backbone.fc.in_features, generator=g)
            case.update(hidden=hidden, anchors=anchors, features=features)
            mine["fuse"] = d.backbone.fuse(features)
            sel = d.candidate_selector
            if d.config.selector == "lilicorr":
                cands, log_z = d.draft_candidates(hidden, target, with_log_z=True)
                last = torch.randn(N, d.backbone.fc.in_features, generator=g)
                ctx = d.round_context(cands, log_z, last, target)
                first, steps = sel.scores(cands, hidden, ctx)
                logp = cands.scores - log_z[..., None]
                case.update(cand_ids=cands.ids, cand_logp=logp, last_features=last)
                mine.update(cand_ids=cands.ids, cand_scores=logp, first=first, steps=steps,
                            path=[dr.tokens for dr in sel.select_batch(cands, hidden, anchors.tolist(), context=ctx)])
            elif d.config.selector == "dspark":
                cands = d.draft_candidates(hidden, target)
                drafts = sel.select_batch(cands, hidden, anchors.tolist())
                first, steps = sel.lattice(cands, hidden, anchors)
                tokens = torch.stack([dr.tokens for dr in drafts])
                index = (cands.ids == tokens[..., None]).float().argmax(-1)  # [N, L]: the pick at each step
                rows = steps.gather(2, index[:, :-1, None, None].expand(N, L - 1, 1, steps.shape[-1]))[:, :, 0]
                mine.update(cand_ids=cands.ids, cand_scores=cands.scores, path=list(tokens),
                            corrected=torch.cat([first[:, None], rows], 1),
                            confidence=torch.stack([dr.confidence for dr in drafts]) if drafts[0].confidence is not None
                            else None)
            else:
                cands = d.draft_candidates(hidden, target)
                first, steps = sel.lattice(cands, hidden, anchors)
                case.update(cand_ids=cands.ids, cand_scores=cands.scores)
                mine.update(cand_ids=cands.ids, cand_scores=cands.scores, first=first, steps=steps,
                            path=[dr.tokens for dr in sel.select_batch(cands, hidden, anchors.tolist())])
        all_cases[name], ours[name] = case, mine
    return all_cases, ours


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(1, max |a|): float32 agreement on the tensor's own scale."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / max(1.0, float(a.abs().max())))


def compare(ours: dict, theirs: dict) -> dict:
    rows = {}
    for name, mine in ours.items():
        t = theirs[name]
        row = dict(vllm_class=t["cls"], exported_tensors=t["exported"], unset_by_load_weights=t["unset"])
        row["fuse"] = rel_diff(mine["fuse"], t["fuse"])
        if "conv" in mine:
            row["conv"] = max(max(rel_diff(a, b), rel_diff(c, e)) for (a, c), (b, e) in zip(mine["conv"], t["conv"]))
        row["candidate_ids_equal"] = bool(torch.equal(mine["cand_ids"], t["cand_ids"]))
        row["candidate_scores"] = rel_diff(mine["cand_scores"], t["cand_scores"])
        if "corrected" in mine:  # DSpark
            row["scores"] = rel_diff(mine["corrected"], t["corrected"])
            row["path_equal"] = bool(torch.equal(torch.stack(mine["path"]), t["tokens"]))
            if mine.get("confidence") is not None:
                row["confidence"] = rel_diff(mine["confidence"], t["confidence"])
        else:
            s = t["scores"].float()  # [N, L, K, K]: step 0's rows are the anchor's
            row["scores"] = max(rel_diff(mine["first"], s[:, 0, 0]), rel_diff(mine["steps"], s[:, 1:]))
            path = torch.stack(mine["path"])
            theirs_path = mine["cand_ids"].gather(2, t["path"][..., None])[..., 0]
            row["path_equal"] = bool(torch.equal(path, theirs_path))
        numbers = [v for k, v in row.items() if k in ("fuse", "conv", "candidate_scores", "scores", "confidence")]
        row["within_tolerance"] = (all(v <= TOLERANCE for v in numbers) and row["candidate_ids_equal"]
                                   and row["path_equal"] and not row["unset_by_load_weights"])
        rows[name] = row
    return rows


def theirs(vllm_python: str, all_cases: dict, work: Path) -> dict:
    """worker.py's outputs for `all_cases`, run by `vllm_python` (RuntimeError with its stderr if it fails)."""
    torch.save(all_cases, work / "cases.pt")
    done = subprocess.run([vllm_python, str(Path(__file__).with_name("worker.py")), str(work / "cases.pt"),
                           str(work / "theirs.pt"), str(embedded_path("target"))], capture_output=True, text=True,
                          timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"the vLLM worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return torch.load(work / "theirs.pt")


def run(vllm_python: str, work: Path) -> dict:
    all_cases, ours = cases(work)
    return compare(ours, theirs(vllm_python, all_cases, work))


def markdown(rows: dict) -> str:
    lines = ["| variant | vLLM class | tensors exported / unset after load | fuse | conv | candidates (ids, values) | "
             "scores | path | confidence | within 1e-5 |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = (lambda v: "—" if v is None else f"{v:.1e}")
    for name, r in rows.items():
        lines.append(f"| {name} | {r['vllm_class']} | {r['exported_tensors']} / {len(r['unset_by_load_weights'])} | "
                     f"{fmt(r.get('fuse'))} | {fmt(r.get('conv'))} | {'equal' if r['candidate_ids_equal'] else 'DIFFER'}, "
                     f"{fmt(r['candidate_scores'])} | {fmt(r['scores'])} | "
                     f"{'equal' if r['path_equal'] else 'DIFFER'} | {fmt(r.get('confidence'))} | "
                     f"{'yes' if r['within_tolerance'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="the python of a venv with vLLM 0.32 (CPU build)")
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "vllm_parity"))
    args = p.parse_args()
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"error: --vllm-python {args.vllm_python}: no such file")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows = run(args.vllm_python, Path(tmp))
        except RuntimeError as error:
            raise SystemExit(f"error: {error}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    (out / "parity.json").write_text(json.dumps(dict(vllm=version, tolerance=TOLERANCE, rows=rows), indent=1) + "\n")
    md = markdown(rows)
    (out / "parity.md").write_text(f"vLLM {version}, float32, CPU; max |Δ| relative to each tensor's scale.\n\n" + md)
    print(md)
    return 0 if all(r["within_tolerance"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
