"""The options that still ship, against each other: whole decodes under each variant of StaticTarget's and the
drafter's switches, all variants in one process, interleaved per repetition (the order reversed on odd ones).

    python experiments/performance/step_options.py --variant aten:gemm=aten --variant inductor:gemm=inductor
    python experiments/performance/step_options.py --variant eager:compile=false --variant compiled:compile=true \
        --target smollm2 --drafter embedded:smollm2_dflash2 --cases plain1,tree1
    python experiments/performance/step_options.py --variant d_eager:drafter_compile=false --variant d_comp:drafter_compile=true

A variant is NAME:key=value,...: StaticTarget's `compile` (default true), `fused` (true), `gemm` (auto),
`linear_dtype` (bfloat16), and the drafter's `drafter_dtype` (bfloat16), `drafter_compile` (true).
Cases: `plain1` (plain decoding, batch 1), `tree1` (15-node trees, batch 1), `path1` (paths, batch 1),
`plainN` (plain decoding, N rows in flight, every prompt in one call). Per variant also its warm-up
seconds and the peak memory after it. Greedy, HumanEval prompts, 128 new tokens; run it quiet. Writes
--out (JSON: every repetition's tokens/s, the ratio of each variant's median to the first variant's).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import ar_generate, spec_generate  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.decoding.batch import ar_generate_batch, left_pad  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402

DEFAULTS = dict(compile=True, fused=True, gemm="auto", linear_dtype="bfloat16", drafter_dtype="bfloat16",
                drafter_compile=True)


def parse_variant(text: str) -> tuple[str, dict]:
    """NAME:key=value,... → (name, the options with DEFAULTS filled in). One line on a bad key or value."""
    name, _, body = text.partition(":")
    options = dict(DEFAULTS)
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            raise SystemExit(f"--variant {text!r}: {item!r} is not key=value with a key of {sorted(DEFAULTS)}")
        if isinstance(DEFAULTS[key], bool):
            if value.lower() not in ("true", "false"):
                raise SystemExit(f"--variant {text!r}: {key} takes true or false, not {value!r}")
            options[key] = value.lower() == "true"
        else:
            options[key] = None if value.lower() == "none" else value
    if not name:
        raise SystemExit(f"--variant {text!r}: give it a name, NAME:key=value,...")
    return name, options


def load_pair(target: str, drafter: str):
    """(tokenizer, target model, drafter): the embedded pair, or a target and a drafter as the bench names them."""
    from dflash2 import DFlash2Drafter, load_embedded
    from dflash2.bench.methods import resolve
    from dflash2.decoding.checks import from_pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if target == "embedded" and drafter == "embedded:dflash2":
        return load_embedded()
    directory = resolve(target)
    tokenizer = from_pretrained(AutoTokenizer.from_pretrained, directory)
    model = from_pretrained(AutoModelForCausalLM.from_pretrained, directory, dtype=torch.float32).eval()
    return tokenizer, model, DFlash2Drafter.from_pretrained(resolve(drafter)).eval()


def build(options: dict, model, drafter, batch, mask, cases: list[str]) -> dict:
    """case → a function of one prompt's ids returning GenerationResults, for one variant."""
    kwargs = {k: options[k] for k in ("compile", "fused", "gemm", "linear_dtype")}
    plain = StaticTarget(model, (), **kwargs)
    spec = StaticTarget(model, drafter.target_layer_ids, **kwargs)
    d = copy.deepcopy(drafter).to(getattr(torch, options["drafter_dtype"]))
    if options["drafter_compile"]:
        d.compile(dynamic=True, gemm=options["gemm"])
    made = {}
    for case in cases:
        if case == "plain1":
            made[case] = lambda x: [ar_generate(plain, x, max_new_tokens=128)]
        elif case in ("tree1", "path1"):
            verify = case[:4]
            made[case] = lambda x, verify=verify: [spec_generate(d, spec, x, verify=verify, tree_nodes=15,
                                                                 max_new_tokens=128)]
        elif case.startswith("plain") and case[5:].isdigit():
            made[case] = lambda _, rows=int(case[5:]): ar_generate_batch(plain, batch, mask, max_new_tokens=128,
                                                                         concurrency=rows)
        else:
            raise SystemExit(f"--cases: {case!r} is not plain1, tree1, path1 or plainN")
    return made


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True, help="NAME:key=value,... (two or more)")
    p.add_argument("--cases", default="plain1,tree1,plain8")
    p.add_argument("--target", default="embedded")
    p.add_argument("--drafter", default="embedded:dflash2")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "step_options.json")
    args = p.parse_args(argv)
    variants = dict(parse_variant(v) for v in args.variant)
    if len(variants) < 2:
        raise SystemExit("give two or more --variant with distinct names")
    cases = args.cases.split(",")
    monitor = LoadMonitor()
    tok, model, drafter = load_pair(args.target, args.drafter)
    texts, source = load_prompts("humaneval", args.prompts)
    ids = [tok(t, return_tensors="pt").input_ids for t in texts]
    batch, mask = left_pad([x[0] for x in ids])
    fns, warm = {}, {}
    for name, options in variants.items():
        start, before = time.perf_counter(), peak_mb()
        try:
            fns[name] = build(options, model, drafter.with_config(block_size=16), batch, mask, cases)
        except (NotImplementedError, ValueError) as e:
            raise SystemExit(f"variant {name}: {e}") from None
        for fn in fns[name].values():  # the warm-ups (compiles) and first calls
            fn(ids[0])
        warm[name] = dict(seconds=time.perf_counter() - start, peak_mb_before=before, peak_mb_after=peak_mb())
        print(f"{name}: warm-up {warm[name]['seconds']:.0f} s, peak memory {before:.0f} → {peak_mb():.0f} MB", flush=True)
    runs = {(case, name): [] for case in cases for name in variants}
    for rep in range(args.repetitions):
        for case in cases:
            for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                prompts = ids if case.endswith("1") else ids[:1]  # a batched case decodes every prompt in one call
                n, t = 0, time.perf_counter()
                for x in prompts:
                    n += sum(r.new_tokens.numel() for r in fns[name][case](x))
                runs[(case, name)].append(n / (time.perf_counter() - t))
    load = monitor.record()
    first = next(iter(variants))
    rows = []
    for case in cases:
        base = statistics.median(runs[(case, first)])
        row = dict(case=case, tokens_per_s={n: runs[(case, n)] for n in variants},
                   ratio={n: statistics.median(runs[(case, n)]) / base for n in variants})
        rows.append(row)
        print(f"{case:<8} " + "  ".join(f"{n} {statistics.median(runs[(case, n)]):7.0f} tok/s ({row['ratio'][n]:.2f}×)"
                                        for n in variants))
    meta = dict(command="python experiments/performance/step_options.py " + " ".join(sys.argv[1:] if argv is None else argv),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                torch=torch.__version__, target=args.target, drafter=args.drafter, prompts=args.prompts,
                repetitions=args.repetitions, source=source, load=load, variants=variants)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, warm_up=warm, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
