"""The documentation stays true to the code: every configuration key is in
docs/configuration.md, every page the README links exists, and the README stays a short
front page (the reference lives in docs/)."""

import dataclasses
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
