"""StaticTarget: the target's own layers over a preallocated cache (optionally compiled) give the
same steps as the model's forward, so decoding through it stays lossless: greedy equality with
`generate` in float64 and the exact sampled distribution, eager and compiled; at batch 1 and in
batches (the batched loop's passes, row moves and slot moves; the batched exact distribution is in
tests/decoding/test_batch.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from dflash2 import DFlash2Drafter, TargetAdapter, ar_generate, ar_generate_batch, spec_generate, spec_generate_batch
from dflash2.decoding.batch import left_pad
from dflash2.targets.static import StaticTarget
from tests.decoding import test_exact_distribution as exact
from dflash2.decoding.sampling import process_logits
from tests.helpers import (HAS_CXX_COMPILER, MASK, DraftEvery, exact_ar_distribution, hf_greedy, max_abs_diff, tiny_target,
                           with_linears_in)

ARCHS = ["qwen3", "llama", "mistral_sliding"]
BF16 = torch.bfloat16


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


@pytest.mark.parametrize("arch, fused, linear_dtype",
                         [(a, True, None) for a in ARCHS] + [(a, False, None) for a in ARCHS]
                         + [("qwen2_biased_sliding", True, None), ("llama_biased", True, None), ("llama_yarn", True, None),
                            ("llama_dynamic_rope", False, None)]
                         + [(a, True, BF16) for a in ("qwen3", "mistral_sliding", "qwen2_biased_sliding", "llama_biased")])
def test_steps_equal_the_models_forward(arch, fused, linear_dtype):
    """Prefill, verify passes, rollbacks, a kept non-prefix path and a tree: logits and features equal
    TargetAdapter's (the model's forward over its own cache), the last layer's normed state included;
    through the fused step where the layout allows it (`fused`: whether it does), else the model's layers.
    With bfloat16 products (`linear_dtype`), the model to equal is the same one with every nn.Linear
    computing in bfloat16, and it is not the float model: the option changes the arithmetic."""
    target = tiny_target(arch) if arch in ARCHS else extra_target(arch)
    layers = (0, 2, target.config.num_hidden_layers - 1)
    reference = target if linear_dtype is None else with_linears_in(target, linear_dtype)
    ours = StaticTarget(target, layers, fused=fused or arch not in ARCHS, linear_dtype=linear_dtype)
    theirs = TargetAdapter(reference, layers)
    assert (ours.fused is not None) == fused, ours.fused_reason
    a, b = ours.new_cache(), theirs.new_cache()
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, MASK, (1, n), generator=g)  # noqa: E731
    # bfloat16 products accumulate in float32 in an order that depends on the kernel (AMX or not) and
    # the matrix's width (fused q/k/v against three products): equal up to float32 rounding, not float64's
    atol = 1e-10 if linear_dtype is None else 1e-6
    close = lambda x, y: torch.testing.assert_close(x, y, rtol=0, atol=atol)  # noqa: E731
    prompt = ids(9)
    s1, s2 = ours.forward(prompt, a, keep_logits=1), theirs.forward(prompt, b, keep_logits=1)
    close(s1.logits, s2.logits), close(s1.features, s2.features)
    if linear_dtype is not None:
        plain = TargetAdapter(target, layers)
        assert (plain.forward(prompt, plain.new_cache(), keep_logits=1).logits - s1.logits).abs().max() > 1e-4
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


def test_batch_one_buffers_grow_with_the_sequence_up_to_capacity():
    """A cache's buffers hold twice its first pass's slots and double when a pass fills them, never past
    capacity, the slots in use carried over: the logits through every growth equal the model's forward.
    No pass ends at the buffers' last slot short of capacity (the compiled graphs are warmed up on passes
    that end short of it). Buffers of the whole capacity from the first pass zeroed megabytes a decode."""
    target = tiny_target("qwen3")
    ours, theirs = StaticTarget(target, capacity=40), TargetAdapter(target)
    a, b = ours.new_cache(), theirs.new_cache()
    g = torch.Generator().manual_seed(3)
    sizes = []
    for n in (3, 1, 2, 1, 5, 4, 8, 6, 9):  # passes ending at 3, 4, 6, 7, 12, 16, 24, 30, 39
        block = torch.randint(0, MASK, (1, n), generator=g)
        s1, s2 = ours.forward(block, a), theirs.forward(block, b)
        torch.testing.assert_close(s1.logits, s2.logits, rtol=0, atol=1e-10)
        sizes.append(a.keys[0].shape[2])
        assert a.length < sizes[-1] or sizes[-1] == 40
    assert sizes == [6, 6, 12, 12, 24, 24, 40, 40, 40]
    with pytest.raises(ValueError, match="holds 40"):
        ours.forward(torch.zeros(1, 2, dtype=torch.long), a)


@pytest.mark.parametrize("arch, linear_dtype", [(a, None) for a in ARCHS] + [("qwen3", BF16), ("mistral_sliding", BF16)])
def test_decoding_through_it_equals_generate(arch, linear_dtype):
    """Greedy decoding (AR, paths, trees) equals `generate`: of the model, or with bfloat16 products of
    the model whose linears compute in bfloat16."""
    target = tiny_target(arch, scale=4.0)
    reference = target if linear_dtype is None else with_linears_in(target, linear_dtype)
    d = drafter_for(target)
    fast = StaticTarget(target, d.target_layer_ids, linear_dtype=linear_dtype)
    fast_ar = StaticTarget(target, linear_dtype=linear_dtype)
    for prompt in ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7]):
        want = hf_greedy(reference, prompt, 30)
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


def test_exact_distribution_with_bf16_products():
    """With bfloat16 products the sampled distribution is exactly plain decoding's by the model whose
    linears compute in bfloat16, and measurably not the float model's (the option is not a no-op)."""
    drafter, params = exact.DRAFTERS["sampled_walk_sparse_q"](), exact.PARAMS["T0.7_topk2"]
    tgt = StaticTarget(exact.target(), drafter.target_layer_ids, linear_dtype="bfloat16")
    got, _ = exact.spec_distribution(drafter, params, tgt=tgt)
    want = exact_ar_distribution(with_linears_in(exact.target(), BF16), exact.PROMPT, exact.N_NEW,
                                 lambda logits: process_logits(logits, params))
    assert max_abs_diff(got, want) < exact.EXACT
    assert max_abs_diff(got, exact.ar_distribution(params)) > exact.DETECT


@functools.lru_cache(maxsize=None)
def compiled_target(layers: tuple[int, ...], gemm: str = "auto") -> StaticTarget:
    return StaticTarget(exact.target(), layers, compile=True, gemm=gemm)


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("gemm", ["auto", "aten"])
def test_the_compiled_step_is_lossless(gemm):
    """The compiled path: the exact sampled distribution, and greedy decoding equals generate.

    The model computes its RoPE tables in float32 (transformers does, whatever the model's dtype), and
    inductor's float32 cos/sin are not ATen's to the last bit: the compiled step's logits differ from
    eager by ~1e-8 and the sampled distribution from the eager model's AR one by ~1e-9. The
    tolerances below allow that, far under what the mutants of test_exact_distribution shift
    (DETECT = 1e-4)."""
    drafter = exact.DRAFTERS["sampled_walk_sparse_q"]()
    tgt = compiled_target(tuple(drafter.target_layer_ids), gemm)
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
    # batches: one-token passes compiled (plain steps: AR, and rounds a policy does not draft), rows leaving
    prompts = [[1, 2, 0, 1, 1, 2], [0], [2, 2, 1], [1, 0]]
    want = [hf_greedy(exact.target(), p, 12) for p in prompts]
    ids, mask = left_pad(prompts)
    plain = StaticTarget(exact.target(), compile=True, gemm=gemm)
    assert [r.sequences[0].tolist() for r in ar_generate_batch(plain, ids, mask, max_new_tokens=12, concurrency=3)] == want
    assert plain.warmed == {"batch"}  # the batch-1 graphs compile only when a batch-1 pass comes
    rows = spec_generate_batch(drafter, tgt, ids, mask, max_new_tokens=12, concurrency=3, verify="tree", tree_nodes=4,
                               policy=DraftEvery(2))
    assert [r.sequences[0].tolist() for r in rows] == want


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("gemm", ["inductor", "aten"])
def test_gemm_decides_who_writes_the_compiled_products(gemm, capfd):
    """gemm="inductor": the compiled graphs hold the weights as frozen constants and call no prepacked
    oneDNN product (inductor writes or picks each product itself); gemm="aten": each product is the
    prepacked oneDNN call, the weights read as they are. Either mechanism dropped (the products left as
    library calls, or the weights not frozen) fails here. Autotuning prints its timings by default: a
    warm-up off a terminal prints nothing."""
    from torch._inductor.utils import run_and_get_code

    tgt = StaticTarget(exact.target(), compile=True, linear_dtype=BF16, gemm=gemm)
    capfd.readouterr()
    _, codes = run_and_get_code(tgt.warm_up, "single")
    code = "\n".join(codes)
    assert codes and ("packed_linear" in code) == (gemm == "aten")
    assert ("_frozen_param" in code) == (gemm == "inductor")
    printed = capfd.readouterr()
    assert "utotune" not in printed.out + printed.err


def test_gemm_is_checked():
    """A gemm that is not one of the choices, or "inductor" without a compiled fused step, is refused;
    "auto" without compilation is the eager path's library call."""
    with pytest.raises(ValueError, match="gemm must be one of"):
        StaticTarget(exact.target(), gemm="mkl")
    with pytest.raises(ValueError, match="needs compile=True"):
        StaticTarget(exact.target(), gemm="inductor")
    with pytest.raises(ValueError, match="needs compile=True"):
        StaticTarget(exact.target(), compile=True, fused=False, gemm="inductor")
    assert StaticTarget(exact.target()).gemm == "aten"
    assert StaticTarget(exact.target(), compile=True).gemm == "inductor"
    with pytest.raises(ValueError, match="gemm must be one of"):
        exact.DRAFTERS["sampled_walk_sparse_q"]().compile(gemm="mkl")


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
def test_the_compiled_step_compiles_only_while_warming_up():
    """Once warmed up, passes of other rows, widths and cache lengths run the graphs the warm-up compiled:
    it marks the sizes a decode varies dynamic, so no graph specialises on a size it happened to see (a
    tree's width, three rows, the scratch cache's length). A compile inside a decode would land in a
    timed run; a graph specialised on a size would be compiled again for every new one."""
    drafter = exact.DRAFTERS["sampled_walk_sparse_q"]()
    tgt = StaticTarget(exact.target(), tuple(drafter.target_layer_ids), compile=True)
    plain = StaticTarget(exact.target(), compile=True)
    for t in (tgt, plain):
        t.warm_up("single")
        t.warm_up("batch")
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    before = graphs()
    prompts = [[1, 2, 0, 1, 1, 2, 0, 2, 1], [0], [2, 2, 1], [1, 0], [2, 1, 1, 0, 2]]
    for prompt in prompts[:2]:
        ar_generate(plain, torch.tensor([prompt]), max_new_tokens=9)
        for verify, nodes in (("path", 15), ("tree", 4), ("tree", 9)):
            spec_generate(drafter, tgt, torch.tensor([prompt]), max_new_tokens=12, verify=verify, tree_nodes=nodes)
    ids, mask = left_pad(prompts)
    for rows in (5, 4, 2):  # continuous batching: the rows in flight shrink as rows finish
        ar_generate_batch(plain, ids, mask, max_new_tokens=7, concurrency=rows)
        spec_generate_batch(drafter, tgt, ids, mask, max_new_tokens=7, concurrency=rows, verify="tree", tree_nodes=4,
                            policy=DraftEvery(2))
    assert graphs() == before


def test_each_kind_of_pass_runs_its_own_graphs():
    """Prefills, batch 1's later passes, a batch's one-token passes and its wider passes (verification)
    go to four compiled callables, each with graphs of its own (compiled or not, the routing is the
    same); a one-token prompt's prefill runs eager. `passes` counts the kinds as routed: a kind sent to
    another's graphs would mix their guards, one sent to the eager step would drop its compilation."""
    drafter = exact.DRAFTERS["sampled_walk_sparse_q"]()
    tgt, plain = StaticTarget(exact.target(), tuple(drafter.target_layer_ids)), StaticTarget(exact.target())
    prompts = [[1, 2, 0, 1, 1, 2], [0], [2, 2, 1], [1, 0]]
    ids, mask = left_pad(prompts)
    spec_generate_batch(drafter, tgt, ids, mask, max_new_tokens=8, concurrency=2, verify="tree", tree_nodes=4,
                        policy=DraftEvery(2))
    assert set(tgt.passes) == {"prefill", "eager", "one", "wide"} and tgt.passes["eager"] == 1, tgt.passes  # [0] is eager
    tgt.passes.clear()
    spec_generate(drafter, tgt, torch.tensor([prompts[0]]), max_new_tokens=8, verify="tree", tree_nodes=4)
    ar_generate(plain, torch.tensor([prompts[0]]), max_new_tokens=3)
    ar_generate(plain, torch.tensor([[0]]), max_new_tokens=3)  # a one-token prompt
    assert tgt.passes.keys() == {"prefill", "single"} and plain.passes == {"prefill": 1, "eager": 1, "single": 4}, \
        (tgt.passes, plain.passes)


def recording(target):
    """The target with its batched operations wrapped on the instance: every pass's step is kept in
    `target.steps`, and the cache operations the loop called are counted in `target.calls`."""
    target.steps, target.calls = [], {}

    def wrap(name):
        method = getattr(target, name)

        def call(*args, **kwargs):
            target.calls[name] = target.calls.get(name, 0) + 1
            if name == "append_rows" and hasattr(args[0], "length") and args[1].length > args[0].length:
                target.calls["append_rows, newcomers longer"] = target.calls.get("append_rows, newcomers longer", 0) + 1
            out = method(*args, **kwargs)
            if name == "forward_masked":  # and which queries are real: a block's padding does not see itself
                ids, allowed = args[0], args[3]
                W = ids.shape[1]
                target.steps.append((out, allowed[:, :, -W:].diagonal(dim1=1, dim2=2)))
            return out
        setattr(target, name, call)

    for name in ("forward_masked", "select_rows", "append_rows", "keep_slots", "keep_block"):
        wrap(name)
    return target


# the fourth joins a running batch with a longer prompt than the batch has slots (the running rows move right)
BATCH_PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [5, 5, 1], [(7 * i) % 40 for i in range(60)], [1]]


@pytest.mark.parametrize("arch, fused, linear_dtype",
                         [(a, True, None) for a in ARCHS] + [("qwen3", False, None), ("mistral_sliding", False, None),
                                                             ("qwen2_biased_sliding", True, None), ("qwen3", True, BF16)])
def test_batched_passes_equal_the_models_forward(arch, fused, linear_dtype):
    """The batched loop over StaticTarget and over TargetAdapter, side by side with the same drafter:
    every pass's logits and features agree (float64, 1e-10). Continuous batching at concurrency 2
    admits newcomers with longer and shorter prompts (append_rows pads either cache), rows leave
    (select_rows), trees keep non-adjacent slots (keep_block) and dead slots are dropped (keep_slots).
    With bfloat16 products: against the model whose linears compute in bfloat16."""
    target = tiny_target(arch, scale=4.0) if arch in ARCHS else extra_target(arch)
    d = drafter_for(target)
    ours = recording(StaticTarget(target, d.target_layer_ids, fused=fused, linear_dtype=linear_dtype))
    reference = target if linear_dtype is None else with_linears_in(target, linear_dtype)
    theirs = recording(TargetAdapter(reference, d.target_layer_ids))
    assert (ours.fused is not None) == fused, ours.fused_reason
    ids, mask = left_pad(BATCH_PROMPTS)
    outs = [spec_generate_batch(d, t, ids, mask, max_new_tokens=24, concurrency=2, verify="tree", tree_nodes=6)
            for t in (ours, theirs)]
    assert [o.sequences.tolist() for o in outs[0]] == [o.sequences.tolist() for o in outs[1]]
    assert len(ours.steps) == len(theirs.steps) > 10
    exact, positions = 0, 0
    for (a, real), (b, _) in zip(ours.steps, theirs.steps):  # the padding queries of a block are left out: on a
        # sliding layer one may see no key at all, which the two attentions fill differently (the loop never reads it)
        la, lb = a.logits[real[:, -a.logits.shape[1]:]], b.logits[real[:, -b.logits.shape[1]:]]
        if linear_dtype is None:
            torch.testing.assert_close(la, lb, rtol=0, atol=1e-10)
            torch.testing.assert_close(a.features[real], b.features[real], rtol=0, atol=1e-10)
        else:  # bfloat16 products round each output: where the two GEMMs (one q/k/v matrix against three)
            # accumulate in another order, a rounding can land one bfloat16 step apart, rarely
            exact += int(((la - lb).abs().amax(-1) < 1e-10).sum()) if la.shape == lb.shape else 0
            positions += la.shape[0]
    if linear_dtype is not None:
        assert exact >= 0.9 * positions, f"{exact} of {positions} positions equal the bfloat16-linear model's"
    ops = ("select_rows", "append_rows", "append_rows, newcomers longer", "keep_slots", "keep_block")
    assert all(ours.calls.get(op, 0) > 0 for op in ops), ours.calls


@pytest.mark.parametrize("arch, linear_dtype", [(a, None) for a in ARCHS] + [("qwen3", BF16)])
def test_batched_decoding_through_it_equals_generate(arch, linear_dtype):
    """ar_generate_batch and spec_generate_batch (path and tree, all rows at once and 2 at a time)
    through StaticTarget give each row's greedy continuation (with bfloat16 products: that of the model
    whose linears compute in bfloat16)."""
    target = tiny_target(arch, scale=4.0)
    d = drafter_for(target)
    fast = StaticTarget(target, d.target_layer_ids, linear_dtype=linear_dtype)
    fast_ar = StaticTarget(target, linear_dtype=linear_dtype)
    reference = target if linear_dtype is None else with_linears_in(target, linear_dtype)
    want = [hf_greedy(reference, p, 25) for p in BATCH_PROMPTS]
    ids, mask = left_pad(BATCH_PROMPTS)
    for concurrency in (None, 2):
        got = ar_generate_batch(fast_ar, ids, mask, max_new_tokens=25, concurrency=concurrency)
        assert [o.sequences[0].tolist() for o in got] == want, concurrency
        for verify in ("path", "tree"):
            got = spec_generate_batch(d, fast, ids, mask, max_new_tokens=25, concurrency=concurrency, verify=verify,
                                      tree_nodes=6)
            assert [o.sequences[0].tolist() for o in got] == want, (concurrency, verify)


def test_a_wrong_batched_cache_move_is_caught():
    """Mutants of the batched cache operations move the logits away from the model's forward: a
    newcomer with a longer prompt copied in without moving the running rows' slots right, rows kept
    without moving them down, a tree's kept slots cropped instead of moved."""
    target = tiny_target("qwen3", scale=4.0)
    d = drafter_for(target)
    ids, mask = left_pad(BATCH_PROMPTS)

    class NoShift(StaticTarget):
        def append_rows(self, cache, other):  # append_rows without moving the running rows' slots right
            S, S2, R, n = cache.length, other.length, cache.rows, other.rows
            L = max(S, S2)
            self._reserve_rows(cache, R + n, L)
            for b, t in zip(cache.keys + cache.values, other.keys + other.values):
                b[R: R + n, :, L - S2: L] = t[:n, :, :S2]
            cache.rows, cache.length = R + n, L

    class NoRowMove(StaticTarget):
        def select_rows(self, cache, rows):
            cache.rows = rows.numel()  # the first rows stay, whichever finished

    class CropOnly(StaticTarget):
        def keep_block(self, cache, start, slots):
            cache.length = start + slots.shape[1]

    def passes(tgt):
        tgt = recording(tgt)
        spec_generate_batch(d, tgt, ids, mask, max_new_tokens=24, concurrency=2, verify="tree", tree_nodes=6)
        return [(step.logits, real) for step, real in tgt.steps]

    want = passes(TargetAdapter(target, d.target_layer_ids))
    assert all((a - b)[r[:, -a.shape[1]:]].abs().max() < 1e-10
               for (a, r), (b, _) in zip(passes(StaticTarget(target, d.target_layer_ids)), want))
    for mutant in (NoShift, NoRowMove, CropOnly):
        got = passes(mutant(target, d.target_layer_ids))
        worst = max((a - b)[r[:, -a.shape[1]:]].abs().max() if a.shape == b.shape else float("inf")
                    for (a, r), (b, _) in zip(got, want))
        assert worst > 1e-4 or len(got) != len(want), mutant.__name__


def test_unsupported_targets_and_batches_are_refused():
    with pytest.raises(NotImplementedError, match="TargetAdapter"):
        StaticTarget(tiny_target("gpt2"))
    fast = StaticTarget(tiny_target("qwen3"))
    with pytest.raises(ValueError, match="batch 1"):
        fast.forward(torch.zeros(2, 3, dtype=torch.long), fast.new_cache())
    with pytest.raises(TypeError, match="StaticCache"):
        fast.forward_masked(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, 1, dtype=torch.bool),
                            TargetAdapter(tiny_target("qwen3")).new_cache())
    small = StaticTarget(tiny_target("qwen3"), capacity=8)
    with pytest.raises(ValueError, match="holds 8"):
        small.forward(torch.zeros(1, 9, dtype=torch.long), small.new_cache())
    with pytest.raises(NotImplementedError, match="needs the fused step.*fused=False"):
        StaticTarget(tiny_target("qwen3"), fused=False, linear_dtype="bfloat16")
    with pytest.raises(NotImplementedError, match="needs the fused step.*dynamic"):
        StaticTarget(extra_target("llama_dynamic_rope"), linear_dtype=BF16)
    for bad in ("bf16", "int8", 3):
        with pytest.raises(ValueError, match="linear_dtype"):
            StaticTarget(tiny_target("qwen3"), linear_dtype=bad)


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
