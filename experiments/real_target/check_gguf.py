"""The SmolLM2 target as dflash2 loads it equals the GGUF file as llama.cpp reads it.

1. Every tensor's float32 dequantization by ggml's own row functions (ggml_dequant, built against the
   llama.cpp tree of ../shared/tools/setup-llama-cpp: see docs/engines.md) is bit-equal to gguf-py's,
   and to the weight dflash2 loads (q/k back from llama.cpp's rotary layout).
2. Greedy decoding through dflash2's loop on the loaded target equals transformers' own GGUF loader
   (`from_pretrained(dir, gguf_file=...)`, HF generate) on 5 chat prompts × 64 tokens.

    python experiments/real_target/check_gguf.py [--ggml-dequant PATH] [--out docs/results/real_target/gguf_check.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import ar_generate  # noqa: E402
from dflash2.targets.gguf import load_gguf, smollm2_gguf  # noqa: E402

PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "Explain what a hash table is in two sentences.", "Write a haiku about the sea.",
           "How many minutes are there in three hours? Show your working."]
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, part, _ = name.split(".")
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.weight"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def check_tensors(path: Path, model, ggml_dequant: Path | None) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    state = model.state_dict()
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    ggml = None
    if ggml_dequant is not None:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([str(ggml_dequant), str(path), f"{tmp}/all.f32"], check=True, capture_output=True)
            ggml = np.fromfile(f"{tmp}/all.f32", dtype=np.float32)
    offset, by_type = 0, {}
    for t in reader.tensors:
        ours = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        n = ours.size
        row = by_type.setdefault(t.tensor_type.name, dict(tensors=0, gguf_py_equals_ggml=True, loaded_equals_gguf_py=True))
        row["tensors"] += 1
        if ggml is not None:
            row["gguf_py_equals_ggml"] &= bool(np.array_equal(ggml[offset:offset + n], ours.reshape(-1)))
        offset += n
        want = ours.reshape(state[hf_name(t.name)].shape)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            want = unpermute(want, heads if ".attn_q." in t.name else kv)
        row["loaded_equals_gguf_py"] &= bool(np.array_equal(state[hf_name(t.name)].numpy(), want))
    if ggml is None:
        for row in by_type.values():
            row["gguf_py_equals_ggml"] = None
    return by_type


def check_greedy(path: Path, model, tokenizer, new_tokens: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    rows = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            want = reference.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
            got = ar_generate(model, ids, max_new_tokens=new_tokens, stop_token_ids=[tokenizer.eos_token_id]).new_tokens
        rows.append(dict(prompt=text, equal=bool(torch.equal(got, want)), tokens=int(want.numel()),
                         text=tokenizer.decode(got)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ggml-dequant", type=Path, help="the ggml_dequant binary (ggml_dequant.c); without it, step 1 "
                                                      "checks gguf-py against the loaded weights only")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    path = smollm2_gguf()
    model, tokenizer = load_gguf(path)
    result = dict(file=path.name, tensors=check_tensors(path, model, args.ggml_dequant),
                  greedy=check_greedy(path, model, tokenizer, args.new_tokens))
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    ok = all(r["loaded_equals_gguf_py"] and r["gguf_py_equals_ggml"] is not False for r in result["tensors"].values())
    sys.exit(0 if ok and all(r["equal"] for r in result["greedy"]) else 1)


if __name__ == "__main__":
    main()
