"""StaticTarget: the target's own layers over a preallocated cache (optionally compiled) give the
same steps as the model's forward, so decoding through it stays lossless: greedy equality with
`generate` in float64 and the exact sampled distribution, eager and compiled."""

from __future__ import annotations

import functools

import pytest
import torch

from dflash2 import DFlash2Drafter, TargetAdapter, ar_generate, spec_generate
from dflash2.target.static import StaticTarget
from tests import test_exact_distribution as exact
from tests.helpers import HAS_CXX_COMPILER, MASK, hf_greedy, max_abs_diff, tiny_target

ARCHS = ["qwen3", "llama", "mistral_sliding"]


def drafter_for(target, seed=0, **fields) -> DFlash2Drafter:
    torch.manual_seed(seed)
    d = DFlash2Drafter.from_target(target, block_size=5, mask_token_id=MASK, selector_top_k=4, selector_rank=8, **fields)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return d.eval()


def extra_target(name: str):
    """Layouts the fused step must write out too (q/k/v and MLP biases, per-layer sliding windows, a
    YaRN RoPE), and one it must leave to the model's layers (a RoPE that depends on the length)."""
    import transformers

    common = dict(vocab_size=MASK + 1, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    cls, config = {
        "qwen2_biased_sliding": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=6, max_window_layers=2)),
        "llama_biased": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**common, attention_bias=True,
                                                                                 mlp_bias=True)),
        "llama_yarn": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            **common, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 64})),
        "llama_dynamic_rope": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            **common, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    }[name]
    torch.manual_seed(0)
    model = cls(config).to(torch.float64).eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith("bias"):
                p.normal_(0, 0.5)  # HF initialises biases to zero: make them count
    return model


@pytest.mark.parametrize("arch, fused", [(a, True) for a in ARCHS] + [(a, False) for a in ARCHS]
                         + [("qwen2_biased_sliding", True), ("llama_biased", True), ("llama_yarn", True),
                            ("llama_dynamic_rope", False)])
def test_steps_equal_the_models_forward(arch, fused):
    """Prefill, verify passes, rollbacks, a kept non-prefix path and a tree: logits and features equal
    TargetAdapter's (the model's forward over its own cache), the last layer's normed state included;
    through the fused step where the layout allows it (`fused`: whether it does), else the model's layers."""
    target = tiny_target(arch) if arch in ARCHS else extra_target(arch)
    layers = (0, 2, target.config.num_hidden_layers - 1)
    ours, theirs = StaticTarget(target, layers, fused=fused or arch not in ARCHS), TargetAdapter(target, layers)
    assert (ours.fused is not None) == fused, ours.fused_reason
    a, b = ours.new_cache(), theirs.new_cache()
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, MASK, (1, n), generator=g)  # noqa: E731
    close = lambda x, y: torch.testing.assert_close(x, y, rtol=0, atol=1e-10)  # noqa: E731
    prompt = ids(9)
    s1, s2 = ours.forward(prompt, a, keep_logits=1), theirs.forward(prompt, b, keep_logits=1)
    close(s1.logits, s2.logits), close(s1.features, s2.features)
    for keep, n in ((2, 5), (5, 5), (1, 1), (3, 4)):  # rounds of different widths and acceptances
        block = ids(n)
        s1, s2 = ours.forward(block, a), theirs.forward(block, b)
        close(s1.logits, s2.logits), close(s1.features, s2.features)
        ours.rollback(a, s1, keep), theirs.rollback(b, s2, keep)
        assert a.length == b.get_seq_length()
    block = ids(5)
    s1, s2 = ours.forward(block, a), theirs.forward(block, b)
    ours.keep(a, s1, [0, 2, 3]), theirs.keep(b, s2, [0, 2, 3])  # a path that skips a slot
    block = ids(2)
    s1, s2 = ours.forward(block, a), theirs.forward(block, b)
    close(s1.logits, s2.logits)
    d = drafter_for(target, target_layer_ids=layers)
    tree = d.propose_tree(d.new_cache(), 3, s1.features, theirs, 6, 4)
    t1, t2 = ours.forward_tree(3, tree, a), theirs.forward_tree(3, tree, b)
    close(t1.logits, t2.logits), close(t1.features, t2.features)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_through_it_equals_generate(arch):
    target = tiny_target(arch, scale=4.0)
    d = drafter_for(target)
    fast, fast_ar = StaticTarget(target, d.target_layer_ids), StaticTarget(target)
    for prompt in ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7]):
        want = hf_greedy(target, prompt, 30)
        assert ar_generate(fast_ar, torch.tensor([prompt]), max_new_tokens=30).sequences[0].tolist() == want
        for verify in ("path", "tree"):
            out = spec_generate(d, fast, torch.tensor([prompt]), max_new_tokens=30, verify=verify, tree_nodes=6)
            assert out.sequences[0].tolist() == want, verify


@pytest.mark.parametrize("drafter_name, params_name", [("sampled_walk_sparse_q", "T0.7_topk2"),
                                                      ("viterbi", "T1.3_topp0.8"), ("fixed_path", "T1")])
def test_exact_distribution_through_it(drafter_name, params_name):
    drafter, params = exact.DRAFTERS[drafter_name](), exact.PARAMS[params_name]
    got, _ = exact.spec_distribution(drafter, params, tgt=StaticTarget(exact.target(), drafter.target_layer_ids))
    assert max_abs_diff(got, exact.ar_distribution(params)) < exact.EXACT


@functools.lru_cache(maxsize=None)
def compiled_target(layers: tuple[int, ...]) -> StaticTarget:
    return StaticTarget(exact.target(), layers, compile=True)


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
def test_the_compiled_step_is_lossless():
    """The compiled path: the exact sampled distribution, and greedy decoding equals generate.

    The model computes its RoPE tables in float32 (transformers does, whatever the model's dtype), and
    inductor's float32 cos/sin are not ATen's to the last bit: the compiled step's logits differ from
    eager by ~1e-8 and the sampled distribution from the eager model's AR one by ~1e-9. The
    tolerances below allow that, far under what the mutants of test_exact_distribution shift
    (DETECT = 1e-4)."""
    drafter = exact.DRAFTERS["sampled_walk_sparse_q"]()
    tgt = compiled_target(tuple(drafter.target_layer_ids))
    ids = torch.tensor([[1, 2, 0, 1]])
    eager = TargetAdapter(exact.target(), drafter.target_layer_ids)
    assert (tgt.forward(ids, tgt.new_cache()).logits - eager.forward(ids, eager.new_cache()).logits).abs().max() < 1e-6
    params = exact.PARAMS["T0.7_topk2"]
    got, _ = exact.spec_distribution(drafter, params, tgt=tgt)
    assert max_abs_diff(got, exact.ar_distribution(params)) < 1e-7
    for prompt in ([1, 2, 0, 1, 1, 2], [0]):
        want = hf_greedy(exact.target(), prompt, 20)
        for verify in ("path", "tree"):
            out = spec_generate(drafter, tgt, torch.tensor([prompt]), max_new_tokens=20, verify=verify, tree_nodes=4)
            assert out.sequences[0].tolist() == want, verify


def test_unsupported_targets_and_batches_are_refused():
    with pytest.raises(NotImplementedError, match="TargetAdapter"):
        StaticTarget(tiny_target("gpt2"))
    fast = StaticTarget(tiny_target("qwen3"))
    with pytest.raises(ValueError, match="batch 1"):
        fast.forward(torch.zeros(2, 3, dtype=torch.long), fast.new_cache())
    with pytest.raises(NotImplementedError, match="batch"):
        fast.forward_masked(None, None, None, None, None)
    small = StaticTarget(tiny_target("qwen3"), capacity=8)
    with pytest.raises(ValueError, match="holds 8"):
        small.forward(torch.zeros(1, 9, dtype=torch.long), small.new_cache())


def test_a_wrong_fused_layer_is_caught():
    """The check above is tight enough for the fused step's details: without Qwen3's per-head q/k norm,
    or with RoPE's rotation turned the other way, the logits move far past its tolerance."""
    target = tiny_target("qwen3")
    ids = torch.randint(0, MASK, (1, 9), generator=torch.Generator().manual_seed(2))
    want = TargetAdapter(target).forward(ids, TargetAdapter(target).new_cache()).logits
    for mutate in ("no qk norm", "rope reversed"):
        fast = StaticTarget(target)
        if mutate == "no qk norm":
            for layer in fast.fused.layers:
                layer.qk_norm = None
        else:
            rotary = fast.fused.rotary
            fast.fused.rotary = lambda x, pos: tuple(t * s for t, s in zip(rotary(x, pos), (1, -1)))
        got = fast.forward(ids, fast.new_cache()).logits
        assert (got - want).abs().max() > 1e-4, mutate
