"""The training script: configs and overrides, resume after a kill, DDP replicas, and learning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from dflash2.train.checkpoint import load_checkpoint
from dflash2.train.config import TrainConfig, load_config
from dflash2.train.run import train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=128)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # sharper distributions: the regenerated data has structure to learn
        model.get_output_embeddings().weight.mul_(4.0)
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(str(path))
    return str(path)


def overrides(target_dir: str, out: Path, **extra) -> list[str]:
    base = dict(target=target_dir, out=str(out), steps=6, batch_size=4, anchors_per_seq=3, ckpt_every=1,
                **{"data.num_sequences": 8, "data.prompt_tokens": 4, "data.new_tokens": 20,
                   "drafter.block_size": 4, "drafter.mask_token_id": 63, "drafter.selector_top_k": 4,
                   "drafter.selector_rank": 8})
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_config_file_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("target: some/dir\nsteps: 5\ndrafter:\n  block_size: 8\ndata:\n  new_tokens: 10\n")
    cfg = load_config(path, ["steps=7", "drafter.conv=none", "data.temperature=0.5"])
    assert (cfg.steps, cfg.drafter, cfg.data.new_tokens, cfg.data.temperature) == (7, {"block_size": 8, "conv": "none"}, 10, 0.5)
    with pytest.raises(ValueError, match="unknown config keys"):
        load_config(path, ["stepz=3"])
    with pytest.raises(ValueError, match="dotted.key=value"):
        load_config(path, ["steps"])
    with pytest.raises(ValueError, match="target"):
        TrainConfig()


def test_cli_bad_config_exits_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dflash2.train", "--config", str(tmp_path / "none.yaml")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "no such file" in out.stderr and "Traceback" not in out.stderr


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def test_resume_after_a_kill_matches_an_uninterrupted_run(target_dir, tmp_path):
    steps = 100  # long enough that the run cannot finish before the poller kills it after step 2
    straight = tmp_path / "straight"
    train(load_config(None, overrides(target_dir, straight, steps=steps)))

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dflash2.train", *overrides(target_dir, killed, steps=steps)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # kill it as soon as it has made progress, wherever it is
        state = load_checkpoint(killed / "ckpt.pt") if (killed / "ckpt.pt").exists() else None
        if state is not None and state["step"] >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = load_checkpoint(killed / "ckpt.pt")["step"]
    assert 2 <= resumed_from < steps, "the run must be killed mid-way for this test to mean anything"
    assert not (killed / "final").exists()
    train(load_config(None, overrides(target_dir, killed, steps=steps)))
    a, b = final_state(straight), final_state(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((killed / "ckpt.config.json").read_text())["steps"] == steps


def test_resuming_with_another_config_is_refused(target_dir, tmp_path):
    from dflash2.train.cli import main

    args = overrides(target_dir, tmp_path / "run", steps=4)
    train(load_config(None, args), stop_after=2)
    with pytest.raises(ValueError, match=r"another config.*'lr': \(0\.0006, 0\.001\)"):
        train(load_config(None, [*args, "lr=1e-3"]))
    assert main([*args, "lr=1e-3"]) == 2  # the CLI: one error line, no traceback
    train(load_config(None, [*args, "ckpt_every=2"]))  # a field that changes no result may differ
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 4


def test_the_log_holds_every_evaluation_once_across_a_resume(target_dir, tmp_path):
    """An evaluation between checkpoints is logged; a resume drops the records past its checkpoint, so the
    log of an interrupted run lists each step once, as an uninterrupted run's does."""
    out = tmp_path / "run"
    args = overrides(target_dir, out, steps=6, ckpt_every=3, eval_every=2, eval_sequences=2)
    train(load_config(None, args), stop_after=4)  # checkpoint at 3; records at 2 (eval), 3 (ckpt), 4 (eval)
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == [2, 3, 4] and load_checkpoint(out / "ckpt.pt")["step"] == 4  # the stop saved step 4
    (out / "log.jsonl").write_text((out / "log.jsonl").read_text() + json.dumps({"step": 5}) + "\n")  # past it
    train(load_config(None, args))
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 3, 4, 6] and all("heldout_tau" in r for r in log if r["step"] % 2 == 0)


def test_ddp_two_processes_keep_identical_replicas(target_dir, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
           "-m", "dflash2.train", *overrides(target_dir, out, steps=3)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    replicas = [json.loads((out / f"replica_{r}.json").read_text()) for r in (0, 1)]
    assert replicas[0]["step"] == replicas[1]["step"] == 3
    assert replicas[0]["digest"] == replicas[1]["digest"]
    assert (out / "final" / "model.safetensors").is_file()


def accuracy(run: Path, target_dir: str, drafter_dir: Path | None) -> float:
    """Top-1 accuracy of a drafter (untrained when drafter_dir is None) over the run's whole dataset."""
    from dflash2 import DFlash2Drafter, TargetAdapter
    from dflash2.train.forward import masked_block_forward, sample_anchors

    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir)
    torch.manual_seed(0)
    drafter = (DFlash2Drafter.from_pretrained(drafter_dir) if drafter_dir else
               DFlash2Drafter.from_target(target, block_size=4, mask_token_id=63, selector_top_k=4, selector_rank=8))
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    from dflash2.train.data import SequenceData

    data = SequenceData(run / "data")
    ids, _, _ = data.batch(range(len(data)), pad_id=0)
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], -1)
        anchors = sample_anchors(ids.shape[0], ids.shape[1], 4, 12, torch.Generator().manual_seed(123))
        blocks = masked_block_forward(drafter, adapter, ids, feats, anchors)
    return float((blocks.logits.argmax(-1) == blocks.labels).float().mean())


def test_a_short_run_learns(target_dir, tmp_path):
    out = tmp_path / "learn"
    train(load_config(None, overrides(target_dir, out, steps=60, ckpt_every=60, lr="3e-3", soft_targets=True,
                                      **{"data.num_sequences": 16})))
    before, after = accuracy(out, target_dir, None), accuracy(out, target_dir, out / "final")
    print(f"top-1 accuracy over the data: {before:.3f} untrained, {after:.3f} after 60 steps")
    assert after > before + 0.15


def test_init_starts_from_the_given_drafter(target_dir, tmp_path):
    first = tmp_path / "first"
    train(load_config(None, overrides(target_dir, first, steps=3)))
    tuned = tmp_path / "tuned"
    # lr 0: a fine-tune that cannot move must end exactly where it started (the AdamW step is lr * update)
    train(load_config(None, overrides(target_dir, tuned, steps=2, lr=0.0, init=str(first / "final"))))
    start, end = final_state(first), final_state(tuned)
    assert start.keys() == end.keys() and all(torch.equal(start[k], end[k]) for k in start)
    fresh = tmp_path / "fresh"
    train(load_config(None, overrides(target_dir, fresh, steps=2, lr=0.0)))
    assert not all(torch.equal(start[k], final_state(fresh)[k]) for k in start)  # without init: random
    deeper = tmp_path / "deeper"  # a deeper run grows the init drafter (DFlash2Drafter.grown), nothing else may differ
    train(load_config(None, overrides(target_dir, deeper, steps=2, lr=0.0, init=str(first / "final"),
                                      **{"drafter.num_layers": 2})))
    grown = final_state(deeper)
    assert all(torch.equal(start[k], grown[k]) for k in start)
    assert not grown["backbone.layers.1.self_attn.o_proj.weight"].any()
    assert not grown["backbone.layers.1.mlp.down_proj.weight"].any()
    with pytest.raises(ValueError, match="block_size': \\(4, 8\\)"):
        train(load_config(None, overrides(target_dir, tmp_path / "bad", init=str(first / "final"),
                                          **{"drafter.block_size": 8})))


def test_export_writes_the_last_checkpoint_as_a_drafter(target_dir, tmp_path):
    from dflash2 import DFlash2Drafter
    from dflash2.train.cli import main

    args = overrides(target_dir, tmp_path / "run", steps=4)
    assert main([*args, "--export", str(tmp_path / "none")]) == 2  # no checkpoint yet: one-line error
    train(load_config(None, args), stop_after=2)  # interrupted at step 2 of 4
    assert main([*args, "--export", str(tmp_path / "at2")]) == 0
    exported = DFlash2Drafter.from_pretrained(tmp_path / "at2").state_dict()
    stored = load_checkpoint(tmp_path / "run" / "ckpt.pt")["drafter"]
    assert all(torch.equal(exported[k], stored[k]) for k in stored)
    assert json.loads((tmp_path / "at2" / "train_config.json").read_text())["exported_step"] == 2
    train(load_config(None, args))  # the run goes on: the export changed nothing
    assert not all(torch.equal(final_state(tmp_path / "run")[k], stored[k]) for k in stored)


def test_data_regeneration_resumes_after_an_interruption(target_dir, tmp_path):
    from dflash2.train.prepare import regenerate
    from dflash2.train.data import HFBackend, SequenceData

    cfg = load_config(None, overrides(target_dir, tmp_path / "run", **{"data.num_sequences": 8, "data.temperature": 1.0,
                                                                       "data.shard_size": 2}))
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()

    class Interrupt(Exception):
        pass

    class DiesOnTheThirdShard(HFBackend):
        calls = 0

        def generate(self, *args, **kwargs):
            DiesOnTheThirdShard.calls += 1
            if DiesOnTheThirdShard.calls == 3:
                raise Interrupt
            return super().generate(*args, **kwargs)

    def rows(directory):
        data = SequenceData(directory)
        return data.rows["input_ids"], data.rows["label_mask"]

    whole = rows(regenerate(cfg, target, tmp_path / "whole", HFBackend(target, [], 0)))
    backend = DiesOnTheThirdShard(target, [], 0)
    with pytest.raises(Interrupt):
        regenerate(cfg, target, tmp_path / "partial", backend)
    assert sorted(p.name for p in (tmp_path / "partial").glob("shard_*")) == ["shard_00000", "shard_00001"]
    torch.manual_seed(12345)  # whatever ran before must not matter
    resumed = rows(regenerate(cfg, target, tmp_path / "partial", backend))
    assert DiesOnTheThirdShard.calls == 2 + 1 + 2  # the resumed run generated only the missing shards
    assert resumed == whole
    assert all(m == [False] * 4 + [True] * 20 for m in whole[1])  # labels: the 20 regenerated tokens
    other = load_config(None, overrides(target_dir, tmp_path / "run", **{"data.num_sequences": 8, "data.shard_size": 2}))
    with pytest.raises(ValueError, match="different data recipe.*temperature"):  # a complete dataset is never reused
        regenerate(other, target, tmp_path / "partial", backend)


def test_help_lists_every_config_key_with_its_default():
    out = subprocess.run([sys.executable, "-m", "dflash2.train", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0
    import dataclasses

    from dflash2.train.config import DataConfig

    for f in dataclasses.fields(TrainConfig):
        if f.name != "data":
            assert f"\n  {f.name} = " in out.stdout, f.name
    for f in dataclasses.fields(DataConfig):
        assert f"\n  data.{f.name} = " in out.stdout, f.name
    assert "  data.backend = 'hf'  (who regenerates" in out.stdout  # with the comment beside the field


def test_a_draft_vocabulary_run_drafts_among_the_datas_most_frequent_labels(target_dir, tmp_path):
    from dflash2 import DFlash2Drafter, ar_generate, spec_generate
    from dflash2.drafter.draft_vocab import most_frequent
    from dflash2.train.data import SequenceData

    out = tmp_path / "run"
    train(load_config(None, overrides(target_dir, out, steps=2, draft_vocab=16, eval_sequences=2)))
    data = SequenceData(out / "data")
    labels = [t for ids, mask in zip(data.rows[:6]["input_ids"], data.rows[:6]["label_mask"]) for t, m in zip(ids, mask) if m]
    drafter = DFlash2Drafter.from_pretrained(str(out / "final"))
    assert torch.equal(drafter.draft_vocab, most_frequent(torch.bincount(torch.tensor(labels), minlength=64), 16))
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt = torch.tensor([[3, 9, 27, 5]])
    got = spec_generate(drafter, target, prompt, max_new_tokens=24)
    assert torch.equal(got.sequences, ar_generate(target, prompt, max_new_tokens=24).sequences)  # lossless, as ever
    with pytest.raises(ValueError, match="draft_vocab"):
        load_config(None, overrides(target_dir, out, draft_vocab=16, **{"drafter.draft_vocab_size": 16}))
