"""27. Every feature in a restricted namespace: the node's copy as the node agent's CSI volume,
whose lease is the mount (NodePublishVolume takes it, NodeUnpublishVolume releases it).

- test_restricted_namespace_full_features: a namespace enforcing Pod Security restricted; an
  Indexed Job of two pods per node stages one copy per node, fetched once per cluster (the
  bucket's own counter: at most 1.1x the dataset); a second Job lands on the warm nodes and
  copies nothing; the copies are wiped after;
- test_csi_lease_is_the_mount: while a pod's volume is published, a wipe of its revision that
  releases the pod (what a stale controller would send) is refused; the pod deleted mid-run,
  and in a second case force-deleted: its lease is gone within seconds of its unpublish; the
  agent killed between publish and unpublish: after its restart nothing is lost or leaked;
- test_no_privilege_in_tenant_pods: no pod the webhook mutated has a hostPath volume, runs its
  stager as root, or keeps a capability.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from typing import Any

import pytest
from conftest import (
    assert_complete,
    cache_status,
    host_copy,
    init_summary,
    job_pods,
    send_go,
    wait_verified,
)
from support import agent, revs
from support import workloads as w
from support.kube import node_path_exists, node_sh, schedulable_nodes, wait_for
from support.s3link import bucket_link, s3_sent_bytes

import dscache_contract as contract
from dscache_contract import csi

pytestmark = pytest.mark.multinode

MiB = 1 << 20
LINK_MBIT = 80
STAGER = {"resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}}


@pytest.fixture(scope="module")
def nodes(kube) -> list[str]:
    names = schedulable_nodes(kube)
    assert len(names) >= 3, f"these tests need 3 nodes that run pods, the cluster has {names}"
    return names


@pytest.fixture(scope="module")
def csi_dataset(cfg, s3) -> w.Dataset:
    """30 MiB: 12 objects of 2-3 MiB and 100 small ones."""
    rnd = random.Random(27)
    files = {f"shards/{i:03d}.bin": rnd.randbytes(2 * MiB + rnd.randrange(MiB)) for i in range(12)}
    files.update({f"small/{i:04d}.bin": rnd.randbytes(rnd.choice([100, 4096, 65536])) for i in range(100)})
    ds = w.Dataset(bucket=f"dscache-csi-{cfg.run_id}", prefix="csi", files=files)
    w.upload(s3, ds)
    return ds


def two_per_node_job(name: str, ns: str, cache: str, image: str, ds: w.Dataset, pods: int) -> dict[str, Any]:
    """An Indexed Job of ``pods`` pods spread evenly over the nodes (topology spread, max skew 1)."""
    job = w.training_job(name, ns, cache, image, ds)
    spec = job["spec"]
    spec.update({"completions": pods, "parallelism": pods, "completionMode": "Indexed", "backoffLimit": 0})
    tpl = spec["template"]
    tpl["metadata"]["labels"]["e2e-csi"] = name
    tpl["spec"]["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"e2e-csi": name}},
        }
    ]
    return job


def verified(kube, ns: str, pods: list[dict[str, Any]], ds: w.Dataset) -> None:
    for p in pods:
        log = kube.logs(p["metadata"]["name"], ns, w.TRAIN_CONTAINER)
        assert f"VERIFIED objects={ds.objects} bytes={ds.bytes}" in log, log


@pytest.mark.timeout(900)
def test_restricted_namespace_full_features(cfg, kube, cache_factory, csi_dataset, namespaces, nodes):
    ns = namespaces["restricted"]
    enforce = kube.get("namespace", ns)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    assert enforce == "restricted"
    # Kept a minute after its last use, so that Job 2 finds the nodes warm; wiped then.
    retain = {"policy": "RetainWhileUsed", "ttlAfterLastUse": "60s"}
    cache = cache_factory("rst", namespace=ns, ds=csi_dataset, extra=STAGER, retention=retain)
    name = cache["name"]
    rev = cache_status(kube, ns, name)["revision"]["id"]

    # Job 1: two pods on each node, one copy per node, the bucket serving each object about once.
    first = f"rst-{uuid.uuid4().hex[:6]}"
    with bucket_link(LINK_MBIT):
        before = s3_sent_bytes()
        kube.create(two_per_node_job(first, ns, name, cfg.stager_image, csi_dataset, 2 * len(nodes)))
        assert_complete(kube, ns, first, timeout=300)
        sent = s3_sent_bytes() - before
    pods = job_pods(kube, ns, first)
    verified(kube, ns, pods, csi_dataset)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for p in pods:
        by_node.setdefault(p["spec"]["nodeName"], []).append(init_summary(p))
    report = {
        "dataset_bytes": csi_dataset.bytes,
        "bucket_sent_bytes": sent,
        "by_node": {
            n: [{k: s[k] for k in ("fetched_bytes", "bucket_bytes", "peer_bytes", "warm")} for s in ss]
            for n, ss in by_node.items()
        },
    }
    (cfg.results / "csi-restricted.json").write_text(json.dumps(report, indent=1))
    assert sorted(len(v) for v in by_node.values()) == [2] * len(nodes), report
    for node, summaries in by_node.items():
        # One copy per node: one of its two pods fetched the revision, the other found it whole.
        assert sum(s["fetched_bytes"] for s in summaries) == csi_dataset.bytes, (node, report)
    assert sent <= 1.1 * csi_dataset.bytes, report
    assert sum(s["peer_bytes"] for ss in by_node.values() for s in ss) > 0, report
    for p in pods:
        vol = next(v for v in p["spec"]["volumes"] if v["name"] == contract.VOLUME_NAME)
        assert vol["csi"]["driver"] == csi.DRIVER, vol

    # The node entries show the CSI volume, and every node is warm for this revision.
    label = contract.warm_label(ns, name, rev)
    wait_for(
        "every node warm for the revision",
        lambda: all(label in agent.warm_labels(kube, n) for n in by_node),
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    # The status follows within a reconciliation or two (10 s apart with the README's release).
    wait_for(
        "the node entries to show the CSI volume",
        lambda: {e.get("volume") for e in cache_status(kube, ns, name).get("nodes") or []} == {"CSI"},
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )

    # Job 2: placed on the warm nodes, it copies nothing.
    second = f"rst2-{uuid.uuid4().hex[:6]}"
    with bucket_link(LINK_MBIT):
        before = s3_sent_bytes()
        kube.create(two_per_node_job(second, ns, name, cfg.stager_image, csi_dataset, len(nodes)))
        assert_complete(kube, ns, second, timeout=300)
        sent2 = s3_sent_bytes() - before
    pods2 = job_pods(kube, ns, second)
    verified(kube, ns, pods2, csi_dataset)
    for p in pods2:
        s = init_summary(p)
        assert (s["warm"], s["fetched_bytes"]) == (True, 0), s
        assert p["spec"]["nodeName"] in by_node
    assert sent2 < csi_dataset.bytes / 10, sent2  # a probe and no data

    # Both Jobs complete: a minute later the copies are wiped on every node.
    c = host_copy(cfg, ns, name)
    for node in by_node:
        revs.wait_revision_wiped(kube, ns, name, c, rev, node, timeout=180)


def _wipe(kube, node: str, req: contract.WipeRequest) -> dict[str, Any]:
    """POST a wipe to the node's agent as the controller does (its token for that node, over TLS)."""
    code, body = agent.agent_call(
        kube, node, "POST", contract.WIPE_PATH, agent.controller_token(kube, node), req.to_json()
    )
    if code != 200:
        return {"http": code, "body": body.decode(errors="replace")}
    return dict(json.loads(body))


def _lease_mount(cfg, ns: str, name: str, rev: str, uid: str, node: str) -> str | None:
    """The mount a lease on the node names (None: no lease)."""
    path = revs.lease(host_copy(cfg, ns, name), rev, uid)
    p = node_sh(f"cat {path} 2>/dev/null", node=node)
    if not p.stdout.strip():
        return None
    return json.loads(p.stdout).get(csi.LEASE_MOUNT_KEY) or ""


def _running_pod(kube, cfg, ns: str, name: str, ds: w.Dataset, node: str) -> dict[str, Any]:
    job = f"lease-{uuid.uuid4().hex[:6]}"
    spec = w.training_job(job, ns, name, cfg.stager_image, ds, wait=True)
    spec["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    kube.create(spec)
    return wait_verified(kube, ns, job)


def _mounted(node: str, target_part: str) -> bool:
    return target_part in node_sh("cat /proc/self/mountinfo", node=node).stdout


@pytest.mark.timeout(900)
def test_csi_lease_is_the_mount(cfg, kube, cache_factory, dataset, namespaces, nodes):
    ns = namespaces["restricted"]
    cache = cache_factory("lease", namespace=ns, extra=STAGER)
    name = cache["name"]
    node = nodes[0]
    pod = _running_pod(kube, cfg, ns, name, dataset, node)
    uid, rev = pod["metadata"]["uid"], revs.pod_revision(pod)
    mount = _lease_mount(cfg, ns, name, rev, uid, node)
    assert mount and f"/pods/{uid}/volumes/kubernetes.io~csi/" in mount, mount
    assert _mounted(node, mount)

    # A wipe that releases this pod (a controller whose pod view lost it) is refused: the mount holds it.
    answer = _wipe(kube, node, contract.WipeRequest(ns, name, revision=rev, release=(uid,)))
    assert answer.get("removed") is False and uid in answer.get("leases", []), answer
    assert node_path_exists(revs.complete_marker(host_copy(cfg, ns, name), rev), node)

    # Deleted mid-run: the lease goes with the unpublish.
    t0 = time.monotonic()
    kube.kubectl("delete", "pod", pod["metadata"]["name"], "-n", ns, "--wait=false")
    wait_for("the deleted pod's lease to go", lambda: _lease_mount(cfg, ns, name, rev, uid, node) is None, timeout=60)
    deleted_s = time.monotonic() - t0
    assert not _mounted(node, mount)
    assert f"unpublished {mount}" in agent.agent_log(kube, node)

    # Force-deleted: the API object goes at once; the kubelet still unpublishes, and the lease goes then.
    pod = _running_pod(kube, cfg, ns, name, dataset, node)
    uid = pod["metadata"]["uid"]
    mount = _lease_mount(cfg, ns, name, rev, uid, node)
    assert mount
    t0 = time.monotonic()
    kube.kubectl("delete", "pod", pod["metadata"]["name"], "-n", ns, "--grace-period=0", "--force")
    wait_for(
        "the force-deleted pod's lease to go", lambda: _lease_mount(cfg, ns, name, rev, uid, node) is None, timeout=60
    )
    forced_s = time.monotonic() - t0
    assert not _mounted(node, mount)

    # The agent killed between publish and unpublish: the mount and the lease outlive it, the
    # restarted agent reads them back, and the unpublish after it releases the lease.
    pod = _running_pod(kube, cfg, ns, name, dataset, node)
    uid = pod["metadata"]["uid"]
    mount = _lease_mount(cfg, ns, name, rev, uid, node)
    before = sum(cs.get("restartCount", 0) for cs in agent.agent_pod(kube, node)["status"]["containerStatuses"])
    p = node_sh("pkill -9 -f 'python3 /opt/dscache/[b]in/dscache-node' && echo killed", node=node)
    assert "killed" in p.stdout, p.stderr
    wait_for(
        "the agent to restart",
        lambda: (
            sum(cs.get("restartCount", 0) for cs in agent.agent_pod(kube, node)["status"]["containerStatuses"]) > before
            and all(cs.get("ready") for cs in agent.agent_pod(kube, node)["status"]["containerStatuses"])
        ),
        timeout=120,
    )
    assert "published volume(s) read back" in agent.agent_log(kube, node)
    assert _lease_mount(cfg, ns, name, rev, uid, node) == mount and _mounted(node, mount)
    # The pod still reads its data through the mount, and finishes.
    send_go(kube, ns, pod["metadata"]["name"])
    wait_for(
        "the pod to succeed",
        lambda: (kube.get("pod", pod["metadata"]["name"], ns) or {}).get("status", {}).get("phase") == "Succeeded",
        timeout=120,
    )
    wait_for("the finished pod's lease to go", lambda: _lease_mount(cfg, ns, name, rev, uid, node) is None, timeout=90)
    assert not _mounted(node, mount)
    (cfg.results / "csi-lease.json").write_text(
        json.dumps(
            {"lease_gone_after_delete_s": round(deleted_s, 1), "lease_gone_after_force_delete_s": round(forced_s, 1)}
        )
    )


def test_no_privilege_in_tenant_pods(kube, namespaces):
    """Every pod the webhook mutated in this session's namespaces (the consumer label says so):
    no hostPath volume, and a stager that runs non-root with no capability."""
    checked = 0
    for ns in namespaces.values():
        for pod in kube.items("pods", namespace=ns, selector=contract.LABEL_CONSUMER):
            spec = pod["spec"]
            name = f"{ns}/{pod['metadata']['name']}"
            assert not [v for v in spec.get("volumes") or [] if "hostPath" in v], name
            pod_sc = spec.get("securityContext") or {}
            for c in (spec.get("initContainers") or []) + spec["containers"]:
                if c["name"] != contract.STAGER_CONTAINER_NAME and c["name"] != "prestaged":
                    continue
                sc = {**pod_sc, **(c.get("securityContext") or {})}
                assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0, (name, sc)
                assert sc.get("allowPrivilegeEscalation") is False, (name, sc)
                assert sc.get("capabilities") == {"drop": ["ALL"]}, (name, sc)
                checked += 1
    assert checked > 0, "no mutated pod was left to check"
