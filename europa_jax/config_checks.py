"""What every config section checks with: the one error type and the common checks.

A module of its own so that the sections (config.py, config_model.py, config_execution.py)
share it without importing each other.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config problem a user can fix; the message is one line naming key and value."""


def positive(section: str, obj: Any, *keys: str) -> None:
    """Each key of `obj` must be > 0; the error names it as `section.key`."""
    for key in keys:
        value = getattr(obj, key)
        if not value > 0:
            raise ConfigError(f"{section}.{key}: {value} must be positive")
