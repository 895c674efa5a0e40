"""31. The agents' Node writes, confined by the API server (issue 28).

RBAC grants the agents' ServiceAccount `patch` on every Node. The chart's
ValidatingAdmissionPolicy (charts/dscache/templates/agent-node-policy.yaml) narrows
it: with the token of the agent on node A (the pod's bound token, whose node claim
names A), a request may change dscache's labels and annotation on A, and nothing
else: not another Node, not another label or annotation, not the spec (cordon,
taints). Each write is made with that very token, read out of the agent's pod, so
what is checked is exactly what a stolen agent token could do.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import agent
from support.kube import schedulable_nodes, wait_for

import dscache_contract as contract

pytestmark = pytest.mark.multinode

TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
NODE_CLAIM = "authentication.kubernetes.io/node-name"


def agent_kubeconfig(kube, node: str, tmp_path: Path) -> str:
    """A kubeconfig with the cluster of the suite's and, as its only credential, the token of the
    agent pod on ``node`` (no client certificate: nothing but that token authenticates)."""
    pod = agent.agent_pod(kube, node)
    assert pod is not None, f"no dscache-node agent on {node}"
    token = kube.kubectl(
        "exec",
        "-n",
        agent.RELEASE_NS,
        pod["metadata"]["name"],
        "--",
        "python3",
        "-c",
        f"print(open({TOKEN_PATH!r}).read().strip())",
    ).stdout.strip()
    assert token.count(".") == 2, "not a JWT"
    view = json.loads(kube.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    cluster = view["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "agent", "context": {"cluster": "c", "user": "agent"}}],
        "current-context": "agent",
    }
    path = tmp_path / f"agent-{node}.kubeconfig"
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return str(path)


def as_agent(kube, kubeconfig: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [kube.kubectl_bin, "--kubeconfig", kubeconfig, *args], capture_output=True, text=True, timeout=60
    )


def patch(kube, kubeconfig: str, node: str, body: dict[str, Any]) -> subprocess.CompletedProcess:
    return as_agent(kube, kubeconfig, "patch", "node", node, "--type=merge", "-p", json.dumps(body))


def refused(p: subprocess.CompletedProcess) -> bool:
    return p.returncode != 0 and ("denied request" in p.stderr or "ValidatingAdmissionPolicy" in p.stderr)


def test_agent_patches_only_its_node(kube, release, tmp_path):
    policies = [p for p in kube.items("validatingadmissionpolicies") if p["metadata"]["name"].endswith("-own-node")]
    assert policies, "the chart installed no ValidatingAdmissionPolicy for the agents"
    warnings = (policies[0].get("status") or {}).get("typeChecking") or {}
    assert not warnings.get("expressionWarnings"), warnings

    nodes = schedulable_nodes(kube)
    assert len(nodes) >= 2, nodes
    own, other = nodes[0], nodes[1]
    cfg = agent_kubeconfig(kube, own, tmp_path)
    who = json.loads(as_agent(kube, cfg, "auth", "whoami", "-o", "json").stdout)
    extra = (who.get("status") or {}).get("userInfo", {}).get("extra") or {}
    assert extra.get(NODE_CLAIM) == [own], f"the agent's token has no node claim for {own}: {who}"

    probe = contract.warm_label("e2e-policy", "probe", "r-" + "0" * 20)
    # In force: a write to another node that would change nothing is refused (a probe that changed
    # something would change it while the API server has not loaded the policy yet).
    same = {"metadata": {"labels": {"kubernetes.io/hostname": other}}}
    wait_for("the policy in force", lambda: refused(patch(kube, cfg, other, same)), timeout=60)
    # Another node: refused, and unchanged.
    p = patch(kube, cfg, other, {"metadata": {"labels": {probe: "true"}}})
    assert refused(p) and "only its own Node" in p.stderr, (p.stdout, p.stderr)
    assert probe not in (agent.node_obj(kube, other).get("metadata") or {}).get("labels", {})

    # Its own node, dscache's label and annotation: allowed, and taken off again.
    p = patch(kube, cfg, own, {"metadata": {"labels": {probe: "true"}}})
    assert p.returncode == 0, p.stderr
    p = patch(kube, cfg, own, {"metadata": {"labels": {probe: None}}})
    assert p.returncode == 0, p.stderr
    inv = ((agent.node_obj(kube, own).get("metadata") or {}).get("annotations") or {}).get(
        contract.INVENTORY_ANNOTATION
    )
    p = patch(kube, cfg, own, {"metadata": {"annotations": {contract.INVENTORY_ANNOTATION: inv or "{}"}}})
    assert p.returncode == 0, p.stderr

    # Its own node, anything else: refused, and nothing changed.
    for body in (
        {"metadata": {"labels": {"example.com/steer": "here"}}},
        {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
        {"metadata": {"annotations": {"example.com/note": "x"}}},
        {"spec": {"unschedulable": True}},
        {"spec": {"taints": [{"key": "example.com/evil", "effect": "NoSchedule"}]}},
    ):
        p = patch(kube, cfg, own, body)
        assert p.returncode != 0 and refused(p), (body, p.stdout, p.stderr)
    node = agent.node_obj(kube, own)
    labels = (node.get("metadata") or {}).get("labels") or {}
    assert "example.com/steer" not in labels and labels.get("kubernetes.io/hostname"), labels
    assert not (node.get("spec") or {}).get("unschedulable"), node.get("spec")
    assert not any(t.get("key") == "example.com/evil" for t in (node.get("spec") or {}).get("taints") or [])

    # The agents keep working under the policy: their own labels are there and current.
    wait_for(
        "the agent's port label on its node",
        lambda: ((agent.node_obj(kube, own).get("metadata") or {}).get("labels") or {}).get(contract.AGENT_LABEL),
        timeout=60,
    )
    assert "forbidden" not in agent.agent_log(kube, own).lower()[-20000:], agent.agent_log(kube, own)[-3000:]
