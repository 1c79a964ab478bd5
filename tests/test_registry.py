"""A researcher's own selector (and convolution) by name: the registry (dflash2/registry.py), the
example of docs/architecture.md ("Extending") run as written and decoded losslessly, a selector named
by a config in a fresh process ("module:Name"), trained by name, and the messages for what a selector
lacks."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dflash2
from dflash2 import DFlash2Config, DFlash2Drafter, SamplingParams, spec_generate, spec_generate_batch
from dflash2.interfaces import Selector
from dflash2.registry import CONVS, SELECTORS, Registry
from dflash2.decoding.sampling import process_logits
from tests.helpers import MASK, enumerate_outcomes, exact_ar_distribution, hf_greedy, max_abs_diff, tiny_target

ROOT = Path(__file__).resolve().parents[1]


def extending_example() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Extending"):]
    return next(b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "register_selector" in b)


@pytest.fixture(scope="module")
def no_repeat():
    """The docs' example, executed as written (it registers "no_repeat")."""
    namespace: dict = {}
    exec(compile(extending_example(), "docs/architecture.md", "exec"), namespace)
    yield namespace["NoRepeat"]
    SELECTORS._factories.pop("no_repeat", None)


def drafter_of(selector: str, vocab: int = 48, block: int = 4, seed: int = 0, target=None) -> DFlash2Drafter:
    torch.manual_seed(seed)
    target = target if target is not None else tiny_target("qwen3", vocab=vocab)
    return DFlash2Drafter.from_target(target, block_size=block, mask_token_id=vocab - 1, selector=selector,
                                      selector_top_k=min(4, vocab), selector_rank=4).double().eval()


def test_the_docs_example_is_a_selector_written_against_the_protocol_alone(no_repeat):
    assert not issubclass(no_repeat, torch.nn.Module) and no_repeat.__mro__ == (no_repeat, object)
    drafter = drafter_of("no_repeat")  # by name, through DFlash2Config
    selector = drafter.candidate_selector
    assert isinstance(selector, no_repeat) and isinstance(selector, Selector)  # select_batch was filled in
    assert "no_repeat" in SELECTORS.names() and DFlash2Config(hidden_size=32, vocab_size=48, num_target_layers=4,
                                                              selector="no_repeat").selector == "no_repeat"
    # its rule holds: where the top-1 repeats the token before, the next candidate is drafted
    cands = dflash2.Candidates(torch.tensor([[5, 6], [5, 7], [8, 7]]), torch.tensor([[2.0, 1.0], [3.0, 0.0], [1.0, 0.0]]))
    hidden = torch.zeros(3, drafter.config.hidden_size)
    assert selector(cands, hidden, 5, 0.0, None).tokens.tolist() == [6, 5, 8]
    assert selector.select_batch(dflash2.Candidates(cands.ids[None], cands.scores[None]), hidden[None],
                                 [5])[0].tokens.tolist() == [6, 5, 8]
    model = tiny_target("qwen3")
    out = spec_generate(drafter, model, torch.tensor([[3, 7, 7, 7, 1]]), max_new_tokens=24)
    assert out.sequences[0].tolist() == hf_greedy(model, [3, 7, 7, 7, 1], 24)


@pytest.mark.parametrize("verify", ["path", "tree"])
def test_a_registered_selector_is_lossless_greedy_single_and_batched(no_repeat, verify):
    model = tiny_target("qwen3")
    drafter = drafter_of("walk").with_selector("no_repeat")  # with_selector by name keeps the backbone
    prompts = [[3, 7, 7, 7, 1], [9, 2]]
    for prompt in prompts:
        out = spec_generate(drafter, model, torch.tensor([prompt]), max_new_tokens=12, verify=verify, tree_nodes=5)
        assert out.sequences[0].tolist() == hf_greedy(model, prompt, 12)
    ids = torch.tensor([prompts[0], [0, 0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    rows = spec_generate_batch(drafter, model, ids, mask, max_new_tokens=12, verify=verify, tree_nodes=5)
    assert [r.sequences[0].tolist() for r in rows] == [hf_greedy(model, p, 12) for p in prompts]


def sampled_deviation(selector: str) -> tuple[float, int]:
    """Largest gap between the exact output distribution with `selector` and plain sampling, and branches."""
    V, prompt, n = 3, [1, 2], 4
    model = tiny_target("qwen3", vocab=V, seed=3)
    drafter = drafter_of(selector, vocab=V, block=3, target=model)
    params = SamplingParams(1.0)

    def program(rng):
        out = spec_generate(drafter, model, torch.tensor([prompt]), max_new_tokens=n, temperature=1.0, rng=rng)
        return tuple(out.new_tokens.tolist())

    ours, branches = enumerate_outcomes(program)
    exact = exact_ar_distribution(model, prompt, n, lambda logits: process_logits(logits, params))
    return max_abs_diff(ours, exact), branches


def test_a_registered_selector_samples_the_targets_distribution(no_repeat):
    deviation, branches = sampled_deviation("no_repeat")
    assert branches > 10 and deviation < 1e-12


def test_the_distribution_check_catches_a_selector_whose_q_is_not_what_it_drew():
    mutant = extending_example().replace("picks.append(rng.categorical(qs[-1]))", "picks.append(int(scores.argmax()))")
    assert mutant != extending_example()
    namespace: dict = {}
    exec(compile(mutant.replace('"no_repeat"', '"no_repeat_mutant"'), "mutant", "exec"), namespace)
    try:
        deviation, _ = sampled_deviation("no_repeat_mutant")
        assert deviation > 1e-4
    finally:
        SELECTORS._factories.pop("no_repeat_mutant", None)


def test_with_selector_takes_an_object_of_a_registered_class_and_saves_its_name(no_repeat, tmp_path):
    drafter = drafter_of("walk")
    mine = no_repeat(drafter.config)
    copy = drafter.with_selector(mine)
    assert copy.candidate_selector is mine and copy.config.selector == "no_repeat"
    assert torch.equal(copy.backbone.fc.weight, drafter.backbone.fc.weight)
    copy.save_pretrained(tmp_path / "d")
    again = DFlash2Drafter.from_pretrained(tmp_path / "d")
    assert isinstance(again.candidate_selector, no_repeat)
    with pytest.raises(ValueError, match="knows the built-in pieces only"):
        copy.save_pretrained(tmp_path / "r", format="reference")

    class Unregistered(no_repeat):
        pass

    with pytest.raises(ValueError, match=r"not registered; register it first"):
        drafter.with_selector(Unregistered(drafter.config))
    # walk -> viterbi keeps the trained codebooks; argmax -> walk through with_config refuses untrained ones
    assert torch.equal(drafter.with_selector("viterbi").candidate_selector.successor_codebook,
                       drafter.candidate_selector.successor_codebook)
    with pytest.raises(ValueError, match="needs trained parameters"):
        drafter.with_config(selector="argmax").with_config(selector="walk")


def _write_module(directory: Path) -> None:
    (directory / "my_selectors.py").write_text(extending_example().replace('@register_selector("no_repeat")', ""))


def test_a_config_names_a_selector_of_the_users_own_package_in_a_fresh_process(tmp_path):
    _write_module(tmp_path)
    config = tmp_path / "drafter.yaml"
    config.write_text("conv: two_tap\nselector: my_selectors:NoRepeat\nblock_size: 4\nselector_rank: 8\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "dflash2.generate", "--config", str(config), "--max-new-tokens", "12",
                          "--compare-ar"], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "greedy outputs identical: yes" in out.stdout
    # the embedded drafter with --selector, the same name
    out = subprocess.run([sys.executable, "-m", "dflash2.generate", "--selector", "my_selectors:NoRepeat",
                          "--max-new-tokens", "12", "--compare-ar"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0 and "greedy outputs identical: yes" in out.stdout, out.stderr[-2000:]


def test_a_selector_with_parameters_trains_by_name_through_a_training_config(tmp_path, monkeypatch):
    from dflash2.train.config import load_config
    from dflash2.train.run import train

    class Scaled(torch.nn.Module):  # protocol members only; one parameter, trained through edge_scores
        trains_on_candidates = True

        def __init__(self, config):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def edge_scores(self, prev, hidden, cand):
            return self.scale * (prev[..., :, None] == cand[..., None, :]).to(hidden.dtype)  # [..., P, K]

        def __call__(self, cands, hidden, anchor, temperature, rng):
            return dflash2.Draft(cands.ids[:, 0])

    dflash2.register_selector("scaled_test", Scaled)
    try:
        target = tiny_target("qwen3", vocab=48)
        target.save_pretrained(tmp_path / "target")
        cfg = load_config(None, [f"target={tmp_path / 'target'}", f"out={tmp_path / 'run'}", "steps=3", "batch_size=2",
                                 "ckpt_every=3", "drafter.selector=scaled_test", "drafter.block_size=4",
                                 f"drafter.mask_token_id={MASK}", "data.num_sequences=4", "data.prompt_tokens=4",
                                 "data.new_tokens=8", "dtype=float64", "selector_alpha=1.0"])
        out = train(cfg, log=lambda _: None)
        trained = DFlash2Drafter.from_pretrained(out / "final")
        assert trained.config.selector == "scaled_test" and isinstance(trained.candidate_selector, Scaled)
        assert float(trained.candidate_selector.scale.detach()) != 1.0  # the selector term of the loss reached it
    finally:
        SELECTORS._factories.pop("scaled_test", None)


def test_what_a_selector_lacks_is_named_with_what_it_is_for(no_repeat):
    class NoLattice:
        trains_on_candidates = False

        def __init__(self, config):
            pass

        def __call__(self, cands, hidden, anchor, temperature, rng):
            return dflash2.Draft(cands.ids[:, 0])

    class NotCallable:
        def __init__(self, config):
            pass

    class NoEdges(NoLattice):
        trains_on_candidates = True

    model = tiny_target("qwen3")
    for name, kind in (("no_lattice", NoLattice), ("not_callable", NotCallable), ("no_edges", NoEdges)):
        dflash2.register_selector(name, kind)
    try:
        drafter = drafter_of("no_lattice")  # path verification needs no lattice
        out = spec_generate(drafter, model, torch.tensor([[3, 7]]), max_new_tokens=6)
        assert out.sequences[0].tolist() == hf_greedy(model, [3, 7], 6)
        with pytest.raises(TypeError, match=r"no lattice\(cands, hidden, anchor\).*token trees are grown from"):
            spec_generate(drafter, model, torch.tensor([[3, 7]]), max_new_tokens=6, verify="tree")
        with pytest.raises(TypeError, match=r"'not_callable' .* is not callable: a selector's __call__"):
            drafter_of("not_callable")
        with pytest.raises(TypeError, match=r"trains_on_candidates = True but no edge_scores"):
            drafter_of("no_edges")
    finally:
        for name in ("no_lattice", "not_callable", "no_edges"):
            SELECTORS._factories.pop(name, None)


def test_registry_names_and_refusals():
    registry = Registry("piece", ("dflash2.drafter.selectors.codebook",))
    registry.register("a", dict)
    assert registry.register("a", dict) is dict  # the same factory again: fine
    with pytest.raises(ValueError, match="taken by"):
        registry.register("a", list)
    registry.register("a", list, replace=True)
    with pytest.raises(ValueError, match="non-empty string without spaces"):
        registry.register("a b", dict)
    with pytest.raises(ValueError, match=r"unknown piece 'b': registered are \['a'\]"):
        registry.factory("b")
    with pytest.raises(ValueError, match="cannot import Nope from dflash2.drafter.selectors.codebook"):
        registry.factory("dflash2.drafter.selectors.codebook:Nope")
    assert registry.factory("dflash2.drafter.selectors.codebook:WalkSelector").__name__ == "WalkSelector"
    with pytest.raises(ValueError, match="unknown selector 'nope'"):
        DFlash2Config(hidden_size=32, vocab_size=48, num_target_layers=4, selector="nope")
    with pytest.raises(ValueError, match="unknown conv 'nope'"):
        DFlash2Config(hidden_size=32, vocab_size=48, num_target_layers=4, conv="nope")


def test_a_registered_convolution_is_built_by_name():
    class Halved(torch.nn.Module):  # a sublayer's output halved: a different drafter, still lossless
        def forward(self, h, sublayer, rows=None):
            return 0.5 * sublayer(h)

    dflash2.register_conv("halved_test", lambda config: Halved())
    try:
        drafter = DFlash2Drafter.from_target(tiny_target("qwen3"), block_size=4, mask_token_id=MASK, conv="halved_test",
                                             selector="argmax")
        layer = drafter.backbone.layers[0]
        assert isinstance(layer.attention_conv, Halved) and isinstance(layer.mlp_conv, Halved)
        model = tiny_target("qwen3")
        out = spec_generate(drafter.double(), model, torch.tensor([[3, 7]]), max_new_tokens=8)
        assert out.sequences[0].tolist() == hf_greedy(model, [3, 7], 8)
    finally:
        CONVS._factories.pop("halved_test", None)


def test_the_builtin_names_are_registered():
    assert set(SELECTORS.names()) >= {"walk", "viterbi", "argmax"} and set(CONVS.names()) >= {"two_tap", "none"}
    assert textwrap.dedent(extending_example()).startswith("import torch")
