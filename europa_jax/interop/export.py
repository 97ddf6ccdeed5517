"""`europa-jax export`: a checkpoint → Hugging Face DeepSeek-V3 safetensors, streamed.

Export reads the checkpoint's arrays straight from disk (saved_checkpoints.open_saved_array), one
layer — for expert stacks one block of experts — at a time, and writes each output file as
soon as its tensors are ready. A host therefore holds at most one output file (bounded by
`--max-shard-size`) plus the blocks being converted, never the model, and needs no
accelerator: the same command runs on a login node. While reading, it recomputes the
checkpoint's fingerprint, so a corrupted checkpoint fails the export instead of shipping.
Everything is written into a temporary sibling directory renamed into place at the end.

Beside the weights go the run's tokenizer (hf_tokenizer_files.py: `tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`) and `generation_config.json`, so that
`AutoTokenizer` and `AutoModelForCausalLM` load from the one folder. The tokenizer is
checked before anything is written: a `data.tokenizer` file that is gone or differs from
the corpus manifest's sha256 fails the export.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from europa_jax.config import Config, ConfigError
from europa_jax.config_loader import from_dict
from europa_jax.interop import hf_layout, hf_tokenizer_files
from europa_jax.store import run_lock, saved_checkpoints
from europa_jax.train import train

log = logging.getLogger(__name__)

DTYPES = {"bf16": (ml_dtypes.bfloat16, "bfloat16"), "fp32": (np.float32, "float32")}
EXPERT_BLOCK_BYTES = 512 * 2**20  # experts read together per stack (bounds host memory)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '123' → bytes (decimal units, as `save_pretrained` uses)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if not match:
        raise ConfigError(f"--max-shard-size: {text!r} is not a size like 500MB or 5GB")
    scale = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
             "T": 1e12, "TB": 1e12}[match.group(2)]
    return int(float(match.group(1)) * scale)


def prepare_output(out_dir: Path, overwrite: bool, *, create: bool = True,
                   tag: str | None = None) -> Path:
    """Refuse a non-empty target unless asked; return the temporary directory to write
    (made here if `create`; named by `tag` where several processes must agree on it).
    A run directory's lock file alone (run_lock.py) does not make it non-empty."""
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(
            p.name != run_lock.LOCK_FILE for p in out_dir.iterdir())):
        raise ConfigError(f"{out_dir}: exists and is not empty (pass --overwrite to replace it)")
    tmp = out_dir.parent / f".{out_dir.name}.{tag or f'tmp-{os.getpid()}'}"
    if create:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    return tmp


def readable_as_umask_allows(directory: Path) -> None:
    """Every file under `directory` at the mode a plain `open` gives under the process's
    umask (0644 under 022): safetensors' `save_file` writes its files 0600, which teammates
    and serving jobs on a shared cluster cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def commit_output(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir) if out_dir.is_dir() else out_dir.unlink()
    tmp.rename(out_dir)


class CheckpointReader:
    """Reads slices of saved arrays, each region once, summing bits to verify the save."""

    def __init__(self, step_dir: Path, expected_fingerprint: dict[str, int],
                 expected_shapes: dict[str, tuple[int, ...]]):
        self.step_dir, self.expected = step_dir, expected_fingerprint
        self.expected_shapes = expected_shapes
        self.stores: dict = {}
        self.blocks: dict[str, tuple[tuple, np.ndarray]] = {}  # one cached block per key
        self.sums: dict[str, int] = {}
        self.counts: dict[str, int] = {}

    def store(self, key: str):
        if key not in self.stores:
            self.stores[key] = saved_checkpoints.open_saved_array(self.step_dir, key)
            saved = tuple(self.stores[key].shape)
            if saved != tuple(self.expected_shapes[key]):
                raise saved_checkpoints.CheckpointError(
                    f"{self.step_dir}: {key} has shape {list(saved)} but its config implies "
                    f"{list(self.expected_shapes[key])}")
        return self.stores[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.store(key).shape)

    def _read(self, key: str, index) -> np.ndarray:
        x = self.store(key)[index].read().result()
        self.sums[key] = (self.sums.get(key, 0) + saved_checkpoints.host_bit_sum(x)) % 2**32
        self.counts[key] = self.counts.get(key, 0) + x.size
        return x

    def read(self, source: hf_layout.Source) -> np.ndarray:
        if source.kind != "expert":
            return self._read(source.key, source.index)
        *lead, expert = source.index
        shape = self.shape(source.key)
        per_expert = math.prod(shape[len(source.index):]) * 4
        block = max(1, min(shape[len(lead)], EXPERT_BLOCK_BYTES // per_expert))
        first = expert // block * block
        tag = (tuple(lead), first)
        if self.blocks.get(source.key, (None,))[0] != tag:
            index = tuple(lead) + (slice(first, min(first + block, shape[len(lead)])),)
            self.blocks[source.key] = (tag, self._read(source.key, index))
        return self.blocks[source.key][1][expert - first]

    def verify(self) -> None:
        """Every fully read array must match the fingerprint taken when it was saved."""
        for key, total in self.sums.items():
            if self.counts[key] == math.prod(self.shape(key)) and self.expected.get(key) != total:
                raise saved_checkpoints.CheckpointError(
                    f"{self.step_dir}: {key} does not match its saved fingerprint (corrupted "
                    "checkpoint); export another --step")


def plan_files(tensors: list[hf_layout.HFTensor], itemsize_of, max_bytes: int):
    """Consecutive tensors grouped into files of at most `max_bytes` (a bigger tensor alone)."""
    files, current, size = [], [], 0
    for t in tensors:
        nbytes = math.prod(t.shape) * itemsize_of(t.name)
        if current and size + nbytes > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes
    if current:
        files.append(current)
    return files


def export(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
           dtype: str = "bf16", max_shard_bytes: int = 5 * 10**9,
           overwrite: bool = False, tokenizer: str | Path | None = None) -> dict:
    """Write `out_dir` (config.json, model-XXXXX-of-YYYYY.safetensors, index, tokenizer
    and generation_config.json); return a summary. `tokenizer` overrides the run's
    `data.tokenizer` path (checked against the corpus manifest all the same)."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: {dtype!r} is not one of: {', '.join(DTYPES)}")
    run_lock.check_free(out_dir)  # --overwrite must not replace a run that is going
    step_dir = saved_checkpoints.step_dir_of(run_dir, step, "export")
    meta = saved_checkpoints.read_meta(step_dir)
    cfg: Config = from_dict(Config, meta["config"])
    # before anything is written: a missing or changed tokenizer file is an error
    tok, no_tokenizer = hf_tokenizer_files.run_tokenizer(cfg, tokenizer)
    out_type, dtype_name = DTYPES[dtype]
    # what the checkpoint must hold, from its own config: checked as arrays are opened
    ours = hf_layout.state_shapes(train.abstract_params(cfg), cfg.model)
    reader = CheckpointReader(step_dir, meta["fingerprint"], ours)
    tensors = list(hf_layout.tensors(cfg.model, ours, cfg.execution.scan_layers))
    float32 = {t.name for t in tensors if t.float32}

    def out_dtype(name: str):
        return np.float32 if name in float32 else out_type

    def itemsize(name: str) -> int:
        return np.dtype(out_dtype(name)).itemsize

    files = plan_files(tensors, itemsize, max_shard_bytes)
    tmp = prepare_output(out_dir, overwrite)
    try:
        weight_map, total = {}, 0
        for number, group in enumerate(files, start=1):
            name = f"model-{number:05d}-of-{len(files):05d}.safetensors"
            arrays = {}
            for t in group:
                hf = hf_layout.to_hf(reader.read(t.source), t.source, cfg.model.vocab_size)
                arrays[t.name] = np.ascontiguousarray(hf.astype(out_dtype(t.name)))
                assert arrays[t.name].shape == t.shape, (t.name, arrays[t.name].shape, t.shape)
                weight_map[t.name] = name
                total += arrays[t.name].nbytes
            save_file(arrays, tmp / name, metadata={"format": "pt"})
            del arrays  # one file in memory at a time
        reader.verify()
        index = {"metadata": {"total_size": total, "europa_jax_step": meta["step"]},
                 "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        eos, bos = (tok.eos_id, tok.bos_id) if tok else (None, None)
        config = hf_layout.hf_config(cfg.model, dtype_name, eos)
        config["bos_token_id"] = bos
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        context = cfg.model.max_position_embeddings
        generation = hf_tokenizer_files.generation_config(eos, bos)
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if tok:
            tokenizer_files = hf_tokenizer_files.write_tokenizer_files(tmp, tok, context)
        else:
            tokenizer_files = []
            log.warning(f"tokenizer files not written: {no_tokenizer}")
        readable_as_umask_allows(tmp)
        commit_output(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out_dir), "step": meta["step"], "files": len(files),
            "tensors": len(tensors), "bytes": total, "dtype": dtype_name,
            "tokenizer": tok.kind if tok and tokenizer_files else None}
