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
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


class CommandError(RuntimeError):
    def __init__(self, cmd: list[str], rc: int, out: str, err: str):
        self.cmd, self.rc, self.out, self.err = cmd, rc, out, err
        super().__init__(f"{shlex.join(cmd)} -> exit {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}")


def run(
    cmd: list[str], *, input: str | None = None, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise CommandError(cmd, p.returncode, p.stdout, p.stderr)
    return p


class Kube:
    def __init__(self, kubectl: str, kubeconfig: str, helm: str):
        self.kubectl_bin, self.kubeconfig, self.helm_bin = kubectl, kubeconfig, helm

    # --- kubectl ---------------------------------------------------------------------
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        return run(
            [self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args], input=input, check=check, timeout=timeout
        )

    def helm(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return run([self.helm_bin, "--kubeconfig", self.kubeconfig, *args], check=check, timeout=timeout)

    def get(
        self, kind: str, name: str | None = None, namespace: str | None = None, selector: str | None = None
    ) -> dict[str, Any] | None:
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

    def delete(
        self, kind: str, name: str, namespace: str | None = None, wait: bool = False, extra: Iterable[str] = ()
    ) -> None:
        args = ["delete", kind, name, "--ignore-not-found", f"--wait={'true' if wait else 'false'}", *extra]
        if namespace:
            args += ["-n", namespace]
        self.kubectl(*args, timeout=300)

    def logs(self, pod: str, namespace: str, container: str) -> str:
        return self.kubectl("logs", pod, "-n", namespace, "-c", container, check=False).stdout

    def server_version(self) -> str:
        data = json.loads(self.kubectl("version", "-o", "json").stdout)
        return data["serverVersion"]["gitVersion"]


def wait_for(
    what: str,
    fn: Callable[[], T],
    timeout: float = 120,
    interval: float = 0.5,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll ``fn`` until it returns something truthy; fail with ``what`` (and a diagnosis) on timeout."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except (AssertionError, NodeExecError):
            raise  # a failed check, or a node we cannot look at: retrying would only hide it
        except Exception as e:
            last_exc = e
        if time.monotonic() > deadline:
            detail = ""
            if describe is not None:
                try:
                    detail = "\n" + describe()
                except Exception as e:
                    detail = f"\n(describe failed: {e})"
            raise TimeoutError(
                f"timed out after {timeout:.0f}s waiting for {what}"
                + (f" (last error: {last_exc})" if last_exc else "")
                + detail
            )
        time.sleep(interval)


class NodeExecError(RuntimeError):
    """A command could not be run on the node: never read as "the path is absent"."""


def node_exec_prefix(node: str | None = None) -> list[str]:
    """How to run a command on a node.

    ``DSCACHE_E2E_NODE_EXEC`` is a command prefix, e.g. ``docker exec {node}``
    on kind; ``{node}`` is replaced by the node's name (multi-node clusters).
    Empty: the node is this machine (a cluster whose node is the host).
    """
    template = os.environ.get("DSCACHE_E2E_NODE_EXEC", "")
    if "{node}" in template:
        if not node:
            raise NodeExecError(f"DSCACHE_E2E_NODE_EXEC={template!r} needs a node name; pass node=")
        template = template.replace("{node}", shlex.quote(node))
    return shlex.split(template)


def node_sh(script: str, check: bool = False, node: str | None = None) -> subprocess.CompletedProcess:
    return run([*node_exec_prefix(node), "sh", "-c", script], check=check, timeout=60)


def node_path_exists(path: str, node: str | None = None) -> bool:
    """Whether ``path`` exists on the node; raises NodeExecError when that cannot be told.

    The script prints one of two words: any other outcome (the exec prefix
    fails, the node is gone, sh is missing) is an error, not "absent", so a
    "the copy was wiped" assertion cannot pass because node exec is broken.
    """
    p = node_sh(f"if [ -e {shlex.quote(path)} ]; then echo present; else echo absent; fi", node=node)
    answer = p.stdout.strip()
    if p.returncode != 0 or answer not in ("present", "absent"):
        raise NodeExecError(
            f"cannot tell whether {path} exists on node {node or '(local)'}: exit "
            f"{p.returncode}, stdout {p.stdout[-300:]!r}, stderr {p.stderr[-300:]!r}"
        )
    return answer == "present"


def node_pids_of_container(container_id: str, node: str | None = None) -> list[int]:
    """Host PIDs of the processes in one container (by its runtime ID, from the pod status).

    Found through /proc/<pid>/cgroup, which names the container's cgroup; the
    ID is 64 hex digits, so it matches no other container.
    """
    cid = container_id.split("://", 1)[-1]
    if not cid or not all(c in "0123456789abcdef" for c in cid):
        raise NodeExecError(f"not a container ID: {container_id!r}")
    p = node_sh(f"for d in /proc/[0-9]*; do grep -qs {cid} $d/cgroup && echo ${{d#/proc/}}; done; echo end", node=node)
    lines = p.stdout.split()
    if p.returncode != 0 or not lines or lines[-1] != "end":
        raise NodeExecError(
            f"cannot list the processes of container {cid[:12]} on {node or '(local)'}: {p.stderr[-300:]}"
        )
    return [int(x) for x in lines[:-1]]


def schedulable_nodes(kube: Kube) -> list[str]:
    """Ready nodes that take ordinary pods (no NoSchedule/NoExecute taint, not cordoned), sorted."""
    out = []
    for n in kube.items("nodes"):
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in n["status"].get("conditions", []))
        no_schedule = any(t.get("effect") in ("NoSchedule", "NoExecute") for t in n["spec"].get("taints") or [])
        if ready and not no_schedule and not n["spec"].get("unschedulable"):
            out.append(n["metadata"]["name"])
    return sorted(out)
