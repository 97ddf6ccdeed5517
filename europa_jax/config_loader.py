"""YAML + `--set a.b=value` overrides → a validated `Config`, checked key by key.

Unknown keys (with the closest known one suggested), wrong types and missing required
keys are one-line `ConfigError`s naming the file and key; the dataclasses' own checks
(config.py) run as each section is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from europa_jax.config import Config, ConfigError
from europa_jax.config_execution import MOVED_FROM_MODEL

# Keys that moved between sections: `old.key` → `new.key`. A config file or `--set` that
# names an old key is refused in one line naming the new one; a checkpoint's saved config
# (written by the version before the move) is moved by `saved_config`.
MOVED = {f"model.{key}": f"execution.{key}" for key in MOVED_FROM_MODEL}


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
    """YAML file + `a.b=value` overrides → validated `Config`."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found{_configs_nearby(path)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at top level, got {type(raw).__name__}")
    for item in overrides:
        _apply_override(raw, item)
    try:
        return from_dict(Config, raw)
    except ConfigError as e:
        raise ConfigError(f"{_origin(str(e), path, overrides)}: {e}") from None


def _origin(message: str, path: Path, overrides: typing.Sequence[str]) -> str:
    """Where the key a message names (its first word) came from: the last `--set` that
    set it (or a section above it), else the file."""
    key = message.split(":", 1)[0].split(" ", 1)[0]
    for item in reversed(overrides):
        set_key = item.split("=", 1)[0].strip()
        if set_key == key or set_key.startswith(key + "."):
            return f"--set {item} (on {path})"
    return str(path)


def saved_config(raw: dict) -> dict:
    """A config as a checkpoint saved it (nested dicts), in this version's layout: the keys
    saved in a section they have since left (MOVED: `model.remat` before `execution:` held
    it) moved to their section. Only for saved configs: a user's file with an old key is
    refused (from_dict). Returns a new dict; `raw` is unchanged."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for old, new in MOVED.items():
        old_section, key = old.split(".", 1)
        new_section, new_key = new.split(".", 1)
        if isinstance(out.get(old_section), dict) and key in out[old_section]:
            value = out[old_section].pop(key)
            out.setdefault(new_section, {}).setdefault(new_key, value)
    return out


def apply_overrides(raw: dict, overrides: typing.Sequence[str]) -> dict:
    """`raw` (a config as nested dicts, e.g. a checkpoint's) with `a.b=value` items set."""
    for item in overrides:
        _apply_override(raw, item)
    return raw


def _configs_nearby(path: Path) -> str:
    """`; the configs in DIR/: a.yaml, b.yaml` — the YAML files in the missing file's
    folder, or in ./configs (the repository's) when that folder has none."""
    for folder in (path.parent, Path("configs")):
        names = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
        if names:
            where = "" if folder == Path(".") else f" in {folder}/"
            return f"; the configs{where}: {', '.join(names)}"
    return ""


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.learning_rate=1e-3")
    key, value = item.split("=", 1)
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
    node[leaf] = yaml.safe_load(value)


def from_dict(cls: type, raw: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from nested dicts, checking names and types key by key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if f"{prefix}{key}" in MOVED:
            raise ConfigError(f"{prefix}{key} moved to {MOVED[f'{prefix}{key}']}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(f"{prefix}{key}: unknown key{hint}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}: required key is missing")
    return cls(**kwargs)  # __post_init__ checks name their keys in full


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(inner, value, key)
    if origin is Literal:
        if value not in typing.get_args(hint):
            allowed = ", ".join(map(str, typing.get_args(hint)))
            raise ConfigError(f"{key}: {value!r} is not one of: {allowed}")
        return value
    if origin is tuple:  # `tuple[int, ...]`: a YAML list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        inner = typing.get_args(hint)[0]
        return tuple(_coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, value_type = typing.get_args(hint)
        return {k: _coerce(value_type, v, f"{key}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML reads 3e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r} "
                          f"({type(value).__name__})")
    return value


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
