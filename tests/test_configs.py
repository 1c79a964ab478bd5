"""Every YAML file under configs/ loads as what it is: a training run, a bench run, or a drafter diff."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from dflash2.bench import BenchConfig
from dflash2.bench.config import VLLM_METHODS
from dflash2.config import DFlash2Config
from dflash2.overrides import load_yaml_with_overrides
from dflash2.train.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


def test_every_config_is_listed_in_configs_readme():
    configs = Path(__file__).resolve().parents[1] / "configs"
    readme = (configs / "README.md").read_text()
    unlisted = [str(p.relative_to(configs)) for p in CONFIGS if f"`{p.relative_to(configs)}`" not in readme]
    assert CONFIGS and unlisted == []


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1] if p.parent.name != "configs"
                                                                            else p.parent)))
def test_every_config_loads(path):
    raw = load_yaml_with_overrides(path, [])
    if path.parent.name == "bench":
        unknown = set(raw) - {f.name for f in dataclasses.fields(BenchConfig)}
        assert not unknown
        if set(raw.get("methods", [])) & set(VLLM_METHODS):  # run with vllm_python=...: any file passes the check
            raw["vllm_python"] = sys.executable
        BenchConfig(**raw)
    elif "target" in raw:  # a training run: every key known, every value valid, the drafter fields too
        cfg = load_config(path, [])
        fields = {f.name for f in dataclasses.fields(DFlash2Config)}
        assert set(cfg.drafter) <= fields, set(cfg.drafter) - fields
    else:  # a drafter diff (python -m dflash2.generate --config ...)
        fields = {f.name for f in dataclasses.fields(DFlash2Config)}
        assert set(raw) <= fields, set(raw) - fields


@pytest.mark.parametrize("kind", ["dflash2", "dflash1"])
def test_every_training_stage_is_the_base_plus_overrides(kind):
    """The embedded drafters' stages (experiments/embedded/train_drafters.sh) load as valid configs."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    outs = set()
    for stage in range(1, 8):
        overrides = subprocess.run(["bash", "experiments/embedded/train_drafters.sh", "--overrides", str(stage), kind],
                                   cwd=root, capture_output=True, text=True, check=True).stdout.split()
        cfg = load_config(root / f"configs/embedded_{kind}.yaml", overrides)
        assert (cfg.init is None) == (stage == 1) and cfg.drafter["conv"] == ("two_tap" if kind == "dflash2" else "none")
        outs.add(cfg.out)
    assert len(outs) == 7  # every stage writes its own run
    bad = subprocess.run(["bash", "experiments/embedded/train_drafters.sh", "--overrides", "9", kind], cwd=root,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown stage 9" in bad.stderr
