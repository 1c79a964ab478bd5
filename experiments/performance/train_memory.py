"""Peak resident memory of `python -m dflash2.train` against vocabulary size and sequence length.

    python experiments/performance/train_memory.py --out docs/results/train_memory [--code DIR] [--vocab 4096 151936]
        [--lengths 512 1024 2048 4096] [--limit-gb 22]

Each run is its own process under GNU time (`/usr/bin/time -v`); its "maximum resident set size" is
the peak of the whole run, the target's regeneration included. The target is a random
`Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)` at the given vocabulary; the run is
2 steps of batch 1 over 2 sequences of T tokens (T/2 prompt, T/2 regenerated greedily), 256 anchors
per sequence, B = 16, one layer, the default DFlash-2 selector, soft targets, a checkpoint every step.

`--code DIR` runs the trainer of another checkout (e.g. a `git worktree` of an older commit: the
"before" of a change). A run whose memory passes `--limit-gb` is killed and recorded as not fitting.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_target(directory: Path, vocab: int) -> Path:
    if (directory / "config.json").is_file():
        return directory
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=8192, tie_word_embeddings=True)
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(directory))
    return directory


def tree_rss_kb(pid: int) -> int:
    """Resident memory (kB) of a process and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return total


def run_one(code: Path, target: Path, vocab: int, T: int, work: Path, limit_kb: int, extra: list[str]) -> dict:
    out = work / f"run_V{vocab}_T{T}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    overrides = [f"target={target}", f"out={out}", "steps=2", "batch_size=1", "anchors_per_seq=256",
                 "soft_targets=true", "ckpt_every=1", "drafter.block_size=16", "drafter.num_layers=1",
                 f"drafter.mask_token_id={vocab - 1}", "data.prompts=random", "data.num_sequences=2",
                 f"data.prompt_tokens={T // 2}", f"data.new_tokens={T - T // 2}", "data.temperature=0.0", *extra]
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "dflash2.train", *overrides]
    env = dict(os.environ, PYTHONPATH=str(code), TQDM_DISABLE="1")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    killed, peak_seen = [False], [0]

    def watch() -> None:
        while proc.poll() is None:
            rss = tree_rss_kb(proc.pid)
            peak_seen[0] = max(peak_seen[0], rss)
            if rss > limit_kb:
                killed[0] = True
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate()
    watcher.join()
    wall = time.monotonic() - start
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    record = dict(vocab=vocab, seq_len=T, rc=proc.returncode, wall_s=round(wall, 1), code=str(code))
    if killed[0]:
        record.update(fits=False, peak_rss_gb=None,
                      note=f"killed when its memory passed {limit_kb / 2**20:.0f} GB: does not fit in 24 GB")
    elif proc.returncode != 0 or match is None:
        record.update(fits=False, peak_rss_gb=None, note="failed: " + stderr.strip().splitlines()[-1][-300:])
    else:
        record.update(fits=True, peak_rss_gb=round(int(match.group(1)) / 2**20, 3))
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and the runs")
    p.add_argument("--code", type=Path, default=ROOT, help="checkout whose dflash2 trains (default: this one)")
    p.add_argument("--label", default="after", help="name of this series in results.json (e.g. before, after)")
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--limit-gb", type=float, default=22.0, help="kill a run whose resident memory passes this")
    p.add_argument("--work", type=Path, default=Path("/tmp/dflash2_train_memory"))
    p.add_argument("overrides", nargs="*", help="extra trainer overrides for every run")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    series = results.setdefault(args.label, [])
    for vocab in args.vocab:
        target = make_target(args.work / f"target_V{vocab}", vocab)
        for T in args.lengths:
            record = run_one(args.code.resolve(), target, vocab, T, args.work, int(args.limit_gb * 2**20),
                             args.overrides)
            series[:] = [r for r in series if (r["vocab"], r["seq_len"]) != (vocab, T)] + [record]
            path.write_text(json.dumps(results, indent=2) + "\n")
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
