"""99. `helm uninstall` leaves nothing: no DatasetCache stuck on its finalizer, no copy on any node.

The chart's pre-delete hook (charts/dscache/templates/uninstall-hook.yaml, `python -m
dscache_operator uninstall`) deletes every DatasetCache while the controller and the node
agents still run, and waits until the controller has had every node's copies wiped and
removed its finalizer; only then does Helm delete the operator.

This file runs LAST (its name sorts after every other test file): it removes the chart the
session's `release` fixture installed, so no test may follow it.
"""

from __future__ import annotations

import json
import shlex
import time

import pytest
from conftest import RELEASE, RELEASE_NS, assert_complete, cache_status, host_copy, job_pods
from support import agent
from support import workloads as w
from support.kube import node_path_exists, node_sh, schedulable_nodes, wait_for

WORKLOADS = ("jobs.batch", "jobsets.jobset.x-k8s.io", "pytorchjobs.kubeflow.org")


def agent_nodes(kube) -> list[str]:
    """Every node that runs a node agent (by default every node, tainted ones too)."""
    pods = kube.items("pods", namespace=RELEASE_NS, selector=agent.AGENT_SELECTOR)
    return sorted({p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")})


def revision_dirs(cache_root: str, namespaces: list[str], node: str) -> list[str]:
    """Every revision directory (complete or not) under <cacheRoot>/<ns>/ of ``namespaces`` on ``node``."""
    dirs = " ".join(shlex.quote(f"{cache_root}/{ns}") for ns in namespaces)
    p = node_sh(
        f'for d in {dirs}; do [ -d "$d" ] && find "$d" -mindepth 3 -maxdepth 3 -path \'*/revs/*\'; done; echo end',
        node=node,
    )
    lines = p.stdout.split()
    if p.returncode != 0 or not lines or lines[-1] != "end":
        raise AssertionError(f"cannot list {dirs} on {node}: {p.stderr[-300:]}")
    return lines[:-1]


def end_earlier_workloads(kube, namespaces: list[str]) -> None:
    """A pod that still runs holds its cache by design (the hook waits for it, as any deletion
    does): the earlier tests' workloads go first, as a user ends their Jobs before uninstalling."""
    for ns in namespaces:
        for kind in WORKLOADS:  # a kind whose CRD is absent is only an error message
            kube.kubectl("delete", kind, "--all", "-n", ns, "--wait=false", check=False)

    def running() -> list[str]:
        return [
            f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            for ns in namespaces
            for p in kube.items("pods", namespace=ns, selector="dscache.io/consumer=true")
            if (p.get("status") or {}).get("phase") in ("Pending", "Running")
        ]

    if running():
        for ns in namespaces:  # bare pods (no workload owns them)
            kube.kubectl("delete", "pods", "-l", "dscache.io/consumer=true", "-n", ns, "--wait=false", check=False)
    wait_for("no consumer pod running", lambda: not running(), timeout=180, describe=lambda: "\n".join(running()))


@pytest.mark.timeout(900)  # a pre-stage on every node (<= 240 s), a Job, then the uninstall (<= 300 s)
def test_uninstall_leaves_nothing(cfg, kube, release, namespaces, cache_factory, dataset):
    nodes = agent_nodes(kube)
    assert nodes, "no node agent runs"
    ns = namespaces["main"]
    end_earlier_workloads(kube, list(namespaces.values()))
    # Live caches with copies on every node: one pre-staged everywhere, one kept after its Job.
    everywhere = cache_factory("bye-all", extra={"prestage": {"tolerations": [{"operator": "Exists"}]}})
    ready = kube.kubectl(
        "wait",
        "--for=condition=Ready",
        f"datasetcache/{everywhere['name']}",
        "-n",
        ns,
        "--timeout=240s",
        check=False,
        timeout=270,
    )
    assert ready.returncode == 0, ready.stderr + json.dumps(cache_status(kube, ns, everywhere["name"]), indent=1)
    rev = cache_status(kube, ns, everywhere["name"])["revision"]["id"]
    # Every node that takes pods holds it (pre-staging places no copy where no pod could run).
    workers = schedulable_nodes(kube)
    for node in workers:
        complete = f"{host_copy(cfg, ns, everywhere['name'])}/revs/{rev}/meta/complete"
        assert node_path_exists(complete, node=node), agent.describe(kube, cfg.cache_root, node)
    kept = cache_factory("bye-kept", retention={"policy": "RetainWhileUsed", "ttlAfterLastUse": "1h"})
    job = w.training_job("bye-job", ns, kept["name"], cfg.stager_image, dataset)
    kube.create(job)
    assert_complete(kube, ns, "bye-job")
    kept_node = job_pods(kube, ns, "bye-job")[0]["spec"]["nodeName"]
    time.sleep(3)  # a few reconciliations: the retained copy stays after its Job
    assert node_path_exists(host_copy(cfg, ns, kept["name"]), node=kept_node)
    before = {node: revision_dirs(cfg.cache_root, list(namespaces.values()), node) for node in nodes}
    assert all(before[n] for n in workers), f"expected copies on every node before the uninstall: {before}"

    t0 = time.monotonic()
    p = kube.helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout", "300s", check=False, timeout=420)
    seconds = round(time.monotonic() - t0, 1)
    hook_log = kube.kubectl("logs", "job/dscache-uninstall", "-n", RELEASE_NS, check=False).stdout
    assert p.returncode == 0, f"helm uninstall failed after {seconds} s:\n{p.stdout}\n{p.stderr}\n--- hook\n{hook_log}"
    print(f"helm uninstall: {seconds} s")

    # No DatasetCache left anywhere (the CRD stays, crds.keep), none stuck on a finalizer.
    left = json.loads(kube.kubectl("get", "datasetcaches.dscache.io", "-A", "-o", "json").stdout)["items"]
    assert left == [], [
        (c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"].get("finalizers")) for c in left
    ]
    # No copy under cacheRoot on any node, and no half-removed one.
    for node in nodes:
        assert revision_dirs(cfg.cache_root, list(namespaces.values()), node) == [], node
        assert agent.leftovers_on_disk(cfg.cache_root, node) == [], node
    # The operator and the hook's own objects are gone (the hook deletes itself once it succeeded).
    assert kube.helm("status", RELEASE, "-n", RELEASE_NS, check=False).returncode != 0
    for kind, name in (
        ("job", "dscache-uninstall"),
        ("serviceaccount", "dscache-uninstall"),
        ("clusterrole", "dscache-uninstall"),
        ("clusterrolebinding", "dscache-uninstall"),
        ("deployment", "dscache-controller"),
        ("daemonset", "dscache-node"),
    ):
        namespace = RELEASE_NS if kind in ("job", "serviceaccount", "deployment", "daemonset") else None
        wait_for(f"{kind}/{name} to be gone", lambda k=kind, n=name, s=namespace: kube.get(k, n, s) is None, timeout=60)
    assert cache_status(kube, ns, everywhere["name"]) == {}
