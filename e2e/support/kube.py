"""Small helpers over kubectl and helm (subprocess, JSON): no Kubernetes client library.

Everything the suite does to the cluster goes through the same kubectl a user
runs, with the KUBECONFIG of the cluster under test.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")


class CommandError(RuntimeError):
    def __init__(self, cmd: list[str], rc: int, out: str, err: str):
        self.cmd, self.rc, self.out, self.err = cmd, rc, out, err
        super().__init__(f"{shlex.join(cmd)} -> exit {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}")


def run(cmd: list[str], *, input: str | None = None, check: bool = True,
        timeout: float = 120) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise CommandError(cmd, p.returncode, p.stdout, p.stderr)
    return p


class Kube:
    def __init__(self, kubectl: str, kubeconfig: str, helm: str):
        self.kubectl_bin, self.kubeconfig, self.helm_bin = kubectl, kubeconfig, helm

    # --- kubectl ---------------------------------------------------------------------
    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        return run([self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args],
                   input=input, check=check, timeout=timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return run([self.helm_bin, "--kubeconfig", self.kubeconfig, *args], check=check, timeout=timeout)

    def get(self, kind: str, name: str | None = None, namespace: str | None = None,
            selector: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind]
        if name:
            args.append(name)
        if namespace:
            args += ["-n", namespace]
        if selector:
            args += ["-l", selector]
        p = self.kubectl(*args, "-o", "json", check=False)
        if p.returncode != 0:
            if "NotFound" in p.stderr or "not found" in p.stderr:
                return None
            raise CommandError(args, p.returncode, p.stdout, p.stderr)
        return json.loads(p.stdout)

    def items(self, kind: str, namespace: str | None = None, selector: str | None = None) -> list[dict]:
        got = self.get(kind, namespace=namespace, selector=selector)
        return (got or {}).get("items") or []

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]]) -> None:
        objs = obj if isinstance(obj, list) else [obj]
        doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
        self.kubectl("apply", "-f", "-", input=doc)

    def create(self, obj: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess:
        return self.kubectl("create", "-f", "-", input=json.dumps(obj), check=check)

    def delete(self, kind: str, name: str, namespace: str | None = None, wait: bool = False,
               extra: Iterable[str] = ()) -> None:
        args = ["delete", kind, name, "--ignore-not-found", f"--wait={'true' if wait else 'false'}", *extra]
        if namespace:
            args += ["-n", namespace]
        self.kubectl(*args, timeout=300)

    def logs(self, pod: str, namespace: str, container: str) -> str:
        return self.kubectl("logs", pod, "-n", namespace, "-c", container, check=False).stdout

    def server_version(self) -> str:
        data = json.loads(self.kubectl("version", "-o", "json").stdout)
        return data["serverVersion"]["gitVersion"]


def wait_for(what: str, fn: Callable[[], T], timeout: float = 120, interval: float = 0.5,
             describe: Callable[[], str] | None = None) -> T:
    """Poll ``fn`` until it returns something truthy; fail with ``what`` (and a diagnosis) on timeout."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001 - transient kubectl/API errors are retried
            last_exc = e
        if time.monotonic() > deadline:
            detail = ""
            if describe is not None:
                try:
                    detail = "\n" + describe()
                except Exception as e:  # noqa: BLE001
                    detail = f"\n(describe failed: {e})"
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                               + (f" (last error: {last_exc})" if last_exc else "") + detail)
        time.sleep(interval)


def node_exec_prefix() -> list[str]:
    """How to run a command on the (single) node: locally, or e.g. `docker exec <kind node>`."""
    return shlex.split(os.environ.get("DSCACHE_E2E_NODE_EXEC", ""))


def node_sh(script: str, check: bool = False) -> subprocess.CompletedProcess:
    return run([*node_exec_prefix(), "sh", "-c", script], check=check, timeout=60)


def node_path_exists(path: str) -> bool:
    return node_sh(f"test -e {shlex.quote(path)}").returncode == 0
