"""The node agents (dscache-node) as the tests see them: their pods, logs, labels and disks."""

from __future__ import annotations

import base64
import http.client
import json
import shlex
import ssl
from typing import Any

import dscache_contract as contract
from dscache_contract.peers import AGENT_TLS_NAME, agent_audience
from support.kube import Kube, NodeExecError, node_sh

AGENT_SELECTOR = "app.kubernetes.io/name=dscache-node"
RELEASE_NS = "dscache-system"


def agent_pod(kube: Kube, node: str) -> dict[str, Any] | None:
    pods = kube.items("pods", namespace=RELEASE_NS, selector=AGENT_SELECTOR)
    return next((p for p in pods if p["spec"].get("nodeName") == node), None)


def agent_log(kube: Kube, node: str) -> str:
    pod = agent_pod(kube, node)
    if pod is None:
        return ""
    return kube.kubectl("logs", pod["metadata"]["name"], "-n", RELEASE_NS, "--all-containers", check=False).stdout


def node_obj(kube: Kube, node: str) -> dict[str, Any]:
    return kube.get("node", node) or {}


def warm_labels(kube: Kube, node: str) -> set[str]:
    labels = (node_obj(kube, node).get("metadata") or {}).get("labels") or {}
    return {k for k in labels if k.startswith(contract.WARM_LABEL_PREFIX)}


def inventory(kube: Kube, node: str) -> contract.Inventory | None:
    text = ((node_obj(kube, node).get("metadata") or {}).get("annotations") or {}).get(contract.INVENTORY_ANNOTATION)
    return contract.Inventory.from_json(text) if text else None


def complete_on_disk(cache_root: str, node: str) -> set[tuple[str, str, str]]:
    """(namespace, cache, revision) of every complete revision under cacheRoot on ``node``."""
    root = shlex.quote(cache_root)
    p = node_sh(
        f'cd {root} 2>/dev/null && for f in */*/revs/r-*/meta/complete; do [ -e "$f" ] && echo "$f"; done; echo end',
        node=node,
    )
    lines = p.stdout.split()
    if p.returncode != 0 or not lines or lines[-1] != "end":
        raise NodeExecError(f"cannot list the revisions on {node}: {p.stderr[-300:]}")
    out = set()
    for line in lines[:-1]:
        ns, cache, _, rev = line.split("/")[:4]
        out.add((ns, cache, rev))
    return out


def leftovers_on_disk(cache_root: str, node: str) -> list[str]:
    p = node_sh(f"find {shlex.quote(cache_root)} -maxdepth 4 -name '.gone-*'; echo end", node=node)
    lines = p.stdout.split()
    if p.returncode != 0 or not lines or lines[-1] != "end":
        raise NodeExecError(f"cannot look for leftovers on {node}: {p.stderr[-300:]}")
    return lines[:-1]


def disagreement(kube: Kube, cache_root: str, node: str, max_labels: int = 16) -> str | None:
    """None when the node's warm labels, its agent's inventory and its disk agree; else how they differ."""
    disk = complete_on_disk(cache_root, node)
    labels = warm_labels(kube, node)
    inv = inventory(kube, node)
    want = {contract.warm_label(ns, c, r) for ns, c, r in disk}
    problems = []
    if not labels <= want:
        problems.append(f"labels without a complete copy on disk: {sorted(labels - want)}")
    if len(disk) <= max_labels and labels != want:
        problems.append(f"complete copies without a label: {sorted(want - labels)}")
    if inv is None:
        problems.append("no inventory annotation")
    else:
        # The inventory names no cache (anyone who reads Nodes reads it): compare by digest.
        listed = {
            (r.digest or contract.cache_digest(r.namespace, r.cache), r.revision) for r in inv.revisions if r.complete
        }
        on_disk = {(contract.cache_digest(ns, c), r) for ns, c, r in disk}
        if listed != on_disk and not inv.truncated:
            problems.append(f"inventory {sorted(listed)} != disk {sorted(on_disk)}")
    return "; ".join(problems) if problems else None


def describe(kube: Kube, cache_root: str, node: str) -> str:
    try:
        disk = sorted(complete_on_disk(cache_root, node))
    except NodeExecError as e:
        disk = [str(e)]
    inv = inventory(kube, node)
    return json.dumps(
        {
            "node": node,
            "labels": sorted(warm_labels(kube, node)),
            "disk": disk,
            "inventory": [r.__dict__ for r in inv.revisions] if inv else None,
            "agent_log_tail": agent_log(kube, node)[-2000:],
        },
        indent=1,
        default=str,
    )


# --- its HTTP API, as the controller and the stagers call it (issue 29) ------------------------


class _AgentHTTPS(http.client.HTTPSConnection):
    """HTTPS to a node IP whose certificate names AGENT_TLS_NAME (as the stagers connect)."""

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=AGENT_TLS_NAME)  # type: ignore[attr-defined]


def agent_call(
    kube: Kube, node: str, method: str, path: str, token: str | None = None, body: str = ""
) -> tuple[int, bytes]:
    """One request to ``node``'s agent at its InternalIP: TLS checked against the chart's CA (Secret
    dscache-agent-tls) unless the install turned TLS off. (status, body)."""
    obj = node_obj(kube, node)
    ip = next(a["address"] for a in obj["status"]["addresses"] if a["type"] == "InternalIP")
    port = int(obj["metadata"]["labels"][contract.AGENT_LABEL])
    secret = kube.get("secret", "dscache-agent-tls", RELEASE_NS)
    conn: http.client.HTTPConnection
    if secret is None:
        conn = http.client.HTTPConnection(ip, port, timeout=30)
    else:
        ctx = ssl.create_default_context(cadata=base64.b64decode(secret["data"]["ca.crt"]).decode())
        conn = _AgentHTTPS(ip, port, timeout=30, context=ctx)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def controller_token(kube: Kube, node: str) -> str:
    """A token of the controller's ServiceAccount for ``node``'s agent, as the controller asks for one."""
    return kube.kubectl(
        "create", "token", "dscache-controller", "-n", RELEASE_NS, "--audience", agent_audience(node)
    ).stdout.strip()
