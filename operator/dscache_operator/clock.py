"""The controller's one clock and its one timestamp format (RFC 3339, UTC, seconds, as Kubernetes writes)."""

from __future__ import annotations

import datetime


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def parse_time(text: str | None) -> datetime.datetime | None:
    """A timestamp from the API server or our own status (None: absent or unreadable)."""
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def fmt_time(t: datetime.datetime) -> str:
    return t.astimezone(datetime.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
