"""Training for real targets: chat datasets in, regeneration by a backend, label masks, interrupts,
gradient accumulation and checkpointing, FSDP, and the vLLM backend (when vLLM is there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from dflash2.train.checkpoint import load_checkpoint
from dflash2.embedded import embedded_path
from dflash2.train.config import load_config
from dflash2.train.run import train
from dflash2.train.data import (Conversation, HFBackend, Sampling, SequenceData, StaticBackend, load_conversations, parse_row,
                                render)

ROOT = Path(__file__).resolve().parents[2]
EOS, MASK_ID, PAD = 0, 1, 2  # the embedded tokenizer's special tokens

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You write Python."},
                  {"role": "user", "content": "Sum a list of numbers."},
                  {"role": "assistant", "content": "this answer is dropped: the target regenerates it"}]},
    {"messages": [{"role": "user", "content": "Reverse a string."},
                  {"role": "assistant", "content": "dropped"},
                  {"role": "user", "content": "Now without slicing."}]},
    {"turns": ["Parse a date.", "Handle time zones too."]},
    {"turns": ["Read a CSV file."]},
    {"conversations": [{"from": "human", "value": "Sort a dict by value."}, {"from": "gpt", "value": "x"}]},
    {"messages": [{"role": "user", "content": "Open a socket."}]},
    {"instruction": "Write a retry decorator.", "input": "", "output": "dropped"},  # Alpaca, in the same file
]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> str:
    """A random Qwen3 over the embedded tokenizer (and its minimal chat template)."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=4096, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      # vLLM's CPU attention: head_dim >= 32
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=512, eos_token_id=EOS, pad_token_id=PAD)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)  # sharper: the regenerated answers have structure
    path = tmp_path_factory.mktemp("chat_target")
    model.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_path("tokenizer") / name, path / name)
    return str(path)


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    return path


def chat_overrides(target: str, data: Path, out: Path, **extra) -> list[str]:
    base = {"target": target, "out": str(out), "steps": 5, "batch_size": 2, "anchors_per_seq": 4, "ckpt_every": 1,
            "drafter.block_size": 4, "drafter.mask_token_id": MASK_ID, "drafter.selector_top_k": 4,
            "drafter.selector_rank": 8, "data.dataset": str(data), "data.new_tokens": 12, "data.shard_size": 4}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_rows_of_every_supported_shape_parse():
    convs = [parse_row(r, i) for i, r in enumerate(CONVERSATIONS)]
    assert convs[0] == Conversation("You write Python.", ["Sum a list of numbers."])
    assert convs[1].turns == ["Reverse a string.", "Now without slicing."]  # the data's assistant text is dropped
    assert convs[2] == Conversation(None, ["Parse a date.", "Handle time zones too."])
    assert convs[4].turns == ["Sort a dict by value."]
    alpaca = {"instruction": "Fix the bug.", "input": "x = 1 +", "output": "dropped"}
    assert parse_row(alpaca).turns == ["Fix the bug.\n\nx = 1 +"]
    assert parse_row({"instruction": "Say hi.", "input": ""}).turns == ["Say hi."]  # Alpaca: no blank input
    with pytest.raises(ValueError, match="neither `messages`"):
        parse_row({"text": "hello"}, 7)
    with pytest.raises(ValueError, match="row 3: a message needs a role"):
        parse_row({"messages": [{"role": "narrator", "content": "x"}]}, 3)


def test_conversations_load_from_jsonl_json_and_parquet(conversations_file, tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    for module in (datasets.config, huggingface_hub.constants):  # the hub lookup below: no network retries
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)

    want = load_conversations(str(conversations_file), system_prompt="Be brief.")
    assert len(want) == 7 and want[1].system == "Be brief." and want[0].system == "You write Python."
    rows = [{"turns": t.turns} for t in want]
    (tmp_path / "c.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    for name in ("c.json", "c.parquet"):
        assert [c.turns for c in load_conversations(str(tmp_path / name))] == [c.turns for c in want]
    assert len(load_conversations(str(conversations_file), limit=2)) == 2
    both = load_conversations([str(conversations_file), str(tmp_path / "c.json")], limit=8)  # sources in order
    assert [c.turns for c in both] == [c.turns for c in want] + [c.turns for c in want[:1]]
    with pytest.raises(FileNotFoundError, match="no such dataset file"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="cannot load the dataset"):
        load_conversations("no-such-owner/no-such-dataset-here")


def test_enable_thinking_reaches_the_template(chat_target):
    tok = transformers.AutoTokenizer.from_pretrained(chat_target)
    conv = Conversation(None, ["Add two numbers."])
    plain, off, on = (tok.decode(render(tok, conv, [], t)) for t in (None, False, True))
    assert plain == off == "# user: Add two numbers.\n# assistant:\n"
    assert on == plain + "# thinking first.\n"


def test_the_backend_stops_at_eos_and_keeps_it(chat_target):
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_target).eval()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    free = HFBackend(model, [EOS], PAD).generate(prompts, Sampling(8), seed=0)
    assert all(len(r) == 8 for r in free)  # the random target rarely says EOS: 8 tokens each
    stop = free[1][2]  # make the third token of row 1 an EOS: that row stops there, EOS kept
    cut = HFBackend(model, [stop], PAD).generate(prompts, Sampling(8), seed=0)
    assert cut[1] == free[1][:3]
    exact = HFBackend(model, [stop], PAD).generate(prompts, Sampling(8, stop_at_eos=False), seed=0)
    assert exact == free  # fixed-length prompts: past EOS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_static_backend_answers_as_generate_does(chat_target, temperature):
    """Continuous batching through our plain decoding: greedy, the same answers as `generate` (float64: no
    near-ties), stopped at EOS alike; sampled, seeded (the same seed, the same answers)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_target).to(torch.float64).eval()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [4], [20, 21]]
    free = HFBackend(model, [EOS], PAD).generate(prompts, Sampling(8, temperature), seed=0)
    stop = free[1][2]
    ours = StaticBackend(model, [stop], batch=2).generate(prompts, Sampling(8, temperature), seed=3)
    if temperature == 0.0:
        want = HFBackend(model, [stop], PAD).generate(prompts, Sampling(8), seed=0)
        assert ours == want and ours[1] == free[1][:3]
    else:
        assert ours == StaticBackend(model, [stop], batch=2).generate(prompts, Sampling(8, temperature), seed=3)
        assert all(1 <= len(r) <= 8 and (len(r) == 8 or r[-1] == stop) for r in ours)
    exact = StaticBackend(model, [stop], batch=3).generate(prompts, Sampling(8, temperature, stop_at_eos=False), seed=3)
    assert all(len(r) == 8 for r in exact)


def test_chat_data_labels_only_the_regenerated_answers(chat_target, conversations_file, tmp_path):
    from dflash2.train.run import Run
    from dflash2.train.forward import masked_block_forward, sample_masked_anchors

    cfg = load_config(None, chat_overrides(chat_target, conversations_file, tmp_path / "run", steps=1))
    run = Run(cfg)
    run.load_data()
    tok = transformers.AutoTokenizer.from_pretrained(chat_target)
    data = SequenceData(tmp_path / "run" / "data")
    assert len(data) == 7 and (tmp_path / "run" / "data" / "complete.json").is_file()
    convs = load_conversations(str(conversations_file))
    for conv, ids, mask in zip(convs, data.rows["input_ids"], data.rows["label_mask"]):
        start = mask.index(True)
        assert all(mask[start:]) and not any(mask[:start])  # one answer, at the end
        prompt = tok.decode(ids[:start])
        assert prompt.endswith("# assistant:\n") and conv.turns[-1] in prompt
        if conv.system:
            assert prompt.startswith(f"# system: {conv.system}\n")
        answer = tok.decode(ids[start:])
        assert not any(t in answer for t in conv.turns) and len(ids) - start <= 12
        if len(conv.turns) == 2:  # the second turn follows the target's own first answer
            first = prompt.split("# assistant:\n")[1].split("<|endoftext|>")[0]
            assert first and "dropped" not in prompt and f"# user: {conv.turns[1]}" in prompt
        assert ids[:start] == render(tok, conv, [first] if len(conv.turns) == 2 else [], None)
    ids, lengths, label_mask = data.batch(range(7), PAD)
    anchors, valid = sample_masked_anchors(label_mask, lengths, 4, 50, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = run.adapter.model(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in run.drafter.target_layer_ids], -1)
        blocks = masked_block_forward(run.drafter, run.adapter, ids, feats, anchors, label_mask=label_mask,
                                      valid=valid, logits=False)
    for n in range(7):
        for j in valid[n].nonzero()[:, 0].tolist():
            a = int(anchors[n, j])
            assert label_mask[n, a + 1] and a + 4 <= lengths[n]  # an anchor's first label is an answer token
            for k in range(1, 4):  # block position k: the token at a + k, counted only where it is a label
                assert blocks.labels[n, j, k - 1] == ids[n, a + k]
                assert blocks.weights[n, j, k - 1] == float(label_mask[n, a + k])


def self_stopping_run(args: list[str], at_step: int, how: str) -> subprocess.CompletedProcess:
    """The trainer CLI in a subprocess that sends itself `how` (SIGKILL / SIGTERM / SIGINT) right after
    finishing step `at_step` (0-based), before that step's checkpoint: a kill at a known place."""
    code = (
        "import os, signal, sys\n"
        "import dflash2.train.run as t\n"
        "from dflash2.train.cli import main\n"
        "step = t.Run.train_step\n"
        "def stopping(self, s):\n"
        "    out = step(self, s)\n"
        f"    if s == {at_step}:\n"
        f"        os.kill(os.getpid(), signal.{how})\n"
        "    return out\n"
        "t.Run.train_step = stopping\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, TQDM_DISABLE="1")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)


def test_chat_run_killed_and_resumed_equals_an_uninterrupted_run(chat_target, conversations_file, tmp_path):
    data = tmp_path / "shared_data"  # both runs train on the same regenerated data
    straight = chat_overrides(chat_target, conversations_file, tmp_path / "straight", **{"data.cache": str(data)})
    train(load_config(None, straight))
    killed = chat_overrides(chat_target, conversations_file, tmp_path / "killed", **{"data.cache": str(data)})
    proc = self_stopping_run(killed, at_step=2, how="SIGKILL")
    assert proc.returncode == -9
    assert load_checkpoint(tmp_path / "killed" / "ckpt.pt")["step"] == 2  # step 3's checkpoint never written
    proc = subprocess.run([sys.executable, "-m", "dflash2.train", *killed], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, TQDM_DISABLE="1"), timeout=300)
    assert proc.returncode == 0 and "resuming from step 2 of 5" in proc.stderr
    a, b = (load_file(str(tmp_path / r / "final" / "model.safetensors")) for r in ("straight", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("how, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_writes_a_checkpoint_and_exits_with_one_line(chat_target, conversations_file, tmp_path, how, code):
    args = chat_overrides(chat_target, conversations_file, tmp_path / "run", ckpt_every=10)
    proc = self_stopping_run(args, at_step=1, how=how)
    assert proc.returncode == code, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"interrupted by {how} at step 2 of 5: checkpoint written to {tmp_path / 'run' / 'ckpt.pt'}; " \
                   "the same command resumes"
    assert "Traceback" not in proc.stderr
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 2  # though ckpt_every is 10


def test_a_signal_during_regeneration_exits_cleanly_and_keeps_the_shards(chat_target, conversations_file, tmp_path):
    code = (
        "import os, signal, sys\n"
        "import dflash2.train.data as td\n"
        "gen, calls = td.HFBackend.generate, []\n"
        "def dying(self, *a, **k):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"  # shard 0: rounds 1 and 2; shard 1: its first round
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return gen(self, *a, **k)\n"
        "td.HFBackend.generate = dying\n"
        "from dflash2.train.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = chat_overrides(chat_target, conversations_file, tmp_path / "run")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, TQDM_DISABLE="1"), timeout=300)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("interrupted by SIGTERM: stopped before the first training step")
    assert [p.name for p in (tmp_path / "run" / "data").glob("shard_*")] == ["shard_00000"]


def test_gradient_accumulation_and_checkpointing_keep_the_step(chat_target, conversations_file, tmp_path, monkeypatch):
    """The gradient of one step (before clipping and AdamW, which would hide a wrong scale) is the same with
    micro-batches, recomputed layers or small loss chunks."""
    from dflash2.train.run import Run

    data = str(tmp_path / "data")
    grads = {}
    for name, extra in {"plain": {}, "accum": {"grad_accum": 2}, "recompute": {"gradient_checkpointing": True},
                        "chunked": {"loss_chunk": 3}}.items():
        run = Run(load_config(None, chat_overrides(chat_target, conversations_file, tmp_path / name, soft_targets=True,
                                                   batch_size=2, **{"data.cache": data}, **extra)))
        run.load_data()
        assert run.drafter.backbone.gradient_checkpointing == (name == "recompute")
        seen = []
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, _: seen.append([p.grad.clone() for p in params]))
        run.train_step(1)
        grads[name] = seen[0]
    for name in ("accum", "recompute", "chunked"):  # the same step, summed in another order
        for a, b in zip(grads[name], grads["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_held_out_tau_is_logged_and_held_out_sequences_are_never_trained(chat_target, conversations_file, tmp_path):
    from dflash2.train.run import batch_indices

    cfg = load_config(None, chat_overrides(chat_target, conversations_file, tmp_path / "run", steps=4, eval_every=2,
                                           eval_sequences=2))
    train(cfg)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    taus = [r["heldout_tau"] for r in log if "heldout_tau" in r]
    assert len(taus) == 2 and all(1.0 <= t <= 4.0 for t in taus)
    assert all(r["tokens_per_s"] > 0 and r["anchors_per_s"] > 0 for r in log)
    seen = torch.cat([batch_indices(s, cfg, 7 - 2, 0, 1) for s in range(100)])
    assert int(seen.max()) < 5  # sequences 5 and 6 are the held-out ones


def test_fsdp_two_processes_keep_the_result_of_ddp(chat_target, conversations_file, tmp_path):
    data = str(tmp_path / "data")
    train(load_config(None, chat_overrides(chat_target, conversations_file, tmp_path / "seed", steps=1,
                                           **{"data.cache": data})))  # regenerate once, outside torchrun
    finals = {}
    for port, parallel in ((29541, "ddp"), (29542, "fsdp")):
        out = tmp_path / parallel
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               "-m", "dflash2.train", *chat_overrides(chat_target, conversations_file, out, steps=3, parallel=parallel,
                                                       **{"data.cache": data})]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        finals[parallel] = load_file(str(out / "final" / "model.safetensors"))
    assert load_checkpoint(tmp_path / "fsdp" / "ckpt.pt")["fsdp"]
    for k, v in finals["ddp"].items():
        torch.testing.assert_close(finals["fsdp"][k], v, rtol=0, atol=1e-6)


def vllm_python() -> str | None:
    """An interpreter with vLLM: this one, or the one DFLASH2_VLLM_PYTHON names."""
    if os.environ.get("DFLASH2_VLLM_PYTHON"):
        return os.environ["DFLASH2_VLLM_PYTHON"]
    import importlib.util

    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed here (set DFLASH2_VLLM_PYTHON to a venv's "
                                                  "python that has it)")
def test_the_vllm_backend_regenerates_what_the_hf_backend_does(chat_target, conversations_file, tmp_path):
    from dflash2.train.prepare import regenerate

    rows = {}
    for backend in ("hf", "vllm"):
        cfg = load_config(None, chat_overrides(chat_target, conversations_file, tmp_path / backend,
                                               **{"data.backend": backend, "data.vllm_python": vllm_python(),
                                                  "data.shard_size": 7}))
        target = transformers.AutoModelForCausalLM.from_pretrained(chat_target).eval()
        data = SequenceData(regenerate(cfg, target, tmp_path / backend / "data"))
        rows[backend] = data.rows["input_ids"], data.rows["label_mask"]
    (hf_ids, hf_mask), (vllm_ids, vllm_mask) = rows["hf"], rows["vllm"]
    prompts = lambda ids, mask: [i[: m.index(True)] for i, m in zip(ids, mask)]  # noqa: E731
    same_prompt = [a == b for a, b in zip(prompts(hf_ids, hf_mask), prompts(vllm_ids, vllm_mask))]
    assert sum(same_prompt) >= 4  # multi-turn prompts hold the first answer, which float noise may change
    agree = [a == b for a, b, s in zip(hf_ids, vllm_ids, same_prompt) if s]
    assert sum(agree) >= len(agree) - 1  # greedy float32: one row may part on a near-tie
