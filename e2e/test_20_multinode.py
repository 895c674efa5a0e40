"""20. Three real nodes (the kind path): distributed workloads under their real controllers.

- test_distributed_job_every_node: e2e/samples/jobset.yaml under the real JobSet
  controller, 3 workers, one pod per node: every node stages its own copy,
  every pod verifies every byte, every copy is wiped after completion.
- test_trainjob_or_pytorchjob: e2e/samples/pytorchjob.yaml under the real
  Kubeflow training-operator, through the pods it creates.
- test_node_lost: a node is deleted (kubelet stopped, Node object deleted) while
  a Job uses the cache there: the cache converges and no wipe is sent there again and again.

These run only where DSCACHE_E2E_MULTINODE=1 (e2e/run.sh sets it): on a
single-node cluster they are deselected, not skipped.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, cache_status, host_copy, init_summary, send_go
from support import revs
from support import workloads as w
from support.kube import node_path_exists, node_sh, schedulable_nodes, wait_for

pytestmark = pytest.mark.multinode
SAMPLES = Path(REPO, "e2e/samples")
HOSTNAME = "kubernetes.io/hostname"


def _sample(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((SAMPLES / name).read_text()) if d]
    assert len(docs) == 1, f"{name}: expected one object"
    return docs[0]


@pytest.fixture(scope="module")
def nodes(kube) -> list[str]:
    names = schedulable_nodes(kube)
    assert len(names) >= 3, (
        f"these tests need 3 nodes that run pods, the cluster has {names}: bring the kind cluster up with e2e/run.sh"
    )
    return names


def _spread(key: str) -> dict[str, Any]:
    """Required pod anti-affinity on `key`: one pod per node."""
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"e2e-spread": key}}, "topologyKey": HOSTNAME}
            ]
        }
    }


def _train_template(
    sample_tpl: dict[str, Any], cache: str, cfg, dataset, container: str, spread: str
) -> dict[str, Any]:
    """The sample's pod template with our image and verifying program; the sample's
    opt-in annotation is kept as written, pointed at this test's cache."""
    tpl = copy.deepcopy(sample_tpl)
    meta = tpl.setdefault("metadata", {})
    assert "dscache.io/cache" in meta.get("annotations", {}), "the sample lost its opt-in annotation"
    meta["annotations"]["dscache.io/cache"] = cache
    meta.setdefault("labels", {}).update({"e2e": "dscache", "e2e-spread": spread})
    sample_container = tpl["spec"]["containers"][0]
    spec = w.train_pod_spec(
        cfg.stager_image, dataset, wait=True, restart_policy=tpl["spec"].get("restartPolicy", "Never")
    )
    spec["containers"][0]["name"] = sample_container["name"]
    assert sample_container["name"] == container, sample_container["name"]
    spec["affinity"] = _spread(spread)
    tpl["spec"] = spec
    return tpl


def _pods(kube, ns: str, spread: str) -> list[dict[str, Any]]:
    return kube.items("pods", namespace=ns, selector=f"e2e-spread={spread}")


def _describe(kube, ns: str, spread: str) -> str:
    out = kube.kubectl("get", "pods", "-n", ns, "-l", f"e2e-spread={spread}", "-o", "wide", check=False).stdout
    ev = kube.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout[-3000:]
    return out + "\n" + ev


def _wait_verified_everywhere(
    kube, ns: str, spread: str, container: str, want_nodes: int, dataset
) -> dict[str, dict[str, Any]]:
    """Wait until `want_nodes` pods on distinct nodes printed VERIFIED; return them by node."""

    def verified():
        by_node = {}
        for p in _pods(kube, ns, spread):
            if p.get("status", {}).get("phase") == "Failed":
                raise AssertionError(
                    f"pod {p['metadata']['name']} failed:\n{kube.logs(p['metadata']['name'], ns, container)[-2000:]}"
                )
            node = p["spec"].get("nodeName")
            if node and "VERIFIED" in kube.logs(p["metadata"]["name"], ns, container):
                by_node[node] = p
        return by_node if len(by_node) >= want_nodes else None

    by_node = wait_for(
        f"{want_nodes} pods on distinct nodes to verify the data",
        verified,
        timeout=240,
        describe=lambda: _describe(kube, ns, spread),
    )
    for node, p in by_node.items():
        log = kube.logs(p["metadata"]["name"], ns, container)
        assert f"VERIFIED objects={dataset.objects} bytes={dataset.bytes} uid={w.TRAIN_UID}" in log, log
        summary = init_summary(p)
        assert summary["objects"] == dataset.objects and summary["bytes"] == dataset.bytes, (node, summary)
    return by_node


def _node_states(kube, ns: str, name: str) -> dict[str, str]:
    return {e["node"]: e.get("state") for e in cache_status(kube, ns, name).get("nodes") or []}


def _revision(kube, ns: str, name: str) -> str:
    """The revision every pod of these tests was admitted with (no refresh happens meanwhile)."""
    return cache_status(kube, ns, name)["revision"]["id"]


def _assert_staged_on(cfg, kube, ns: str, name: str, nodes: list[str]) -> None:
    path, rev = host_copy(cfg, ns, name), _revision(kube, ns, name)
    for node in nodes:
        assert node_path_exists(revs.complete_marker(path, rev), node=node), f"no complete {rev} on {node}"
        count = node_sh(f"wc -l < {revs.manifest(path, rev)}", node=node).stdout.strip()
        inode = node_sh(f"stat -c %d:%i {path}", node=node).stdout.strip()
        assert count and int(count) > 0, (node, count)
        assert inode, node
    # Each node has its own disk: the same path is a different directory on each.
    ids = {node_sh(f"stat -f -c %i {path}; stat -c %d:%i {path}; cat /etc/hostname", node=n).stdout for n in nodes}
    assert len(ids) == len(nodes), f"the copies on {nodes} are not distinct: {ids}"
    states = wait_for(
        f"{len(nodes)} Ready nodes in the DatasetCache status",
        lambda: (s := _node_states(kube, ns, name)) and all(s.get(n) == "Ready" for n in nodes) and s,
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    assert cache_status(kube, ns, name).get("readyNodes") == len(nodes), states
    # One dataset version on every node: each node's status holds exactly the pinned revision.
    held = {
        e["node"]: {r["id"] for r in e.get("revisions") or []}
        for e in cache_status(kube, ns, name).get("nodes") or []
        if e["node"] in nodes
    }
    assert all(ids == {rev} for ids in held.values()) and len(held) == len(nodes), (rev, held)


def _assert_wiped_on(cfg, kube, ns: str, name: str, nodes: list[str]) -> None:
    path, rev = host_copy(cfg, ns, name), _revision(kube, ns, name)
    for node in nodes:
        revs.wait_revision_wiped(kube, ns, name, path, rev, node, timeout=120)
    wait_for(
        "every node Wiped in the status",
        lambda: all(_node_states(kube, ns, name).get(n) == "Wiped" for n in nodes),
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )


def _condition(obj: dict[str, Any] | None, *types: str) -> str | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") in types and c.get("status") == "True":
            return c["type"]
    return None


def test_distributed_job_every_node(cfg, kube, cache_factory, dataset, nodes):
    cache = cache_factory("jobset")
    ns, name = cache["namespace"], cache["name"]
    spread = "jobset-" + uuid.uuid4().hex[:6]
    js = _sample("jobset.yaml")
    js["metadata"] = {"name": spread, "namespace": ns, "labels": {"e2e": "dscache"}}
    rj = js["spec"]["replicatedJobs"][0]
    # The sample's shape, sized to the cluster: 3 child Jobs of one pod each, one per node.
    rj["replicas"] = 3
    rj["template"]["spec"].update({"parallelism": 1, "completions": 1, "backoffLimit": 0})
    rj["template"]["spec"]["template"] = _train_template(
        rj["template"]["spec"]["template"], name, cfg, dataset, "train", spread
    )
    kube.create(js)

    by_node = _wait_verified_everywhere(kube, ns, spread, "train", 3, dataset)
    assert len(by_node) == 3 and set(by_node) <= set(nodes), by_node.keys()
    for p in by_node.values():  # the JobSet controller made these pods (through its child Jobs)
        assert p["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == spread, p["metadata"]["labels"]
        assert [c["name"] for c in p["spec"]["initContainers"]] == [w.INIT_NAME]
    _assert_staged_on(cfg, kube, ns, name, list(by_node))

    for p in by_node.values():
        send_go(kube, ns, p["metadata"]["name"], "train")
    wait_for(
        f"JobSet {spread} Completed",
        lambda: _condition(kube.get("jobset", spread, ns), "Completed", "Failed"),
        timeout=180,
        describe=lambda: json.dumps((kube.get("jobset", spread, ns) or {}).get("status"), indent=1),
    )
    assert _condition(kube.get("jobset", spread, ns), "Completed", "Failed") == "Completed"
    _assert_wiped_on(cfg, kube, ns, name, list(by_node))


def test_trainjob_or_pytorchjob(cfg, kube, cache_factory, dataset, nodes):
    cache = cache_factory("pytorch")
    ns, name = cache["namespace"], cache["name"]
    spread = "ptj-" + uuid.uuid4().hex[:6]
    pj = _sample("pytorchjob.yaml")
    pj["metadata"] = {"name": spread, "namespace": ns, "labels": {"e2e": "dscache"}}
    specs = pj["spec"]["pytorchReplicaSpecs"]
    # Workers only: with a Master, the training-operator gives each Worker an init
    # container that waits for the Master's DNS name, and this cluster runs no DNS.
    worker = specs["Worker"]
    worker["replicas"] = 3
    worker["restartPolicy"] = "Never"
    worker["template"] = _train_template(worker["template"], name, cfg, dataset, "pytorch", spread)
    worker["template"]["spec"]["restartPolicy"] = "Never"
    pj["spec"]["pytorchReplicaSpecs"] = {"Worker": worker}
    kube.create(pj)

    by_node = _wait_verified_everywhere(kube, ns, spread, "pytorch", 3, dataset)
    for p in by_node.values():  # made by the training-operator
        assert p["metadata"]["labels"].get("training.kubeflow.org/job-name") == spread, p["metadata"]["labels"]
        owners = [o["kind"] for o in p["metadata"].get("ownerReferences") or []]
        assert owners == ["PyTorchJob"], owners
        env = {e["name"] for e in p["spec"]["containers"][0].get("env") or []}
        # Both mutated the same container: our webhook (DSCACHE_*) and the training-operator
        # (PET_*: torchrun's rendezvous settings for a Worker-only job).
        assert {"DSCACHE_DIR", "DSCACHE_MANIFEST", "PET_NNODES"} <= env, env
    _assert_staged_on(cfg, kube, ns, name, list(by_node))

    for p in by_node.values():
        send_go(kube, ns, p["metadata"]["name"], "pytorch")
    wait_for(
        f"PyTorchJob {spread} Succeeded",
        lambda: _condition(kube.get("pytorchjob", spread, ns), "Succeeded", "Failed"),
        timeout=180,
        describe=lambda: json.dumps((kube.get("pytorchjob", spread, ns) or {}).get("status"), indent=1),
    )
    assert _condition(kube.get("pytorchjob", spread, ns), "Succeeded", "Failed") == "Succeeded"
    _assert_wiped_on(cfg, kube, ns, name, list(by_node))


def _wipe_failures_for(kube, ns: str, name: str, node: str) -> list[str]:
    """Messages of the WipeFailed Events on the cache that name ``node``."""
    events = kube.items("events", namespace=ns)
    return [
        e.get("message", "")
        for e in events
        if e.get("reason") == "WipeFailed"
        and (e.get("involvedObject") or {}).get("name") == name
        and node in e.get("message", "")
    ]


def _pinned_job(name: str, ns: str, cache: str, cfg, dataset, node: str) -> dict[str, Any]:
    job = w.training_job(name, ns, cache, cfg.stager_image, dataset, wait=True)
    job["spec"]["template"]["spec"]["nodeSelector"] = {HOSTNAME: node}
    return job


def _rejoin(kube, node: str) -> None:
    """Bring the lost node back: its kubelet registers it again (with a new podCIDR);
    then rewire the pod network for it."""
    node_sh("systemctl start kubelet", node=node, check=True)
    wait_for(
        f"{node} registered again with a podCIDR",
        lambda: ((kube.get("node", node) or {}).get("spec") or {}).get("podCIDR"),
        timeout=120,
    )
    rewire = os.environ.get("DSCACHE_E2E_REJOIN_CMD")
    if rewire:
        subprocess.run(rewire, shell=True, check=True, timeout=300)


def test_node_lost(cfg, kube, cache_factory, dataset, nodes):
    cache = cache_factory("lost")
    ns, name = cache["namespace"], cache["name"]
    workers = [n for n in nodes if "control-plane" not in n]
    assert len(workers) >= 2, f"need two worker nodes, have {nodes}"
    survivor, victim = workers[0], workers[1]
    kube.create(_pinned_job("lost-survivor", ns, name, cfg, dataset, survivor))
    kube.create(_pinned_job("lost-victim", ns, name, cfg, dataset, victim))
    for job in ("lost-survivor", "lost-victim"):
        wait_for(
            f"Job {job} to verify",
            lambda j=job: any(
                "VERIFIED" in kube.logs(p["metadata"]["name"], ns, w.TRAIN_CONTAINER)
                for p in kube.items("pods", namespace=ns, selector=f"job-name={j}")
            ),
            timeout=180,
        )
    _assert_staged_on(cfg, kube, ns, name, [survivor, victim])

    # The node is lost in the middle of the Job: kubelet stopped, Node object deleted.
    node_sh("systemctl stop kubelet", node=victim, check=True)
    try:
        kube.kubectl("delete", "node", victim, "--wait=true", "--timeout=60s")
        # Converges: the lost node is no longer counted Ready; the surviving copy is untouched.
        wait_for(
            f"{victim} to leave the Ready nodes",
            lambda: (
                _node_states(kube, ns, name).get(victim) != "Ready"
                and cache_status(kube, ns, name).get("readyNodes") == 1
            ),
            timeout=180,
            describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
        )
        assert node_path_exists(
            revs.complete_marker(host_copy(cfg, ns, name), _revision(kube, ns, name)), node=survivor
        )
        # No wipe is sent to the lost node again and again: over a minute, no failed wipe
        # there is reported (the node is gone from the API: its disk went with it).
        time.sleep(60)
        failures = _wipe_failures_for(kube, ns, name, victim)
        assert not failures, f"wipes keep being sent to the lost node {victim}: {failures}"

        # The surviving Job finishes; its copy is wiped; the cache stays Ready as a whole.
        pod = kube.items("pods", namespace=ns, selector="job-name=lost-survivor")[0]
        send_go(kube, ns, pod["metadata"]["name"], w.TRAIN_CONTAINER)
        _assert_wiped_on(cfg, kube, ns, name, [survivor])
        assert cache_status(kube, ns, name).get("phase") == "Ready", cache_status(kube, ns, name)
        # And the DatasetCache can still be deleted: its finalizer is not stuck on the lost node.
        kube.kubectl("delete", "job", "lost-victim", "-n", ns, "--wait=false", check=False)
        kube.kubectl("delete", "datasetcache", name, "-n", ns, "--wait=true", "--timeout=120s")
    finally:
        _rejoin(kube, victim)
        wait_for(f"{victim} Ready again", lambda: victim in schedulable_nodes(kube), timeout=180)
