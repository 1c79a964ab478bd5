"""The target's features, computed once per dataset and read by every run that trains on it.

The target is frozen, so its hidden states at the drafter's layers are a function of the dataset:
caching them removes the target from training (on a CPU it costs more than the drafter's step) and
lets every variant of an ablation share one cache.

    <directory>/recipe.json    target, layer ids, hidden size, products, storage dtype, the data's recipe
    <directory>/shard_00000.pt {"features": [sum of the shard's lengths, len(layer_ids) * H], "offsets": [n + 1]}
    <directory>/complete.json  once every data shard has its file

One file per data shard, written atomically: a killed build resumes at the first missing file. Each
sequence is prefilled alone through a `StaticTarget` with products in `linear_dtype`, stored in
`dtype`. A run reads any subset of the cached layers (`FeatureCache.select`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from dflash2.train.data import SequenceData, _read_json, _write_json


def feature_recipe(target: str, layer_ids: tuple[int, ...], hidden: int, linear_dtype: str | None, dtype: str,
                   data_recipe: dict[str, Any]) -> dict[str, Any]:
    return dict(target=target, layer_ids=list(layer_ids), hidden_size=hidden, linear_dtype=linear_dtype, dtype=dtype,
                data=data_recipe)


@torch.no_grad()
def build_features(directory: Path, recipe: dict[str, Any], data_dir: Path, model,
                   progress: Callable[[int], Any] | None = None) -> Path:
    """Write the features of every sequence of the dataset in `data_dir` (see the module docstring);
    resumes after the files already there when `recipe.json` matches, refuses another recipe's cache."""
    from dflash2.targets.static import StaticTarget

    directory = Path(directory)
    recipe = json.loads(json.dumps(recipe))
    stored = _read_json(directory / "recipe.json")
    if stored is not None and stored != recipe:
        differ = {k: (stored.get(k), recipe.get(k)) for k in sorted(set(stored) | set(recipe)) if stored.get(k) != recipe.get(k)}
        raise ValueError(f"{directory} holds features of another recipe (then, now): {differ}; give another directory "
                         "or delete it")
    if (directory / "complete.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / "recipe.json", recipe)
    data = SequenceData(data_dir)
    longest = max(len(r) for r in data.rows["input_ids"])
    target = StaticTarget(model, tuple(recipe["layer_ids"]), capacity=longest, linear_dtype=recipe["linear_dtype"])
    cache = target.new_cache()
    store = getattr(torch, recipe["dtype"])
    for shard, (lo, hi) in enumerate(data.shard_bounds):
        final = directory / f"shard_{shard:05d}.pt"
        if final.is_file():
            continue
        rows = data.rows[lo:hi]["input_ids"]
        offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
        features = torch.empty(int(offsets[-1]), len(recipe["layer_ids"]) * recipe["hidden_size"], dtype=store)
        for n, ids in enumerate(rows):
            target.crop(cache, 0)
            step = target.forward(torch.tensor([ids]), cache, keep_logits=1)  # features [1, T, F]
            features[offsets[n]: offsets[n + 1]] = step.features[0].to(store)
            if progress is not None:
                progress(1)
        tmp = final.with_name(final.name + ".tmp")
        torch.save({"features": features, "offsets": offsets}, tmp)
        os.replace(tmp, final)
    _write_json(directory / "complete.json", {"shards": len(data.shard_bounds), "sequences": len(data)})
    return directory


class FeatureCache:
    """The cached features of a dataset, memory-mapped; `batch` pads them as `SequenceData.batch` pads ids."""

    def __init__(self, directory: str | Path, data: SequenceData, layer_ids: tuple[int, ...]) -> None:
        directory = Path(directory)
        info, recipe = _read_json(directory / "complete.json"), _read_json(directory / "recipe.json")
        if info is None:
            raise FileNotFoundError(f"{directory} holds no complete feature cache (python -m dflash2.train --config ... "
                                    "--data-only builds it)")
        if recipe["data"] != data.recipe or info["sequences"] != len(data):
            raise ValueError(f"{directory} holds the features of another dataset than {data.directory}")
        missing = sorted(set(layer_ids) - set(recipe["layer_ids"]))
        if missing:
            raise ValueError(f"the feature cache {directory} holds layers {recipe['layer_ids']}, not {missing}")
        self.recipe, H = recipe, recipe["hidden_size"]
        # the columns of the requested layers, in the drafter's order
        self.columns = torch.cat([torch.arange(H) + recipe["layer_ids"].index(i) * H for i in layer_ids])
        self.shards = [torch.load(directory / f"shard_{s:05d}.pt", mmap=True) for s in range(info["shards"])]
        self.where = [(s, n) for s, (lo, hi) in enumerate(data.shard_bounds) for n in range(hi - lo)]

    def batch(self, indices, width: int, dtype: torch.dtype) -> Tensor:
        """[n, width, F] features of these sequences, zero past each one's length."""
        out = torch.zeros(len(indices), width, len(self.columns), dtype=dtype)
        for k, i in enumerate(map(int, indices)):
            s, n = self.where[i]
            shard = self.shards[s]
            lo, hi = int(shard["offsets"][n]), int(shard["offsets"][n + 1])
            out[k, : hi - lo] = shard["features"][lo:hi][:, self.columns].to(dtype)
        return out
