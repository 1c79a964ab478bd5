"""The real GSM8K and MT-Bench prompts for the SmolLM2 benchmark, as the bench's dataset_files read them
({"turns": [...]} per line, formatted as the bench formats the hub suites), from the public repositories:

    python experiments/real_target/suites/build.py GSM8K_REPO FASTCHAT_REPO

GSM8K_REPO: a checkout of github.com/openai/grade-school-math (MIT; its test split); FASTCHAT_REPO: of
github.com/lm-sys/FastChat (Apache-2.0; fastchat/llm_judge/data/mt_bench/question.jsonl, both turns).
The hub datasets the bench reads by default (openai/gsm8k, HuggingFaceH4/mt_bench_prompts) are the same
questions; these files let a machine without the hub run the suites.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from dflash2.bench.prompts import REASON  # noqa: E402


def main() -> int:
    gsm8k, fastchat = map(Path, sys.argv[1:3])
    rows = [json.loads(line) for line in (gsm8k / "grade_school_math/data/test.jsonl").read_text().splitlines()]
    with open(HERE / "gsm8k.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"turns": [r["question"] + REASON]}) + "\n")
    rows = [json.loads(line) for line in
            (fastchat / "fastchat/llm_judge/data/mt_bench/question.jsonl").read_text().splitlines()]
    with open(HERE / "mt-bench.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"turns": r["turns"]}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
