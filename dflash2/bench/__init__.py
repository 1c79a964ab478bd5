"""`python -m dflash2.bench [--config configs/bench/<file>.yaml] [key=value ...] [--quick]`

Runs every method of a table (our loop's rows, HF's baselines, vLLM's and llama.cpp's, servers) on every
prompt, interleaved in one process over several repetitions (ABBA), and writes `results.json`,
`results.md` and plots to `out`, each table with its load record. docs/bench.md describes every row,
key and ratio.

    config.py    BenchConfig (every key), sampling settings, dtypes, the CPU's capabilities
    prompts.py   the prompt sets and the model cards' suites
    methods.py   Method (one row) and the functions that run ours, HF's and vLLM's; llama.py llama.cpp's
    run.py       models, chat template, conversations turn by turn, the interleaved tables
    server.py    server mode: OpenAI-compatible endpoints, launched and stopped here
    machine.py   the load record; report.py ratios, rows, results.json / results.md / figures; cli.py
"""

from dflash2.bench.cli import main
from dflash2.bench.config import BenchConfig
from dflash2.bench.methods import Method, Run
from dflash2.bench.run import run_bench

__all__ = ["BenchConfig", "Method", "Run", "main", "run_bench"]
