"""Server mode of the bench against vLLM's CPU build: `vllm serve` the embedded target, once without a
drafter and once with our DFlash-1 drafter (exported in the reference format), and send HumanEval to
each at concurrency 1 and 8, beside our own loop on the same prompts.

    python experiments/serve/bench_server_vllm.py --vllm-python /path/to/vllm-venv/bin/python \
        [--prompts 8] [--max-new-tokens 128] [--repetitions 2] [--out runs/bench/server_vllm] \
        [key=value ...]                                   # more bench overrides

The bench starts both servers on 127.0.0.1 (logs in OUT/server_<name>.log), waits for them, sends each
conversation to both back to back (interleaved, after our own rows) and stops them. vLLM's CPU build refuses
DFlash 2, so the drafter row is DFlash-1. Setting up the venv: docs/checkpoints.md ("Serving with vLLM").
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from dflash2.bench import main as bench_main
from dflash2.embedded import embedded_path, load_embedded


def server(python: str, port: int, drafter: Path | None, block: int) -> dict:
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(embedded_path("target")),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
               "--max-num-seqs", "8"]
    if drafter is not None:
        command += ["--speculative-config", json.dumps({"method": "dflash", "model": str(drafter),
                                                        "num_speculative_tokens": block - 1})]
    return dict(url=f"http://127.0.0.1:{port}", launch=shlex.join(command), block_size=block if drafter else None,
                env={"OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the python of a venv with vLLM installed")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--port", type=int, default=8011, help="the first of two ports on 127.0.0.1")
    parser.add_argument("--out", default="runs/bench/server_vllm")
    parser.add_argument("overrides", nargs="*", help="more bench overrides, e.g. concurrency=[1]")
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python {args.vllm_python} does not exist")
    with tempfile.TemporaryDirectory(prefix="dflash2-serve-") as tmp:
        drafter = Path(tmp) / "dflash1_reference"
        load_embedded("dflash1")[2].with_config(block_size=args.block_size).save_pretrained(drafter, format="reference")
        servers = {"vllm_serve_ar": server(args.vllm_python, args.port, None, args.block_size),
                   "vllm_serve_dflash1": server(args.vllm_python, args.port + 1, drafter, args.block_size)}
        config = Path(tmp) / "bench.json"  # YAML is a superset of JSON
        config.write_text(json.dumps(dict(
            datasets=["humaneval"], num_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
            block_sizes=[args.block_size], concurrency=[1, 8], settings=["greedy"], methods=["ar", "dflash1"],
            repetitions=args.repetitions, servers=servers, out=args.out)))
        return bench_main(["--config", str(config), *args.overrides])


if __name__ == "__main__":
    sys.exit(main())
