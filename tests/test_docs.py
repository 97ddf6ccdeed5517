"""The documentation stays true to the code: every configuration key is in
docs/configuration.md, every link between the README, docs/ and docs/notes/ reaches its
page and heading, the README stays a short front page (the reference lives in docs/), and
the current europa-952b figures are the stored plan's, as benchmarks/headline.py prints
them."""

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path

from europa_jax import config

ROOT = Path(__file__).resolve().parents[1]


def config_keys(cls, prefix: str) -> list[str]:
    """`prefix.field` for every field of a config dataclass, nested dataclasses inside."""
    keys = []
    for name, kind in typing.get_type_hints(cls).items():
        key = f"{prefix}.{name}"
        keys.append(key)
        if dataclasses.is_dataclass(kind):
            keys += config_keys(kind, key)
    return keys


def test_every_config_key_is_documented():
    text = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9]+(?:\.[a-z_0-9]+)+)`", text))
    keys = [k for section, kind in typing.get_type_hints(config.Config).items()
            for k in config_keys(kind, section)]
    assert len(keys) > 90
    missing = [k for k in keys if k not in documented]
    assert not missing, f"not in docs/configuration.md: {missing}"
    # and nothing documented that the code does not have (a renamed or removed key)
    sections = set(typing.get_type_hints(config.Config))
    stale = {k for k in documented if k.split(".")[0] in sections} - set(keys)
    assert not stale, f"documented but not a key: {sorted(stale)}"


def test_the_readme_is_a_front_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    links = re.findall(r"\]\((docs/[\w\-]+\.md)(?:#[\w\-]+)?\)", readme)
    assert {"docs/configuration.md", "docs/training.md", "docs/plan.md"} <= set(links)
    for link in links:
        assert (ROOT / link).is_file(), link
    for page in (ROOT / "docs").glob("*.md"):  # links between pages resolve too
        for target in re.findall(r"\]\(([\w\-]+\.md)(?:#[\w\-]+)?\)", page.read_text()):
            assert (ROOT / "docs" / target).is_file(), (page.name, target)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = _slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def test_every_link_between_pages_and_notes_resolves_to_a_file_and_heading():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "notes").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append((page.name, target))
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append((page.name, target))
    assert not broken, broken


def _headline():
    """benchmarks/headline.py, loaded by path: the script that prints the current figures."""
    spec = importlib.util.spec_from_file_location("headline", ROOT / "benchmarks" / "headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_short_and_says_first_that_nothing_ran_on_a_gpu():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12_000
    assert "Nothing has run on a GPU yet" in "\n".join(readme.splitlines()[:40])


def test_the_current_figures_are_the_stored_plans_as_the_script_prints_them():
    """The README's headline table and docs/plan.md's tables of the step are exactly what
    benchmarks/headline.py prints from tests/data/europa-952b-plan-long-tail.json."""
    headline = _headline()
    plan = headline.load()
    readme = (ROOT / "README.md").read_text()
    reference = (ROOT / "docs" / "plan.md").read_text()
    table = headline.headline_table(plan)
    assert readme.count(table) == 1, "README's table is not `python benchmarks/headline.py`"
    for table in (headline.classes_table(plan), headline.lines_table(plan)):
        assert reference.count(table) == 1, (
            "docs/plan.md's tables are not `python benchmarks/headline.py --classes`")
