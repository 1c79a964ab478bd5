"""Train the embedded target: a small Qwen3ForCausalLM on the standard library's source, from scratch.

    python experiments/embedded/train_target.py            # runs or resumes runs/target
    python experiments/embedded/train_target.py --export   # writes dflash2/embedded/target
    python experiments/embedded/train_target.py --preset ar_draft [--export]   # the small AR draft model

Resumable: a checkpoint is written atomically every --ckpt-every steps and the run continues from
it, with the same data order (batches are a function of seed and step), so an interrupted run ends
where an uninterrupted one would. Held-out cross-entropy is logged to runs/target/log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dflash2.embedded.corpus import read_texts  # noqa: E402

from dflash2.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

TOKENIZER = ROOT / "dflash2" / "embedded" / "tokenizer"
PRESETS = {
    # the target of the embedded pair
    "target": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                   rope_theta=10000.0),
    # the small AR draft model for HF assisted generation baselines
    "ar_draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                     rope_theta=10000.0),
}


def token_stream(split: str, tokenizer) -> torch.Tensor:
    """All files of a split, each followed by <|endoftext|>, as one 1-D tensor."""
    ids: list[int] = []
    for text in read_texts(split):
        ids += tokenizer(text).input_ids + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def batch_at(stream: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Batch for a given step: random windows drawn from a generator seeded by (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq, (batch,), generator=g)
    return torch.stack([stream[s: s + seq] for s in starts.tolist()])


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq: int) -> float:
    model.eval()
    losses, n = 0.0, 0
    for s in range(0, stream.numel() - seq, seq):
        x = stream[s: s + seq][None]
        losses += float(model(input_ids=x, labels=x).loss) * (seq - 1)
        n += seq - 1
    model.train()
    return losses / n


def build_model(vocab: int, tokenizer, preset: str):
    import transformers

    config = transformers.Qwen3Config(vocab_size=vocab, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, **PRESETS[preset])
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="target")
    p.add_argument("--run", type=Path, default=None, help="default: runs/<preset>")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--stop-after", type=int, default=None, help="stop (checkpointed) after this many steps")
    p.add_argument("--export", action="store_true", help="write the final model to dflash2/embedded/target")
    args = p.parse_args()

    from transformers import AutoTokenizer

    args.run = args.run or ROOT / "runs" / args.preset
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    model = build_model(len(tokenizer), tokenizer, args.preset)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt_path = args.run / "ckpt.pt"
    state = load_checkpoint(ckpt_path)
    step = 0
    resolved = dict(vars(args), run=str(args.run), model=PRESETS[args.preset], vocab_size=len(tokenizer))
    schedule = ("steps", "batch", "seq", "lr", "warmup", "seed", "model", "vocab_size")
    saved_config = ckpt_path.with_suffix(".config.json")
    if state is not None and saved_config.is_file() and not args.export:
        saved = json.loads(saved_config.read_text())
        changed = [k for k in schedule if saved.get(k) != resolved[k]]
        if changed:
            raise SystemExit(f"error: {ckpt_path} was trained with different {changed}; use another --run")
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"resumed from {ckpt_path} at step {step}")
    if args.export:
        out = ROOT / "dflash2" / "embedded" / args.preset
        model.to(torch.bfloat16).save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        print(f"exported step {step} to {out}")
        return 0
    train, held = token_stream("train", tokenizer), token_stream("heldout", tokenizer)
    print(f"train {train.numel()} tokens, held-out {held.numel()} tokens, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    log = (args.run / "log.jsonl")
    args.run.mkdir(parents=True, exist_ok=True)
    model.train()
    end = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    bar = tqdm(range(step, end), initial=step, total=args.steps, desc="target")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x = batch_at(train, step, args.batch, args.seq, args.seed)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        loss = loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{x.numel() / (time.perf_counter() - t0):.0f}")
        done = step + 1
        record = None
        if done % args.eval_every == 0 or done == args.steps:
            record = dict(step=done, train_loss=loss, heldout_loss=heldout_loss(model, held, args.seq))
            bar.write(json.dumps(record))
        if done % args.ckpt_every == 0 or done == end:
            save_checkpoint(ckpt_path, dict(model=model.state_dict(), optimizer=opt.state_dict(), step=done),
                            config=resolved)
        if record is not None:  # logged after the checkpoint that covers it
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
