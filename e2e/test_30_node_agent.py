"""30. The node agent (issue 16): warm nodes first, pre-staging, a byte budget with LRU, Ready.

Every test runs on the 3-node kind cluster, whose nodes each hold the cache root on a
1 GiB tmpfs (e2e/kind/up.sh), with one dscache-node agent per node (the chart's DaemonSet).

- test_prestage_then_place: pre-staged on one node, Jobs without node constraints land
  there and copy nothing; their Job-create-to-training-start times are overhead_warm_s.
- test_required_placement: with placement Required a pod waits, unscheduled, until a node
  holds its revision, instead of copying elsewhere.
- test_user_affinity_merged: a Job's own required node affinity is kept, and among the
  nodes it allows the warm one is preferred.
- test_ready_condition: kubectl wait --for=condition=Ready returns once every pre-stage
  node holds the revision.
- test_capacity_lru: with a budget of 3.5 copies, the oldest unused copy is evicted (an
  Event says so), a copy with a live reader never is, and a dataset bigger than the
  budget fails fast naming both numbers (and admission warns).
- test_agent_restart: the agent is killed mid-pre-stage and after a removal it did not
  finish; once restarted, its labels, its inventory and the disk agree, and nothing a
  lease holds was removed.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import pytest
from conftest import (
    RELEASE,
    RELEASE_NS,
    assert_complete,
    cache_status,
    describe_pods,
    host_copy,
    init_summary,
    job_pods,
    send_go,
    wait_verified,
)
from support import agent
from support import workloads as w
from support.kube import node_path_exists, node_sh, schedulable_nodes, wait_for
from support.s3link import bucket_link
from support.timeline import measure

import dscache_contract as contract
from dscache_node.disk import footprint

pytestmark = pytest.mark.multinode

WARM_TARGET_S = 1.0  # the product's target: Job create to training start on a warm node
RUNS = 3


def worker(kube) -> str:
    """A node without the control plane's pods: the stager requests 500m of CPU, and on this
    2-core cluster the control-plane node may not have that left (seen: Insufficient cpu)."""
    nodes = schedulable_nodes(kube)
    return next((n for n in nodes if "control-plane" not in n), nodes[0])


def revision_of(kube, ns: str, name: str) -> str:
    return wait_for("a pinned revision", lambda: (cache_status(kube, ns, name).get("revision") or {}).get("id"), 60)


def wait_ready(kube, ns: str, name: str, timeout: int = 240) -> None:
    p = kube.kubectl(
        "wait",
        "--for=condition=Ready",
        f"datasetcache/{name}",
        "-n",
        ns,
        f"--timeout={timeout}s",
        check=False,
        timeout=timeout + 30,
    )
    assert p.returncode == 0, f"{p.stdout}{p.stderr}\n{json.dumps(cache_status(kube, ns, name), indent=1)}"


def prestage_on(*nodes: str) -> dict[str, Any]:
    # Exactly these nodes: a selector on the hostname label when there is one node, else all
    # nodes (an empty selector) with a count.
    if len(nodes) == 1:
        return {
            "prestage": {"nodeSelector": {"kubernetes.io/hostname": nodes[0]}, "tolerations": [{"operator": "Exists"}]}
        }
    return {"prestage": {"tolerations": [{"operator": "Exists"}]}}


def pinned_job(name: str, ns: str, cache: str, image: str, ds: w.Dataset, node: str | None, wait: bool = False):
    job = w.training_job(name, ns, cache, image, ds, wait=wait)
    if node:
        job["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return job


@pytest.fixture(scope="module")
def warm_cache(kube, cache_factory):
    """One cache pre-staged on the last schedulable node only."""
    target = schedulable_nodes(kube)[-1]
    cache = cache_factory("warm", extra=prestage_on(target))
    ns, name = cache["namespace"], cache["name"]
    wait_ready(kube, ns, name)
    return {**cache, "node": target, "revision": revision_of(kube, ns, name)}


def test_ready_condition(cfg, kube, cache_factory):
    nodes = schedulable_nodes(kube)
    cache = cache_factory("ready", extra=prestage_on(*nodes))
    ns, name = cache["namespace"], cache["name"]
    rev = revision_of(kube, ns, name)
    wait_ready(kube, ns, name)
    st = cache_status(kube, ns, name)
    assert st["prestage"]["ready"] == st["prestage"]["wanted"] == len(nodes), st["prestage"]
    key = contract.warm_label(ns, name, rev)
    for node in nodes:
        assert key in agent.warm_labels(kube, node), agent.describe(kube, cfg.cache_root, node)
        assert node_path_exists(f"{host_copy(cfg, ns, name)}/revs/{rev}/meta/complete", node=node)
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["reason"] == "Prestaged", ready
    assert st["reason"] == "Prestaged" and st["warm"][0] == {"revision": rev, "nodes": len(nodes)}
    wide = kube.kubectl("get", "dsc", name, "-n", ns, "-o", "wide").stdout
    assert "Prestaged" in wide and "s3://" in wide, wide
    kube.delete("datasetcache", name, ns)  # its copies would compete with later tests' budgets


def test_prestage_then_place(cfg, kube, warm_cache, dataset):
    ns, name, target, rev = warm_cache["namespace"], warm_cache["name"], warm_cache["node"], warm_cache["revision"]
    labelled = [n for n in schedulable_nodes(kube) if contract.warm_label(ns, name, rev) in agent.warm_labels(kube, n)]
    assert labelled == [target], f"pre-staged on {target} only, labelled on {labelled}"
    runs = []
    for i in range(1, RUNS + 1):
        job = w.training_job(f"warm-{i}", ns, name, cfg.stager_image, dataset)
        runs.append(measure(kube, job, assert_complete, job_pods, init_summary))
    for r in runs:
        assert r["node"] == target and r["warm"] and r["copied_bytes"] == 0, r
    starts = [r["training_start_after_s"] for r in runs]
    median = round(statistics.median(starts), 3)
    result = {
        "overhead_warm_s": median,
        "overhead_warm_runs": starts,
        "overhead_warm_target_s": WARM_TARGET_S,
        "overhead_warm_target_met": median <= WARM_TARGET_S,
        "warm_runs": runs,
    }
    (cfg.results / "timeline-warm.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    # The pre-staged copy outlives the Jobs (WipeOnJobCompletion does not take it).
    time.sleep(6)
    assert node_path_exists(f"{host_copy(cfg, ns, name)}/revs/{rev}/meta/complete", node=target)


def test_user_affinity_merged(cfg, kube, warm_cache, dataset):
    ns, name, target = warm_cache["namespace"], warm_cache["name"], warm_cache["node"]
    others = [n for n in schedulable_nodes(kube) if n != target]
    allowed = sorted([others[0], target])
    job = w.training_job("own-affinity", ns, name, cfg.stager_image, dataset)
    user_term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": allowed}]}
    job["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [user_term]}}
    }
    kube.create(job)
    assert_complete(kube, ns, "own-affinity")
    pod = job_pods(kube, ns, "own-affinity")[0]
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [user_term], affinity
    key = contract.warm_label(ns, name, warm_cache["revision"])
    preferred = affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    assert any(e["key"] == key for t in preferred for e in t["preference"]["matchExpressions"]), affinity
    assert pod["spec"]["nodeName"] == target
    assert init_summary(pod)["fetched_bytes"] == 0


def test_required_placement(cfg, kube, cache_factory, dataset):
    target = worker(kube)
    cache = cache_factory("required", extra={"placement": {"mode": "Required"}})
    ns, name = cache["namespace"], cache["name"]
    rev = revision_of(kube, ns, name)
    created = kube.create(w.training_job("required-1", ns, name, cfg.stager_image, dataset))
    assert "no node" in created.stderr.lower(), f"expected an admission warning, got {created.stderr!r}"

    def unschedulable() -> dict | None:
        for p in job_pods(kube, ns, "required-1"):
            for c in (p.get("status") or {}).get("conditions") or []:
                if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
                    return p
        return None

    wait_for("the pod to wait, unscheduled", unschedulable, timeout=60)
    time.sleep(8)
    pod = job_pods(kube, ns, "required-1")[0]
    assert not pod["spec"].get("nodeName"), "a pod with Required placement was scheduled onto a cold node"
    # Now a node gets the revision: the waiting pod goes there and copies nothing.
    kube.kubectl("patch", "dsc", name, "-n", ns, "--type=merge", "-p", json.dumps({"spec": prestage_on(target)}))
    assert_complete(kube, ns, "required-1", timeout=240)
    pod = job_pods(kube, ns, "required-1")[0]
    assert pod["spec"]["nodeName"] == target
    summary = init_summary(pod)
    assert summary["fetched_bytes"] == 0 and summary["revision"] == rev, summary
    kube.delete("datasetcache", name, ns)


def _set_budget(kube, value: str) -> None:
    kube.helm(
        "upgrade",
        RELEASE,
        str(agent_chart()),
        "-n",
        RELEASE_NS,
        "--reuse-values",
        "--wait",
        "--timeout",
        "300s",
        "--set",
        f"nodeAgent.budget={value}",
    )
    kube.kubectl(
        "rollout", "status", "daemonset", "-n", RELEASE_NS, "-l", agent.AGENT_SELECTOR, "--timeout=180s", check=False
    )
    for node in schedulable_nodes(kube):
        wait_for(f"the agent on {node} to serve", lambda node=node: _agent_ready(kube, node), timeout=120)


def agent_chart():
    from conftest import REPO

    return REPO / "charts/dscache"


def _agent_ready(kube, node: str) -> bool:
    pod = agent.agent_pod(kube, node)
    return bool(pod and all(cs.get("ready") for cs in (pod.get("status") or {}).get("containerStatuses") or []))


def _leases(cfg, ns: str, name: str, rev: str, node: str) -> list[str]:
    p = node_sh(f"ls {host_copy(cfg, ns, name)}/leases/{rev} 2>/dev/null; echo end", node=node)
    return p.stdout.split()[:-1]


def _inventory(kube, node: str) -> contract.Inventory:
    return wait_for(f"the inventory of {node}", lambda: agent.inventory(kube, node), timeout=60)


@pytest.mark.timeout(1500)
def test_capacity_lru(cfg, kube, s3, cache_factory, dataset):
    node = worker(kube)
    # What one copy counts against the budget: its bytes and its files' blocks (disk.footprint;
    # the nodes' filesystems have 4 KiB blocks).
    size = footprint(dataset.bytes, dataset.objects, 4096)
    retain = {"policy": "RetainWhileUsed", "ttlAfterLastUse": "1h"}
    reader = None
    try:
        # A clean slate first: a budget of 1 byte evicts every copy no lease holds (earlier
        # tests' copies would otherwise be the least recently used ones below).
        _set_budget(kube, "1")
        wait_for(
            f"every unused copy on {node} to be evicted",
            lambda: not [r for r in _inventory(kube, node).revisions if r.complete and not r.leases],
            timeout=120,
            describe=lambda: agent.describe(kube, cfg.cache_root, node),
        )
        budget = _inventory(kube, node).held + int(3.5 * size)  # what is in use, plus 3.5 copies
        _set_budget(kube, str(budget))
        caches = {k: cache_factory(f"lru-{k}", retention=retain) for k in ("a", "b", "r", "d")}
        revs = {k: revision_of(kube, c["namespace"], c["name"]) for k, c in caches.items()}
        ns = caches["a"]["namespace"]

        def path(k: str) -> str:
            return f"{host_copy(cfg, ns, caches[k]['name'])}/revs/{revs[k]}/meta/complete"

        for k in ("a", "b"):  # two copies used and left, a before b
            kube.create(pinned_job(f"lru-{k}", ns, caches[k]["name"], cfg.stager_image, dataset, node))
            assert_complete(kube, ns, f"lru-{k}")
            wait_for(
                f"the agent to release the lease of lru-{k}'s finished pod",
                lambda k=k: not _leases(cfg, ns, caches[k]["name"], revs[k], node),
                timeout=90,
                describe=lambda: agent.describe(kube, cfg.cache_root, node),
            )
            time.sleep(1.5)  # the LRU clock is the lease dir's mtime
        # A live reader holds r.
        kube.create(pinned_job("lru-r", ns, caches["r"]["name"], cfg.stager_image, dataset, node, wait=True))
        reader = wait_verified(kube, ns, "lru-r")
        assert all(node_path_exists(path(k), node=node) for k in ("a", "b", "r"))
        # d needs room: a (the oldest unused) goes; b (unused, newer) and r (in use) stay.
        kube.create(pinned_job("lru-d", ns, caches["d"]["name"], cfg.stager_image, dataset, node))
        assert_complete(kube, ns, "lru-d")
        on_disk = {k: node_path_exists(path(k), node=node) for k in ("a", "b", "r", "d")}
        assert on_disk == {"a": False, "b": True, "r": True, "d": True}, (
            on_disk,
            agent.describe(kube, cfg.cache_root, node),
        )
        events = kube.kubectl(
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            f"involvedObject.name={caches['a']['name']},reason=Evicted",
            "-o",
            "json",
        ).stdout
        assert json.loads(events)["items"], "no Evicted Event on the evicted cache"
        assert contract.warm_label(ns, caches["a"]["name"], revs["a"]) not in agent.warm_labels(kube, node)
        # Bigger than the whole budget: admission warns; the stager fails at once, with both numbers.
        chunk = size // 4 + 1
        big = w.Dataset(
            bucket=dataset.bucket,
            prefix=f"big-{cfg.run_id}",
            files={f"part-{i:03d}.bin": bytes([i % 256]) * chunk for i in range(budget // chunk + 2)},
        )
        w.upload(s3, big)
        assert big.bytes > budget
        cbig = cache_factory("lru-big", ds=big)
        created = kube.create(pinned_job("lru-big", ns, cbig["name"], cfg.stager_image, big, node))
        assert "budget" in created.stderr, f"no admission warning: {created.stderr!r}"
        wait_for(
            "the big Job to fail",
            lambda: job_condition_failed(kube, ns, "lru-big"),
            timeout=180,
            describe=lambda: describe_pods(kube, ns, "job-name=lru-big"),
        )
        pod = job_pods(kube, ns, "lru-big")[0]
        term = next(c for c in pod["status"]["initContainerStatuses"] if c["name"] == w.INIT_NAME)["state"][
            "terminated"
        ]
        assert term["exitCode"] == 4, term
        assert f"needs {big.bytes} bytes" in term["message"] and f"budget is {budget} bytes" in term["message"], term
        assert node_path_exists(path("r"), node=node), "the copy a live reader holds was evicted"
    finally:
        if reader is not None:
            send_go(kube, reader["metadata"]["namespace"], reader["metadata"]["name"])
        _set_budget(kube, "80%")


def job_condition_failed(kube, ns: str, job: str) -> bool:
    obj = kube.get("job", job, ns) or {}
    return any(
        c.get("type") == "Failed" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def _kill_agent(kube, node: str) -> int:
    """SIGKILL the agent's process on its node (the kubelet restarts the container); its restart count before."""
    pod = agent.agent_pod(kube, node)
    assert pod is not None, f"no agent on {node}"
    restarts = sum(cs.get("restartCount", 0) for cs in pod["status"].get("containerStatuses") or [])
    # "[b]in": the pattern must not match this very shell's command line.
    p = node_sh("pkill -9 -f 'python3 /opt/dscache/[b]in/dscache-node' && echo killed", node=node)
    assert "killed" in p.stdout, p.stderr
    return restarts


def _restarted(kube, node: str, before: int) -> bool:
    pod = agent.agent_pod(kube, node)
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
    return sum(cs.get("restartCount", 0) for cs in statuses) > before and all(cs.get("ready") for cs in statuses)


@pytest.mark.timeout(900)
def test_agent_restart(cfg, kube, s3, cache_factory, dataset):
    node = schedulable_nodes(kube)[1]
    # A larger dataset, so that the pre-stage copy is still running when the agent dies.
    ds = w.Dataset(bucket=dataset.bucket, prefix=f"restart-{cfg.run_id}", files=w.make_files(seed=31, count=400))
    w.upload(s3, ds)
    # A live reader holds a revision of another cache on the node throughout.
    held = cache_factory("held")
    hns, hname = held["namespace"], held["name"]
    hrev = revision_of(kube, hns, hname)
    kube.create(pinned_job("restart-reader", hns, hname, cfg.stager_image, dataset, node, wait=True))
    reader = wait_verified(kube, hns, "restart-reader")
    held_path = f"{host_copy(cfg, hns, hname)}/revs/{hrev}/meta/complete"

    # 1. Killed mid-pre-stage.
    def staging() -> bool:
        for p in kube.items("pods", namespace=ns, selector="dscache.io/prestage=true"):
            for cs in (p.get("status") or {}).get("initContainerStatuses") or []:
                if cs["name"] == w.INIT_NAME and "running" in (cs.get("state") or {}):
                    return True
        return False

    # The bucket's link limited to 80 mbit: the 124 MB copy takes ~12 s, so it is surely running
    # when the agent dies (unlimited, CI saw it done in 0.34 s, before any poll saw it running).
    with bucket_link(80):
        cache = cache_factory("restart", ds=ds, extra=prestage_on(node))
        ns, name = cache["namespace"], cache["name"]
        rev = revision_of(kube, ns, name)
        wait_for(
            "the pre-stage copy to be running",
            staging,
            timeout=120,
            interval=0.2,
            describe=lambda: describe_pods(kube, ns, "dscache.io/prestage=true"),
        )
        before = _kill_agent(kube, node)
        wait_for(f"the agent on {node} to restart", lambda: _restarted(kube, node, before), timeout=120)
        wait_ready(kube, ns, name)
    assert contract.warm_label(ns, name, rev) in agent.warm_labels(kube, node)

    # 2. A removal the agent did not finish (the state a kill mid-removal leaves: the revision
    #    already renamed to .gone-*, partly deleted), then killed again.
    gone = f"{host_copy(cfg, ns, name)}/revs/.gone-r-00000000000000000000-1-1"
    node_sh(
        f"mkdir -p {gone}/data/x {gone}/meta && echo partial > {gone}/data/x/f && echo '{{}}' > {gone}/meta/complete",
        check=True,
        node=node,
    )
    before = _kill_agent(kube, node)
    wait_for(f"the agent on {node} to restart", lambda: _restarted(kube, node, before), timeout=120)
    wait_for(
        "labels, inventory and disk to agree, and the leftover to be gone",
        lambda: (
            not agent.leftovers_on_disk(cfg.cache_root, node) and agent.disagreement(kube, cfg.cache_root, node) is None
        ),
        timeout=90,
        describe=lambda: (
            f"{agent.disagreement(kube, cfg.cache_root, node)}\n{agent.describe(kube, cfg.cache_root, node)}"
        ),
    )
    assert node_path_exists(held_path, node=node), "a revision a live reader holds was removed"
    assert contract.warm_label(hns, hname, hrev) in agent.warm_labels(kube, node)
    send_go(kube, hns, reader["metadata"]["name"])
    assert_complete(kube, hns, "restart-reader")
