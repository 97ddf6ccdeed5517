"""`europa-jax import`: Hugging Face DeepSeek-V3/Kimi-K2 safetensors → a run directory.

Everything is checked before anything is written: config.json against the config (one
line per mismatch), then every tensor name and shape against the names the config
implies. The weights are then placed straight into their device shards: each device's
slice is read from the safetensors files (`jax.make_array_from_callback`), so a host holds
one HF tensor at a time, never the model. The result is a step-0 checkpoint with a fresh
optimizer state and no data position, which `europa-jax train` resumes from by itself.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from europa_jax import checkpoint, hf_layout, sharding, train
from europa_jax.config import Config, ConfigError
from europa_jax.config_loader import to_dict
from europa_jax.export import commit_output, prepare_output

INDEX = "model.safetensors.index.json"


class SafetensorsDir:
    """Names, shapes and (cached, one at a time) tensors of an HF weights directory."""

    def __init__(self, hf_dir: Path):
        self.dir = hf_dir
        if (hf_dir / INDEX).exists():
            self.weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
        elif (hf_dir / "model.safetensors").exists():
            with safe_open(hf_dir / "model.safetensors", framework="numpy") as f:
                self.weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise ConfigError(f"{hf_dir}: no {INDEX} or model.safetensors")
        self._files: dict[str, object] = {}

    def _file(self, name: str):
        filename = self.weight_map[name]
        if filename not in self._files:
            path = self.dir / filename
            if not path.exists():
                raise ConfigError(f"{path}: listed in {INDEX} but missing")
            self._files[filename] = safe_open(path, framework="numpy")
        return self._files[filename]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    @functools.lru_cache(maxsize=8)  # a device callback asks for the same tensor per device
    def tensor(self, name: str) -> np.ndarray:
        return self._file(name).get_tensor(name)


def check_weights(weights: SafetensorsDir, plan: list[hf_layout.HFTensor], n_layers: int) -> None:
    """Every expected name present with its shape, nothing unexplained left over."""
    expected = {t.name for t in plan}
    missing = sorted(expected - set(weights.weight_map))
    if missing:
        raise ConfigError(f"{weights.dir}: {len(missing)} tensors missing, e.g. {missing[0]}")
    if any(name.endswith("_scale_inv") for name in weights.weight_map):
        raise ConfigError(f"{weights.dir}: FP8 block-quantized weights (*.weight_scale_inv) are "
                          "not supported; convert them to bf16 first")
    # DeepSeek-V3 ships its multi-token-prediction module as layer `num_hidden_layers`.
    mtp = re.compile(rf"model\.layers\.({'|'.join(str(i) for i in range(n_layers, n_layers + 8))})\.")
    extra = sorted(n for n in set(weights.weight_map) - expected if not mtp.match(n))
    if extra:
        raise ConfigError(f"{weights.dir}: {len(extra)} unexpected tensors, e.g. {extra[0]}")
    for t in plan:
        if weights.shape(t.name) != t.shape:
            raise ConfigError(f"{weights.dir}: {t.name} has shape {list(weights.shape(t.name))}, "
                              f"the config implies {list(t.shape)}")


def _leaf_array(key: str, abstract, sharding_, sources: dict[tuple[int, ...], hf_layout.HFTensor],
                weights: SafetensorsDir):
    """One state leaf, built shard by shard from the HF tensors that make it up."""
    n_lead = len(next(iter(sources)))
    dtype = np.dtype(abstract.dtype)

    def region(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(s.indices(n) for s, n in zip(index, abstract.shape))
        lead = [range(*r) for r in index[:n_lead]]
        rest = tuple(slice(*r) for r in index[n_lead:])
        out = np.empty([len(r) for r in lead] + [len(range(*r)) for r in index[n_lead:]], dtype)
        for position in np.ndindex(*[len(r) for r in lead]):
            item = tuple(r[i] for r, i in zip(lead, position))
            t = sources[item]
            hf = weights.tensor(t.name)
            ours = hf_layout.from_hf(hf, t.source, abstract.shape[n_lead:])
            out[position] = ours[rest].astype(dtype)  # bf16 → f32 is exact
        return out

    return jax.make_array_from_callback(abstract.shape, sharding_, region)


def import_hf(hf_dir: str | Path, cfg: Config, run_dir: str | Path,
              overwrite: bool = False) -> dict:
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise ConfigError(f"{config_path}: not found")
    hf_config = json.loads(config_path.read_text())
    if hf_config.get("quantization_config"):
        raise ConfigError(f"{config_path}: quantization_config="
                          f"{hf_config['quantization_config'].get('quant_method')!r}: quantized "
                          "weights are not supported; convert them to bf16 first")
    hf_layout.check_hf_config(hf_config, cfg.model, str(config_path))
    weights = SafetensorsDir(hf_dir)

    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    abstract = {checkpoint.leaf_key(path): leaf for path, leaf in
                jax.tree_util.tree_flatten_with_path({"params": trainer.abstract_params})[0]}
    abstract[hf_layout.ROUTER_BIAS] = jax.ShapeDtypeStruct(
        (cfg.model.n_moe_layers, cfg.model.n_routed_experts), jnp.float32)
    plan = list(hf_layout.tensors(cfg.model, {k: v.shape for k, v in abstract.items()},
                                  checkpoint.model_param_shapes(cfg)))
    check_weights(weights, plan, cfg.model.n_layers)
    tmp = prepare_output(run_dir, overwrite)
    try:
        by_key: dict[str, dict] = {}
        for t in plan:
            by_key.setdefault(t.source.key, {})[t.source.index] = t
        shardings = {checkpoint.leaf_key(path): s for path, s in
                     jax.tree_util.tree_flatten_with_path(
                         {"params": trainer.state_shardings.params})[0]}
        shardings[hf_layout.ROUTER_BIAS] = trainer.state_shardings.router_bias_LE
        arrays = {key: _leaf_array(key, abstract[key], shardings[key], by_key[key], weights)
                  for key in abstract}
        treedef = jax.tree.structure({"params": trainer.abstract_params})
        flat_keys = [checkpoint.leaf_key(p) for p, _ in
                     jax.tree_util.tree_flatten_with_path({"params": trainer.abstract_params})[0]]
        params = jax.tree.unflatten(treedef, [arrays[k] for k in flat_keys])["params"]
        with jax.set_mesh(trainer.mesh):
            opt_state = jax.jit(trainer.tx.init,
                                out_shardings=trainer.state_shardings.opt_state)(params)
        state = train.TrainState(step=jax.device_put(jnp.int32(0), trainer.state_shardings.step),
                                 params=params, opt_state=opt_state,
                                 router_bias_LE=arrays[hf_layout.ROUTER_BIAS])
        saver = checkpoint.Checkpointer(cfg, tmp, trainer)
        saver.save(0, state, None, reason="import", extra={"imported_from": str(hf_dir)})
        saver.close()
        (tmp / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        commit_output(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_params = sum(math.prod(v.shape) for k, v in abstract.items() if k.startswith("params."))
    return {"run_dir": str(run_dir), "tensors": len(plan), "params": n_params}
