"""A process's CPU as the benches bill it: user + sys seconds from /proc/<pid>/stat."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + sys CPU seconds of process ``pid`` (or its thread ``tid``) so far; OSError once it is
    gone. (The command name in field 2 may hold spaces and parentheses: the fields are counted
    after its last ')'.)"""
    stat = Path(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK
