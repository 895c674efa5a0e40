"""The one clock and the one timestamp format (RFC 3339, UTC, whole seconds, as Kubernetes writes).

The operator's status and Events, the node agent's Events and a versioned
revision's as-of time (versions.py) all carry this form.
"""

from __future__ import annotations

import datetime

#: strftime/strptime form of every timestamp we write.
RFC3339 = "%Y-%m-%dT%H:%M:%SZ"


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def parse_time(text: str | None) -> datetime.datetime | None:
    """A timestamp from the API server, S3 or our own status (None: absent or unreadable)."""
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def fmt_time(t: datetime.datetime) -> str:
    return t.astimezone(datetime.UTC).strftime(RFC3339)


def fmt_epoch(seconds: float) -> str:
    """Seconds since the epoch in the same form."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime(RFC3339)
