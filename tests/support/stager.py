"""Run the real ``dscache-stage`` CLI as a subprocess, as the init container does."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dscache_contract as contract

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
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != contract.ENV_POD_UID}
    return {**env, **server.env, **extra}


def run_stage(
    server: S3Server, *args: str, endpoint: str | None = None, env: dict | None = None, timeout: float = 300
) -> StageResult:
    """Any dscache-stage command line; sync and revision get the server's endpoint."""
    extra = ["--endpoint-url", endpoint or server.endpoint] if args and args[0] in ("sync", "revision") else []
    if args and args[0] == "sync":
        extra += ["--progress-interval", "0.5"]
    p = subprocess.run(
        stage_cmd(*args, *extra), env=env or stage_env(server), capture_output=True, text=True, timeout=timeout
    )
    return StageResult(p.returncode, p.stdout, p.stderr)


def sync_argv(uri: str, cache: Path, revision: str, pod_uid: str | None = "pod-1", **kw) -> list[str]:
    """The stager's argv exactly as the webhook builds it (dscache_contract.StageArgs)."""
    return contract.StageArgs(source=uri, revision=revision, cache_dir=str(cache), pod_uid=pod_uid, **kw).to_argv()


def stage(
    server: S3Server,
    uri: str,
    cache: Path,
    revision: str,
    pod_uid: str | None = "pod-1",
    endpoint: str | None = None,
    env: dict | None = None,
    timeout: float = 300,
    **kw,
) -> StageResult:
    return run_stage(
        server, *sync_argv(uri, cache, revision, pod_uid, **kw), endpoint=endpoint, env=env, timeout=timeout
    )


def boto3_revision(server: S3Server, uri: str, include=(), exclude=()) -> str:
    """The revision as the operator pins it (dscache_contract.pin, through boto3)."""
    return boto3_pin(server, uri, include, exclude).revision


def boto3_pin(server: S3Server, uri: str, include=(), exclude=()) -> contract.Pin:
    bucket, _ = contract.parse_source(uri)
    return contract.pin(server.client(), bucket, contract.Selection.from_source(uri, include, exclude))


def data_dir(cache: Path, revision: str) -> Path:
    return Path(contract.data_dir(str(cache), revision))


def data_tree(dest: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under dest."""
    out = {}
    for root, _dirs, files in os.walk(dest):
        for f in files:
            p = Path(root, f)
            out[str(p.relative_to(dest))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def expected_tree(files: dict[str, bytes], prefix: str) -> dict[str, str]:
    return {
        k[len(prefix) :]: hashlib.sha256(v).hexdigest()
        for k, v in files.items()
        if k.startswith(prefix) and not k.endswith("/")
    }
