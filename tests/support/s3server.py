"""A real S3 server (versitygw, posix backend) for integration tests."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3

from .tools import stop_process, tool_bin

ACCESS_KEY = "dscache-test"
SECRET_KEY = "dscache-test-secret"
REGION = "us-east-1"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """versitygw serving ``root`` on ``host:port``; every top-level dir is a bucket."""

    root: Path
    host: str = "127.0.0.1"
    port: int = 0
    #: Where versitygw keeps old versions; set: buckets may turn versioning on.
    versioning_dir: Path | None = None
    #: Where versitygw keeps its internal IAM; set: add_user() makes users (tests of pod identity).
    iam_dir: Path | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment that points the AWS credential chain at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def start(self) -> S3Server:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.iam_dir:
            self.iam_dir.mkdir(parents=True, exist_ok=True)
        if self.versioning_dir:
            self.versioning_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        binary = tool_bin("s3") / "versitygw"
        self.proc = subprocess.Popen(
            [
                str(binary),
                "--access",
                ACCESS_KEY,
                "--secret",
                SECRET_KEY,
                "--region",
                REGION,
                "--port",
                f"{self.host}:{self.port}",
                # Real S3 keeps connections alive; versitygw does not by default.
                "--keep-alive",
                "--quiet",
                *(["--iam-dir", str(self.iam_dir)] if self.iam_dir else []),
                "posix",
                *(["--versioning-dir", str(self.versioning_dir)] if self.versioning_dir else []),
                str(self.root),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"versitygw exited: {self.proc.stderr.read().decode()}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"versitygw did not listen on {self.endpoint} within 20 s")

    def stop(self) -> None:
        stop_process(self.proc)

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )

    def admin(self, *args: str) -> None:
        """``versitygw admin`` against this server, as its root user (needs iam_dir)."""
        binary = tool_bin("s3") / "versitygw"
        root = ["-a", ACCESS_KEY, "-s", SECRET_KEY, "--er", self.endpoint]
        subprocess.run([str(binary), "admin", *root, *args], check=True, capture_output=True, timeout=30)

    def add_user(self, access: str, secret: str, owns: str) -> None:
        """A versitygw IAM user (role user) that owns bucket ``owns``, so it may list and read it."""
        self.admin("create-user", "-a", access, "-s", secret, "-r", "user")
        self.admin("change-bucket-owner", "--bucket", owns, "--owner", access)

    def make_bucket(self, name: str, versioned: bool = False) -> None:
        self.client().create_bucket(Bucket=name)
        if versioned:
            status = {"Status": "Enabled"}
            self.client().put_bucket_versioning(Bucket=name, VersioningConfiguration=status)

    @contextlib.contextmanager
    def keeping_version_times(self, bucket: str) -> Iterator[None]:
        """Around changes to a versioned bucket: LastModified times as S3 gives them.

        versitygw v1.8.0 reports a file's mtime as LastModified, and two of its
        times are not S3's: it copies an object into its versioning dir when the
        object becomes noncurrent, so the old version's LastModified turns into
        the time of the overwrite; and a delete marker is the deleted object's
        file with an attribute set, so it is dated like that object. S3 (AWS,
        MinIO, Ceph RGW) never changes a version's LastModified and dates a
        delete marker by the delete, and revisions pinned in a versioned bucket
        rely on both (dscache_contract.versions). This puts the times right in
        versitygw's files (backend/posix: genObjVersionKey, DeleteObject).
        """
        assert self.versioning_dir is not None, "a server started without a versioning dir"
        client = self.client()

        def versions() -> tuple[dict[tuple[str, str], float], set[tuple[str, str]]]:
            times, markers = {}, set()
            for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket):
                for v in page.get("Versions") or []:
                    times[(v["Key"], v["VersionId"])] = v["LastModified"].timestamp()
                markers.update((m["Key"], m["VersionId"]) for m in page.get("DeleteMarkers") or [] if m["IsLatest"])
            return times, markers

        before, old_markers = versions()
        yield
        deleted_at = time.time()
        for (key, version), when in before.items():
            digest = hashlib.sha256(key.encode()).hexdigest()
            path = self.versioning_dir / bucket / digest[:2] / digest[2:4] / digest[4:6] / digest / version
            if path.exists():
                os.utime(path, (when, when))
        for key, _ in versions()[1] - old_markers:
            os.utime(self.root / bucket / key, (deleted_at, deleted_at))

    def put_tree(self, bucket: str, files: dict[str, bytes]) -> None:
        """Upload ``{key: body}``; small trees go through the API so ETags are real."""
        c = self.client()
        for key, body in files.items():
            c.put_object(Bucket=bucket, Key=key, Body=body)
