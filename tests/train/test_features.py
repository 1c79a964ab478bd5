"""The feature cache (offline mode): the same features and the same step as the target run in every step,
resumable shard by shard, refused when it belongs to another dataset or lacks a layer."""

from __future__ import annotations

import pytest
import torch

from dflash2.train.config import load_config
from dflash2.train.prepare import prepare_data
from dflash2.train.run import Run
from dflash2.train.data import SequenceData
from dflash2.train.features import FeatureCache, build_features
from tests.train import test_run
from tests.train.test_run import overrides

target_dir = test_run.target_dir  # the fixture


def config(target_dir, tmp_path, **extra):
    return load_config(None, overrides(target_dir, tmp_path / "run", **{"data.num_sequences": 6, "data.shard_size": 4,
                                                                         "data.cache": str(tmp_path / "data"), **extra}))


def test_cached_features_give_the_step_the_target_gives(target_dir, tmp_path):
    online = Run(config(target_dir, tmp_path))
    online.load_data()
    cached = Run(config(target_dir, tmp_path, **{"data.features": str(tmp_path / "features"), "data.feature_dtype": "float32"}))
    cached.load_data()
    assert cached.features is not None and len(list((tmp_path / "features").glob("shard_*.pt"))) == 2
    indices = torch.tensor([5, 0, 3])  # across both shards, out of order
    a, b = (r.batch(indices, torch.Generator().manual_seed(1)) for r in (online, cached))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    lengths = torch.tensor([len(online.data.rows["input_ids"][int(i)]) for i in indices])
    real = torch.arange(a[1].shape[1])[None] < lengths[:, None]
    torch.testing.assert_close(b[1][real], a[1][real], atol=1e-5, rtol=1e-5)  # a fused float32 prefill against forward
    assert not b[1][~real].any()
    la, lb = online.train_step(0)[0], cached.train_step(0)[0]
    torch.testing.assert_close(lb.total, la.total, atol=1e-5, rtol=1e-5)


def test_a_build_resumes_and_a_run_reads_any_subset_of_its_layers(target_dir, tmp_path):
    cfg = config(target_dir, tmp_path, **{"data.features": str(tmp_path / "features")})
    prepare_data(cfg)  # the data and the features, as --data-only does
    whole = [torch.load(p) for p in sorted((tmp_path / "features").glob("shard_*.pt"))]
    data = SequenceData(tmp_path / "data")
    recipe = __import__("json").loads((tmp_path / "features" / "recipe.json").read_text())
    model = Run(cfg).target

    class Stop(Exception):
        pass

    def dies_after_five(n):
        dies_after_five.seen += n
        if dies_after_five.seen == 5:
            raise Stop
    dies_after_five.seen = 0
    with pytest.raises(Stop):
        build_features(tmp_path / "partial", recipe, tmp_path / "data", model, dies_after_five)
    assert [p.name for p in (tmp_path / "partial").glob("shard_*.pt")] == ["shard_00000.pt"]
    build_features(tmp_path / "partial", recipe, tmp_path / "data", model)
    again = [torch.load(p) for p in sorted((tmp_path / "partial").glob("shard_*.pt"))]
    assert all(torch.equal(x["features"], y["features"]) and torch.equal(x["offsets"], y["offsets"])
               for x, y in zip(whole, again)) and len(again) == 2

    layers, H = recipe["layer_ids"], recipe["hidden_size"]
    full, one = FeatureCache(tmp_path / "features", data, tuple(layers)), FeatureCache(tmp_path / "features", data, (layers[-1],))
    width = max(len(r) for r in data.rows["input_ids"])
    assert torch.equal(one.batch([2, 4], width, torch.float32), full.batch([2, 4], width, torch.float32)[..., -H:])
    with pytest.raises(ValueError, match="not \\[99\\]"):
        FeatureCache(tmp_path / "features", data, (99,))
    with pytest.raises(ValueError, match="another recipe"):
        build_features(tmp_path / "features", dict(recipe, linear_dtype="bfloat16"), tmp_path / "data", model)
    with pytest.raises(FileNotFoundError, match="no complete feature cache"):
        FeatureCache(tmp_path / "nothing", data, tuple(layers))
    with pytest.raises(ValueError, match="soft_targets"):
        config(target_dir, tmp_path, soft_targets=True, **{"data.features": str(tmp_path / "features")})
