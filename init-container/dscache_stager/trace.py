"""``DSCACHE_TRACE=1``: a cold copy's timeline on stderr, one line per event, for finding idle time.

Each line is ``dscache-trace <CLOCK_MONOTONIC seconds> <event> <count>``, the clock a sampler of
/proc/<pid>/stat (or perf, or strace -ttt's monotonic twin) can line up with. The events:
``start`` (stage.sync entered), ``first-page`` (the access proof's page is in: its keys),
``page`` (a listing page reached the copy: its keys), ``batch-go`` and ``batch-done`` (objects
handed to the native copier, and back), ``done`` (the revision is sealed). With peers, per native
call ``peer-go``, ``peer-placed``, ``peer-unclaimed``, ``peer-ms``, and per object ``obj <outcome>
<peer> <path> h<hop>`` (``obj-py`` on peers.py's path) with its milliseconds since it was asked
(bench/fanout_tail.py reads them).

Issue 30 (smallwan36) found with it where bench/stager.py's small set idles: the listing pages
after the first are answered by the server only once the GETs of the page before have drained
(listing.py has the figures). Off, it costs one boolean test per event.
"""

from __future__ import annotations

import sys
import time

from .switches import env_flag

ENV = "DSCACHE_TRACE"

#: Read once: the events are many (two per batch), the switch is the process's.
ON = env_flag(ENV, False)


def mark(event: str, count: int = 0) -> None:
    """One timeline line on stderr when tracing is on; nothing otherwise."""
    if ON:
        sys.stderr.write(f"dscache-trace {time.monotonic():.4f} {event} {count}\n")


def ms_since(since: float) -> int:
    """Milliseconds from ``since`` (time.monotonic) to now: an ``obj`` line's count."""
    return int(1000 * (time.monotonic() - since))
