"""Our drafter in llama.cpp against our loop, round by round: the same target (float32), the same drafter
converted by llama.cpp's own script, the same chat prompts, greedy.

    python experiments/real_target/cross_engine.py --drafter DIR --llama-cpp ~/llama [--prompts 8] \
        [--max-new-tokens 96] [--out docs/results/real_target/cross_engine.json]

How the two count, and how they are aligned. `llama-speculative-simple` keeps the prompt's last token as its
first anchor: its first round drafts from the features of the prompt before it, so the token our prefill
produces is drafted there. Our loop on the prompt without its last token does the same whenever the
target's greedy token after that shorter prompt is the prompt's last token (a chat prompt's final newline,
checked per prompt; others are skipped and counted), and `-n N` yields N + 1 tokens there (it stops once past
N). Then both run the same rounds on the same contexts,
and llama.cpp's debug line "accepted a/n draft tokens" per round is compared with ours (a + 1 committed):
equal counts in a round mean equal drafted tokens up to and including the first rejected one. τ is given
both ways: 1 + accepted / rounds over the same rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import DFlash2Drafter, spec_generate  # noqa: E402
from dflash2.bench.prompts import load_prompt_set  # noqa: E402
from dflash2.engines.llama_cpp import binary, convert_drafter, convert_model  # noqa: E402
from dflash2.targets.gguf import cache_dir, resolve_target  # noqa: E402

ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens")


def llama_rounds(llama: Path, target_gguf: Path, drafter_gguf: Path, prompt: str, new_tokens: int,
                 draft_max: int) -> tuple[list[int], int]:
    """llama-speculative-simple's accepted drafts per round, and the prompt tokens it encoded."""
    cmd = [str(binary(llama, "llama-speculative-simple")), "-m", str(target_gguf), "-md", str(drafter_gguf),
           "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_max), "-n", str(new_tokens),
           "-p", prompt, "--temp", "0", "-c", "4096", "-t", str(torch.get_num_threads()), "-v",
           "--log-colors", "off"]  # -v: the per-round debug lines
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple failed ({proc.returncode}):\n{log[-3000:]}")
    encoded = re.search(r"encoded +(\d+) tokens", log)
    return [int(a) for a, _ in ACCEPTED.findall(log)], int(encoded.group(1)) if encoded else -1


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a drafter directory trained for the smollm2 target")
    p.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp: src/ and build/bin/ (docs/engines.md)")
    p.add_argument("--suite", default="gsm8k")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "cross_engine.json")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = resolve_target("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = DFlash2Drafter.from_pretrained(args.drafter).float().eval()
    where = cache_dir() / "gguf" / "cross_engine"
    where.mkdir(parents=True, exist_ok=True)
    target_gguf = convert_model(args.llama_cpp, target_dir, where / "smollm2-f32.gguf", "f32")
    weights = Path(args.drafter) / "model.safetensors"
    key = hashlib.sha256(f"{weights.resolve()}:{weights.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    drafter_gguf = where / f"drafter-{key}-f32.gguf"  # converted once per drafter file
    with tempfile.TemporaryDirectory() as tmp:
        if not drafter_gguf.is_file():
            drafter.save_pretrained(Path(tmp) / "reference", format="reference", target=target)
            convert_drafter(args.llama_cpp, Path(tmp) / "reference", target_dir, drafter_gguf)
        suites = ROOT / "experiments" / "real_target" / "suites"
        suite = load_prompt_set(args.suite, args.prompts, str(suites / f"{args.suite}.jsonl"))
        rows, skipped = [], 0
        for conv in suite.conversations:
            text = tokenizer.apply_chat_template([{"role": "user", "content": conv.turns[0]}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            if int(target(ids[:, :-1]).logits[0, -1].argmax()) != int(ids[0, -1]):
                skipped += 1  # our prefill would not produce the prompt's last token: rounds cannot align
                continue
            # llama.cpp's -n N stops once it has more than N tokens: N + 1 (its last round drafts nothing);
            # ours also produces the prompt's last token first
            ours = spec_generate(drafter, target, ids[:, :-1], max_new_tokens=args.max_new_tokens + 2)
            theirs, encoded = llama_rounds(args.llama_cpp, target_gguf, drafter_gguf, text, args.max_new_tokens,
                                       drafter.block_size - 1)
            if encoded != ids.shape[1]:
                raise SystemExit(f"llama.cpp encoded {encoded} prompt tokens, we {ids.shape[1]}: not the same prompt")
            mine = [n - 1 for n in ours.acceptance_lengths]
            first_diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            rows.append(dict(prompt_tokens=ids.shape[1], rounds_ours=len(mine), rounds_llama=len(theirs),
                             accepted_ours=mine, accepted_llama=theirs, first_different_round=first_diff,
                             tau_ours=1 + sum(mine) / max(len(mine), 1), tau_llama=1 + sum(theirs) / max(len(theirs), 1)))
            print(f"prompt {len(rows)}: rounds {len(mine)} / {len(theirs)}, τ {rows[-1]['tau_ours']:.2f} / "
                  f"{rows[-1]['tau_llama']:.2f}, first different round: {first_diff}", flush=True)
    same = sum(r["accepted_ours"] == r["accepted_llama"] for r in rows)
    total = {k: sum(len(r[f"accepted_{k}"]) for r in rows) for k in ("ours", "llama")}
    acc = {k: sum(sum(r[f"accepted_{k}"]) for r in rows) for k in ("ours", "llama")}
    # the last round meets the budget, where the two stop differently (llama.cpp drafts a full block past -n)
    before = [(r["accepted_ours"][:-1], r["accepted_llama"][:len(r["accepted_ours"]) - 1]) for r in rows]
    rounds = sum(len(a) for a, _ in before)
    last_apart = dict(identical=sum(a == b for a, b in before), rounds=rounds,
                      tau_ours=1 + sum(sum(a) for a, _ in before) / max(rounds, 1),
                      tau_llama=1 + sum(sum(b) for _, b in before) / max(rounds, 1))
    summary = dict(prompts=len(rows), skipped=skipped, identical_round_sequences=same, before_the_last_round=last_apart,
                   tau_ours=1 + acc["ours"] / max(total["ours"], 1), tau_llama=1 + acc["llama"] / max(total["llama"], 1),
                   drafter=args.drafter, suite=args.suite, max_new_tokens=args.max_new_tokens)
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(summary=summary, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
