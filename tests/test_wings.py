"""The package's wings and their order: no module imports a wing above its own.

core (config, config_model, config_execution, config_train, config_checks, config_loader,
param_table) < data, parallel < model < train < plan < job < store, records < interop < eval <
run < cli: the process (job), the run directory (store) and what a run writes about itself
(records) come before the tools that read a run's checkpoints (interop, eval), and the training
loop (run) after them, so that nothing but the CLI depends on the loop. Every import counts,
including those inside functions (taken late only to keep start-up light). docs/architecture.md
lists every module, and no package folder holds more than 12 modules directly.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "europa_jax"
CORE = {"config", "config_checks", "config_model", "config_execution", "config_train",
        "config_loader", "param_table"}
RANK = {"core": 0, "data": 1, "parallel": 1, "model": 2, "train": 3, "plan": 4, "job": 5,
        "store": 6, "records": 6, "interop": 7, "eval": 8, "run": 9, "cli": 10}
MAX_MODULES_PER_FOLDER = 12
CLI = {"europa_jax.cli", "europa_jax.cli_args"}  # the top: the command line and its grammar


def wing(module: str) -> str:
    """'europa_jax.run.loop' → 'run'; the core modules → 'core'; the package → 'core'."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in CORE:
        return "core"
    return parts[0]


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        yield (name[:-len(".__init__")] if name.endswith(".__init__") else name), path


def imported(path: pathlib.Path, module: str):
    """Every europa_jax module `path` imports (a `from europa_jax.x import y` may name
    module y or a member of x: both are in x's wing or y's, the same here)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("europa_jax"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base == "europa_jax":
                yield from (f"europa_jax.{a.name}" for a in node.names)
            elif base.startswith("europa_jax."):
                yield base


def test_every_module_lives_in_a_wing_or_the_core():
    for module, _ in modules():
        w = wing(module)
        assert w in RANK or module in CLI, module


@pytest.mark.parametrize("module,path", list(modules()), ids=lambda x: str(x))
def test_no_module_imports_a_wing_above_its_own(module, path):
    own = "cli" if module in CLI else wing(module)
    for target in imported(path, module):
        other = "cli" if target in CLI else wing(target)
        assert other == own or RANK[other] < RANK[own], (
            f"{module} ({own}) imports {target} ({other})")


def test_the_architecture_page_lists_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(path.relative_to(ROOT)) for _, path in modules()
               if path.name != "__init__.py" and f"`{path.relative_to(ROOT)}`" not in page]
    assert not missing, missing


def test_no_package_folder_holds_more_than_twelve_modules():
    crowded = {}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if (p / "__init__.py").is_file())]:
        count = len([m for m in folder.glob("*.py") if m.name != "__init__.py"])
        if count > MAX_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(ROOT))] = count
    assert not crowded, crowded
