"""`python -m dflash2.train --config configs/<file>.yaml [dotted.key=value ...]`: train a drafter.

--data-only prepares the data (regenerated answers, cached features) and stops; --export DIR writes the
last checkpoint as a drafter; --dry-run checks the config and says what a run would do;
--nproc-per-node N trains with N processes. Errors are one line and exit 2; a signal, one line and
exit 130 / 143 (docs/training.md)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from dflash2.train.config import config_reference, describe, load_config
from dflash2.train.prepare import prepare_data
from dflash2.train.run import __doc__ as RUN_DOC, export_checkpoint, train
from dflash2.train.signals import Interrupted, _rank, _world, launch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash2.train", description=RUN_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="config keys (YAML or dotted.key=value) and their defaults:\n" + config_reference())
    p.add_argument("--config", type=Path, help="YAML of config keys (default: none; the overrides alone)")
    p.add_argument("--stop-after", type=int, help="stop (checkpointed) after this many more steps (default: run to `steps`)")
    p.add_argument("--export", type=Path, metavar="DIR",
                   help="train nothing: write the run's last checkpoint as a drafter directory DIR")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="train with N processes on this machine (parallel: ddp or fsdp), launched like torchrun "
                        "--standalone; Ctrl-C or SIGTERM: one line, a checkpoint at the step reached, every process "
                        "gone, exit 130 / 143")
    p.add_argument("--data-only", action="store_true",
                   help="regenerate (or resume) the dataset and stop; a signal stops it between shards' writes")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and say what a run would do (data, steps, where), then stop: nothing loaded")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. steps=200 drafter.block_size=8")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            print(describe(cfg))
            return 0
        if args.nproc_per_node is not None and "LOCAL_RANK" not in os.environ:  # the launcher, not a worker
            if args.nproc_per_node < 1:
                raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
            forwarded = list(argv if argv is not None else sys.argv[1:])
            i = next(i for i, a in enumerate(forwarded) if a.startswith("--nproc-per-node"))
            del forwarded[i: i + (1 if "=" in forwarded[i] else 2)]
            return launch(args.nproc_per_node, forwarded)
        if args.data_only:
            print(f"dataset: {prepare_data(cfg)}")
            return 0
        if args.export:
            step = export_checkpoint(cfg, args.export)
            print(f"wrote the step-{step} drafter of {cfg.out} to {args.export}")
            return 0
        out = train(cfg, stop_after=args.stop_after)
    except Interrupted as stop:
        if _world() > 1:  # a worker stopped as asked: its launcher's signal changes nothing
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        detail = str(stop) if str(stop) != signal.Signals(stop.signum).name else (
            f"{signal.Signals(stop.signum).name}: stopped before the first training step; the same command resumes")
        if _rank() == 0:  # one line for the whole run, not one per process
            print(f"interrupted by {detail}", file=sys.stderr)
        return 128 + stop.signum
    except (ValueError, TypeError, OSError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if _rank() != 0:  # one report for the whole run
        return 0
    print(f"run directory: {out}")
    final = out / "final"
    if final.is_dir():
        # trained on chat turns: prompt it the same way, with a request rather than the demo's code prefix
        chat = ' --chat --prompt "Write a Python function that reverses a string."' if cfg.data.dataset is not None else ""
        print(f"drafter: {final}\nuse it: python -m dflash2.generate --target {cfg.target} --drafter {final}{chat}")
    else:
        print(f"the run stopped before step {cfg.steps}: the same command resumes it; --export DIR writes its last "
              "checkpoint as a drafter")
    return 0
