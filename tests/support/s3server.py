"""A real S3 server (versitygw, posix backend) for integration tests."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3

from .tools import tool_bin

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
                "posix",
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
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def put_tree(self, bucket: str, files: dict[str, bytes]) -> None:
        """Upload ``{key: body}``; small trees go through the API so ETags are real."""
        c = self.client()
        for key, body in files.items():
            c.put_object(Bucket=bucket, Key=key, Body=body)
