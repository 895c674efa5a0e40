"""Yes/no settings from the environment, read one way by the stager and the node agent."""

from __future__ import annotations

import os

YES = ("1", "true", "yes", "on")
NO = ("0", "false", "no", "off")


def flag(value: str | None, default: bool) -> bool:
    """1/true/yes/on or 0/false/no/off, in any case; unset, empty or anything else: ``default``
    (a switch is turned away from its default only by a word that says so)."""
    v = (value or "").strip().lower()
    return True if v in YES else False if v in NO else default


def env_flag(name: str, default: bool) -> bool:
    """:func:`flag` of the environment variable ``name``."""
    return flag(os.environ.get(name), default)
