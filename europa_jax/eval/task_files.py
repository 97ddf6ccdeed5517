"""Which lm-eval tasks a name means, read from local files, checked before anything runs.

Compute nodes have no internet, so tasks come from directories of lm-eval task YAMLs
whose documents are local files (`dataset_path: json` with `dataset_kwargs.data_files`).
A name is looked up in, by precedence:
1. `train.eval_tasks_dir` (or `eval --tasks-dir`): the user's own task directory;
2. the directory shipped in the package, `europa_jax/eval/tasks` (two tiny tasks written
   for this project: `europa_tiny_choice`, multiple choice, and `europa_tiny_gen`,
   generation);
3. lm-eval's built-in registry (~15,000 names, indexed only when 1 and 2 lack a name, in
   about 6 s; their datasets come from the Hugging Face hub or its local cache).

lm-eval hands `data_files` to `datasets.load_dataset` as they are written, so a relative
path would be read from the working directory. For a task found in 1 or 2, its YAML is
read here (lm-eval's own loader: `include:` and `!function` work) and relative
`data_files`/`data_dir`/`dataset_path` that exist beside the YAML are made absolute, then
the task is built from that config: a task directory can be copied anywhere. Groups and
tags are loaded by lm-eval as they are (absolute paths in their tasks, or name the tasks).

Every task is built once, here — its documents read, a bad path or an unknown name a
one-line `TaskError` at startup, not at the first evaluation step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

from europa_jax.config import ConfigError

SHIPPED_DIR = Path(__file__).resolve().parent / "tasks"
INSTALL = "pip install 'europa-jax[eval]'"
# lm-eval's default seed for few-shot sampling (simple_evaluate's fewshot_random_seed)
FEWSHOT_SEED = 1234


class TaskError(ConfigError):
    """A task that cannot be found or loaded; one line naming the key and the task."""


@dataclasses.dataclass(frozen=True)
class TaskSet:
    """Tasks ready for `lm_eval.evaluator.evaluate`."""

    names: tuple[str, ...]
    task_dict: dict  # TaskManager.load()'s {"tasks", "groups", "group_map"}
    sources: dict[str, str]  # name → the YAML it came from, or "lm_eval"


def require_lm_eval(key: str) -> None:
    try:
        import lm_eval.api.model  # noqa: F401
    except ImportError:
        raise ConfigError(f"{key}: downstream evaluation needs the lm_eval package: "
                          f"{INSTALL}") from None


def task_dirs(tasks_dir: str | Path | None, key: str = "train.eval_tasks_dir") -> list[Path]:
    """The local directories, lowest precedence first (lm-eval's index lets later ones win)."""
    dirs = [SHIPPED_DIR]
    if tasks_dir is not None:
        path = Path(tasks_dir).expanduser()
        if not path.is_dir():
            raise TaskError(f"{key}: {tasks_dir}: no such directory")
        dirs.append(path.resolve())
    return dirs


def load_tasks(names: tuple[str, ...] | list[str], tasks_dir: str | Path | None = None, *,
               key: str = "train.eval_tasks", dir_key: str = "train.eval_tasks_dir"
               ) -> TaskSet:
    """Find and build every named task (its documents read); TaskError on the first that
    cannot be."""
    require_lm_eval(key)
    from lm_eval.tasks import TaskManager

    dirs = task_dirs(tasks_dir, dir_key)
    manager = TaskManager(include_path=[str(d) for d in dirs], include_defaults=False)
    local = set(manager.all_tasks)
    if any(name not in local for name in names):
        shown = ", ".join(sorted(manager.all_subtasks)) or "none"
        manager = TaskManager(include_path=[str(d) for d in dirs])
        unknown = [name for name in names if name not in manager.all_tasks]
        if unknown:
            where = f"{dir_key} {tasks_dir}" if tasks_dir is not None else f"no {dir_key}"
            raise TaskError(f"{key}: {unknown[0]!r} is not an lm-eval task (local tasks: "
                            f"{shown}; {where}; nor among lm_eval's "
                            f"{len(manager.all_tasks) - len(local):,} built-in names)")
    loaded: dict[str, dict] = {"tasks": {}, "groups": {}, "group_map": {}}
    sources = {}
    with _quiet_datasets():
        for name in names:
            spec, sources[name] = _spec(manager, name, dirs)
            try:
                one = manager.load([spec])
            except Exception as e:  # noqa: BLE001 - whatever lm-eval or datasets raised
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise TaskError(f"{key}: {name} ({sources[name]}) could not be loaded: "
                                f"{type(e).__name__}: {first}") from None
            for part in loaded:
                loaded[part].update(one.get(part) or {})
    for task in loaded["tasks"].values():  # what simple_evaluate does before evaluating
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return TaskSet(tuple(names), loaded, sources)


@contextlib.contextmanager
def _quiet_datasets():
    """No `datasets` progress bar per split read (one per task and process otherwise)."""
    from datasets.utils import logging as datasets_logging

    was_enabled = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            datasets_logging.enable_progress_bar()


def _spec(manager, name: str, dirs: list[Path]) -> tuple[str | dict, str]:
    """A local task's config with its files made absolute; anything else by name."""
    entry = manager.task_index.get(name)
    path = getattr(entry, "yaml_path", None)
    if path is None or not _under(path, dirs):
        return name, "lm_eval"
    if name not in manager.all_subtasks:  # a group or tag of a local directory
        return name, str(path)
    from lm_eval.tasks._yaml_loader import load_yaml

    path = Path(path)
    cfg = load_yaml(path, resolve_func=True)
    if cfg.get("task") != name:  # one of a YAML's `task_list`: lm-eval builds it itself
        return name, str(path)
    return absolute_paths(cfg, path.parent), str(path)


def _under(path, dirs: list[Path]) -> bool:
    path = Path(path).resolve()
    return any(path.is_relative_to(d) for d in dirs)


def absolute_paths(cfg: dict[str, Any], base: Path) -> dict[str, Any]:
    """`cfg` with `dataset_path` and `dataset_kwargs`' `data_files`/`data_dir` that name
    files or directories beside the YAML (relative to `base`) made absolute."""
    def fix(value):
        if isinstance(value, str):
            candidate = base / value
            return str(candidate) if not Path(value).is_absolute() and (
                candidate.exists() or any(base.glob(value))) else value
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value

    cfg = dict(cfg)
    if isinstance(cfg.get("dataset_path"), str) and (base / cfg["dataset_path"]).is_dir():
        cfg["dataset_path"] = str(base / cfg["dataset_path"])
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    for key in ("data_files", "data_dir"):
        if key in kwargs:
            kwargs[key] = fix(kwargs[key])
    if kwargs:
        cfg["dataset_kwargs"] = kwargs
    return cfg
