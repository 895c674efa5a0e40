"""Run the real ``dscache-stage`` CLI as a subprocess, as the init container does."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .s3server import S3Server


@dataclass
class StageResult:
    code: int
    stdout: str
    stderr: str

    @property
    def summary(self) -> dict:
        return json.loads(self.stdout.strip().splitlines()[-1])


def stage_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dscache_stager", *args]


def stage_env(server: S3Server, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, **server.env, **extra}


def run_stage(server: S3Server, *args: str, endpoint: str | None = None, env: dict | None = None,
              timeout: float = 300) -> StageResult:
    cmd = stage_cmd(*args, "--endpoint-url", endpoint or server.endpoint, "--progress-interval", "0.5")
    p = subprocess.run(cmd, env=env or stage_env(server), capture_output=True, text=True, timeout=timeout)
    return StageResult(p.returncode, p.stdout, p.stderr)


def data_tree(dest: Path) -> dict[str, str]:
    """{relative path: sha256} of everything under dest except our bookkeeping."""
    out = {}
    for root, dirs, files in os.walk(dest):
        dirs[:] = [d for d in dirs if not (root == str(dest) and d == ".dscache")]
        for f in files:
            p = Path(root, f)
            out[str(p.relative_to(dest))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def expected_tree(files: dict[str, bytes], prefix: str) -> dict[str, str]:
    return {k[len(prefix):]: hashlib.sha256(v).hexdigest() for k, v in files.items() if k.startswith(prefix)}
