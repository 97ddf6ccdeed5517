"""`europa-jax import`: Hugging Face DeepSeek-V3/Kimi-K2 safetensors → a run directory.

Everything is checked before anything is written: config.json against the config (the
first mismatch), then the whole index against the files' headers and the names, shapes
and dtypes the config implies (every problem, one line each naming file and tensor). The
weights are then placed straight into their device shards: for each of its devices'
shards (`jax.make_array_from_callback` asks only for this process's), a process reads
from the safetensors files just the block of the HF tensor that holds it (`read_region`:
a slice, mapped through the transposes, reshapes and paddings between the layouts), so no
host ever holds a whole tensor, let alone the model. Run under the same launcher as
`train` (launch/local.sh, Slurm), every process reads its own shards and Orbax writes the
checkpoint together, with the run directory locked (run_lock.py). The result is a step-0
checkpoint with a fresh optimizer state and no data position, which `europa-jax train`
resumes from by itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jax.experimental import multihost_utils

from europa_jax import param_table
from europa_jax.config import Config, ConfigError
from europa_jax.config_loader import to_dict
from europa_jax.interop import hf_layout
from europa_jax.interop.export import commit_output, prepare_output
from europa_jax.store import checkpoint, run_lock
from europa_jax.job import distributed
from europa_jax.train import train

INDEX = "model.safetensors.index.json"


# What a tensor may be stored as: any float converts to the parameter's dtype (bf16 and f16
# to f32 exactly); an integer, boolean or FP8 tensor is not a weight of this layout.
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# config.json's `torch_dtype` → the safetensors dtypes a tensor of that export may have: its
# own or a wider float (DeepSeek-V3's releases keep e.g. the router bias in F32). A 16-bit
# tensor of the other 16-bit format, or any 16-bit one in a float32 export, was converted
# after the export and may have lost values (F16 overflows past 65,504 and flushes bf16's
# small values): refused, not silently imported.
DECLARED_DTYPES = {"bfloat16": ("BF16", "F32", "F64"), "float16": ("F16", "F32", "F64"),
                   "float32": ("F32", "F64")}
MAX_PROBLEM_LINES = 20  # a wholly different model would otherwise print thousands


class WeightsError(ConfigError):
    """Problems of an HF weights directory, one line each (file and tensor); exit 2."""

    def __init__(self, problems: list[str]):
        lines = problems[:MAX_PROBLEM_LINES]
        if len(problems) > len(lines):
            lines.append(f"... and {len(problems) - len(lines)} more problems like these")
        super().__init__("\n".join(lines))
        self.problems = problems


class SafetensorsDir:
    """Names, shapes and dtypes (from every file's header) and blocks of an HF weights
    directory; `problems` lists what makes the index and the files disagree."""

    def __init__(self, hf_dir: Path):
        self.dir = hf_dir
        self._files: dict[str, object] = {}
        self.problems: list[str] = []
        # filename → {tensor: (dtype, shape)}, from the headers only (no tensor data read)
        self.headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self.listing = hf_dir / INDEX  # the file that lists the tensors
        if self.listing.exists():
            self.weight_map = _weight_map(self.listing)
        elif (hf_dir / "model.safetensors").exists():
            self.listing = hf_dir / "model.safetensors"
            self.weight_map = {name: "model.safetensors"
                               for name in self._header("model.safetensors") or {}}
        else:
            raise ConfigError(f"{hf_dir}: no {INDEX} or model.safetensors")
        for filename in sorted(set(self.weight_map.values())):
            self._header(filename)
        self.elements_read = 0  # what block() read so far (tests hold it against the shards)

    def _header(self, filename: str) -> dict | None:
        if filename in self.headers:
            return self.headers[filename]
        path = self.dir / filename
        try:
            f = self._files[filename] = safe_open(path, framework="numpy")
        except FileNotFoundError:
            self.problems.append(f"{path}: listed in {INDEX} but missing")
            return None
        except Exception as e:  # noqa: BLE001 - SafetensorError: truncated, not safetensors
            self.problems.append(f"{path}: not a readable safetensors file ({e})")
            return None
        self.headers[filename] = {name: (f.get_slice(name).get_dtype(),
                                         tuple(f.get_slice(name).get_shape()))
                                  for name in f.keys()}
        return self.headers[filename]

    def _file(self, name: str):
        return self._files[self.weight_map[name]]

    def block(self, name: str, bounds: list[tuple[int, int]]) -> np.ndarray:
        """HF tensor `name`[a0:b0, a1:b1, ...], read from disk without the rest of it."""
        self.elements_read += math.prod(b - a for a, b in bounds)
        return self._file(name).get_slice(name)[tuple(slice(a, b) for a, b in bounds)]


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{index}: not a safetensors index (expected JSON with a "
                          f"weight_map: {type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{index}: weight_map is not a mapping of tensor → file")
    return weight_map


def check_weights(weights: SafetensorsDir, plan: list[hf_layout.HFTensor],
                  first_unused_layer: int, declared_dtype: str | None = None) -> None:
    """The whole index against the files and the config before anything is read: every
    tensor the config implies listed, in its file, with its shape and a float dtype; every
    tensor of the files listed and implied (but MTP modules past the config's, layers
    `first_unused_layer` …, which are left out), each in the dtype config.json declares or a
    wider float (DECLARED_DTYPES). Raises `WeightsError` naming each problem."""
    if any(name.endswith("_scale_inv") for name in weights.weight_map):
        raise ConfigError(f"{weights.dir}: FP8 block-quantized weights (*.weight_scale_inv) are "
                          "not supported; convert them to bf16 first")
    problems = list(weights.problems)
    expected = {t.name: t for t in plan}
    # DeepSeek-V3 ships its multi-token-prediction module as layer `num_hidden_layers`;
    # a config with fewer MTP modules (model.mtp_layers) leaves the rest out.
    unused = range(first_unused_layer, first_unused_layer + 8)
    mtp = re.compile(rf"model\.layers\.({'|'.join(str(i) for i in unused)})\.")
    for name in sorted(set(expected) - set(weights.weight_map)):
        problems.append(f"{weights.listing}: {name} is missing (the config implies it)")
    for name, filename in sorted(weights.weight_map.items()):
        path, header = weights.dir / filename, weights.headers.get(filename)
        t = expected.get(name)
        if t is None and not mtp.match(name):
            problems.append(f"{path}: {name} is not a tensor of this config")
        if header is None:
            continue  # the file itself is the problem, named once
        if name not in header:
            problems.append(f"{path}: {name} is listed in {INDEX} but not in the file")
            continue
        dtype, shape = header[name]
        if t is not None and shape != t.shape:
            problems.append(f"{path}: {name} has shape {list(shape)}, the config implies "
                            f"{list(t.shape)}")
        if t is not None and dtype not in FLOAT_DTYPES:
            problems.append(f"{path}: {name} is {dtype}, expected a float "
                            f"({', '.join(FLOAT_DTYPES)})")
        elif t is not None and dtype not in DECLARED_DTYPES.get(declared_dtype, FLOAT_DTYPES):
            problems.append(f"{path}: {name} is {dtype} but config.json declares torch_dtype "
                            f"{declared_dtype}: converted after the export, it may have lost "
                            "values; convert the files back (or correct torch_dtype)")
    for filename, header in sorted(weights.headers.items()):
        for name in sorted(n for n in header if weights.weight_map.get(n) != filename):
            problems.append(f"{weights.dir / filename}: {name} is in the file but "
                            f"{INDEX} does not list it there")
    if problems:
        raise WeightsError(problems)


def read_region(weights: SafetensorsDir, t: hf_layout.HFTensor, item_shape: tuple[int, ...],
                region: list[tuple[int, int]]) -> np.ndarray:
    """`from_hf(whole HF tensor)[region]` (our layout, one layer/expert item), reading only
    the HF block that holds the region: its bounding box through the layout map."""
    source = t.source
    if source.shape is not None and tuple(source.shape) != tuple(item_shape):
        # stored with zero padding (execution.param_pad_multiple): read the model's part only
        return _padded(region, source.shape, lambda inner: read_region(
            weights, dataclasses.replace(t, source=dataclasses.replace(source, shape=None)),
            tuple(source.shape), inner))
    if source.kind == "embedding":  # ours [V_pad, D] = HF [V, D], padding rows zero
        return _padded(region, t.shape, lambda inner: weights.block(t.name, inner))
    if source.kind == "lm_head":  # ours [D, V_pad] = HF [V, D]ᵀ
        return _padded(region, t.shape[::-1], lambda inner: weights.block(
            t.name, inner[::-1]).T)
    if source.kind == "vector":  # ours = HF reshaped
        return _flat_region(region, item_shape, lambda lo, hi: weights.block(
            t.name, [(lo, hi)]) if len(t.shape) == 1 else weights.block(
                t.name, [(0, n) for n in t.shape]).reshape(-1)[lo:hi])
    # linear/expert: ours = HF[out_flat, in_flat]ᵀ reshaped to (in dims..., out dims...)
    n_in = source.n_in
    in_idx, in_lo, in_hi = _flat_indices(region[:n_in], item_shape[:n_in])
    out_idx, out_lo, out_hi = _flat_indices(region[n_in:], item_shape[n_in:])
    block = weights.block(t.name, [(out_lo, out_hi), (in_lo, in_hi)]).T
    if len(in_idx) < in_hi - in_lo or len(out_idx) < out_hi - out_lo:  # not a plain block
        block = block[np.ix_(in_idx - in_lo, out_idx - out_lo)]
    return block.reshape([b - a for a, b in region])


def _flat_indices(region, shape) -> tuple[np.ndarray, int, int]:
    """Row-major flat indices of a box in `shape`, and their bounding range."""
    grids = np.meshgrid(*[np.arange(a, b) for a, b in region], indexing="ij")
    flat = (np.ravel_multi_index([g.ravel() for g in grids], shape) if region
            else np.zeros(1, np.int64))
    return flat, int(flat.min()), int(flat.max()) + 1


def _flat_region(region, shape, read_flat) -> np.ndarray:
    flat, lo, hi = _flat_indices(region, shape)
    return read_flat(lo, hi)[flat - lo].reshape([b - a for a, b in region])


def _padded(region, real_shape, read) -> np.ndarray:
    """`region` of an array that is `read` inside `real_shape` and zero beyond it."""
    inner = [(a, max(a, min(b, n))) for (a, b), n in zip(region, real_shape)]
    got = read(inner) if all(b > a for a, b in inner) else None
    if got is not None:
        out = np.zeros([b - a for a, b in region], got.dtype)
        out[tuple(slice(0, b - a) for a, b in inner)] = got
        return out
    return None  # all padding: the caller's zeros


def _leaf_array(key: str, abstract, sharding_, sources: dict[tuple[int, ...], hf_layout.HFTensor],
                weights: SafetensorsDir):
    """One state leaf, built shard by shard from the blocks of the HF tensors in it."""
    n_lead = len(next(iter(sources)))
    dtype = np.dtype(abstract.dtype)
    item_shape = tuple(abstract.shape[n_lead:])

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        index = [range(*s.indices(n)) for s, n in zip(index, abstract.shape)]
        region = [(r.start, r.stop) for r in index[n_lead:]]
        out = np.zeros([len(r) for r in index], dtype)
        for position in np.ndindex(*[len(r) for r in index[:n_lead]]):
            item = tuple(r[i] for r, i in zip(index[:n_lead], position))
            got = read_region(weights, sources[item], item_shape, region)
            if got is not None:  # None: the region is all storage padding
                out[position] = got.astype(dtype)  # bf16 → f32 is exact
        return out

    return jax.make_array_from_callback(abstract.shape, sharding_, shard)


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

    trainer = train.build_trainer(cfg, distributed.job_mesh(cfg.mesh))
    # the leaves the HF tensors fill: the parameters and the router bias, as the state holds them
    leaves = {checkpoint.leaf_key(path): leaf for path, leaf in
              jax.tree_util.tree_flatten_with_path(
                  {"params": trainer.abstract_params,
                   param_table.ROUTER_BIAS.key: trainer.abstract_state.router_bias_LE})[0]}
    plan = list(hf_layout.tensors(cfg.model, {k: v.shape for k, v in leaves.items()},
                                  cfg.execution.scan_layers))
    check_weights(weights, plan, cfg.model.n_layers + cfg.model.mtp_layers,
                  hf_config.get("torch_dtype"))
    # No `train` may start in the run directory while the import fills it (its commit
    # replaces the directory), nor may the import replace a run that is going.
    with run_lock.hold(run_dir, "import"):
        # Every process checks the target (the same answer everywhere), process 0 makes the
        # directory all of them write into; Orbax then saves from every process.
        tmp = prepare_output(run_dir, overwrite, create=jax.process_index() == 0,
                             tag="importing")
        multihost_utils.sync_global_devices("europa-jax import: output directory")
        try:
            by_key: dict[str, dict] = {}
            for t in plan:
                if not t.mirror:  # the MTP modules' copies of the embedding and head
                    by_key.setdefault(t.source.key, {})[t.source.index] = t
            arrays = {key: _leaf_array(key, leaf, leaf.sharding, by_key[key], weights)
                      for key, leaf in leaves.items()}
            params = jax.tree.unflatten(jax.tree.structure(trainer.abstract_params),
                                        [arrays[k] for k in leaves if k.startswith("params.")])
            with jax.set_mesh(trainer.mesh):
                opt_state = jax.jit(trainer.tx.init,
                                    out_shardings=trainer.state_shardings.opt_state)(params)
            step = jax.device_put(jnp.int32(0), trainer.state_shardings.step)
            state = train.TrainState(step=step, params=params, opt_state=opt_state,
                                     router_bias_LE=arrays[param_table.ROUTER_BIAS.key])
            saver = checkpoint.Checkpointer(cfg, tmp, trainer)
            saver.save(0, state, None, reason="import", extra={"imported_from": str(hf_dir)})
            saver.close()  # raises SaveFailed if it did not reach the disk
            multihost_utils.sync_global_devices("europa-jax import: saved")
            if jax.process_index() == 0:
                (tmp / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
                commit_output(tmp, run_dir)
            multihost_utils.sync_global_devices("europa-jax import: committed")
        except BaseException:
            if jax.process_index() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    n_params = sum(math.prod(v.shape) for k, v in leaves.items() if k.startswith("params."))
    return {"run_dir": str(run_dir), "tensors": len(plan), "params": n_params,
            "process": jax.process_index(), "processes": jax.process_count(),
            "hf_elements_read_by_this_process": weights.elements_read}
