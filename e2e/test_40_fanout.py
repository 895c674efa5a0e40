"""40. Fetch once per cluster (issue 17): the nodes of a distributed Job share one revision.

The S3 server is a container on kind's network; its link to the nodes is limited with tc tbf
(in its own network namespace, from the host) so that a copy takes seconds, and what it sent
is read from its own interface counter: the bucket's side, not the stagers' word.

- test_fanout_single_egress: an Indexed Job of 3 pods, one per node, starting together: every
  node stages the revision and every pod verifies every byte, while the bucket serves at most
  1.1x the dataset (3x without peers);
- test_fanout_peer_dies: the same, with the agent serving the other nodes killed mid-transfer (the DaemonSet
  restarts it): every node still ends exact, and the bucket serves well under 3x;
(Who an agent serves: e2e/test_29_agent_identity.py.)
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import pytest
from conftest import describe_pods, init_summary, job_pods
from support import workloads as w
from support.agent import agent_call
from support.kube import node_sh, schedulable_nodes, wait_for
from support.s3link import bucket_link, s3_sent_bytes

pytestmark = pytest.mark.multinode

#: The bucket's link while these tests run: 60 MiB take ~6 s through it, so three nodes
#: reading it independently would take ~18 s.
LINK_MBIT = 80
MiB = 1 << 20


@pytest.fixture(scope="module")
def nodes(kube) -> list[str]:
    names = schedulable_nodes(kube)
    assert len(names) >= 3, f"these tests need 3 nodes that run pods, the cluster has {names}"
    return names


@pytest.fixture(scope="module")
def fan_dataset(cfg, s3) -> w.Dataset:
    """60 MiB: 24 objects of 2-3 MiB (multipart-free: their ETags are MD5s) and 200 small ones."""
    rnd = random.Random(40)
    files = {f"shards/{i:03d}.bin": rnd.randbytes(2 * MiB + rnd.randrange(MiB)) for i in range(24)}
    files.update({f"small/{i:04d}.bin": rnd.randbytes(rnd.choice([100, 4096, 65536])) for i in range(200)})
    ds = w.Dataset(bucket=f"dscache-fan-{cfg.run_id}", prefix="fanout", files=files)
    w.upload(s3, ds)
    return ds


def _small_stager() -> dict[str, Any]:
    # Three stagers at once on this 2-core cluster: the default 500m request may not fit beside
    # the control plane's pods.
    return {"resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}}


def spread_job(name: str, ns: str, cache: str, image: str, ds: w.Dataset) -> dict[str, Any]:
    """An Indexed Job of 3 pods, one per node (required anti-affinity), starting together."""
    job = w.training_job(name, ns, cache, image, ds)
    spec = job["spec"]
    spec.update({"completions": 3, "parallelism": 3, "completionMode": "Indexed", "backoffLimit": 0})
    tpl = spec["template"]
    tpl["metadata"]["labels"]["e2e-spread"] = name
    tpl["spec"]["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"e2e-spread": name}}, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }
    return job


def wait_complete(kube, ns: str, job: str, timeout: float = 300) -> None:
    def done() -> str | None:
        for c in ((kube.get("job", job, ns) or {}).get("status") or {}).get("conditions") or []:
            if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
                return str(c["type"])
        return None

    state = wait_for(f"Job {ns}/{job} to finish", done, timeout=timeout, describe=lambda: describe_pods(kube, ns))
    assert state == "Complete", describe_pods(kube, ns, f"job-name={job}")


def run_spread(cfg, kube, ns: str, cache: str, ds: w.Dataset, during=None) -> tuple[int, list[dict[str, Any]]]:
    """Run the 3-pod Job through the limited link; (bytes the bucket sent, the pods)."""
    name = f"fan-{uuid.uuid4().hex[:6]}"
    with bucket_link(LINK_MBIT):
        before = s3_sent_bytes()
        kube.create(spread_job(name, ns, cache, cfg.stager_image, ds))
        if during is not None:
            during(name)
        wait_complete(kube, ns, name)
        sent = s3_sent_bytes() - before
    pods = job_pods(kube, ns, name)
    assert len(pods) == 3 and len({p["spec"]["nodeName"] for p in pods}) == 3, [p["spec"].get("nodeName") for p in pods]
    for p in pods:
        log = kube.logs(p["metadata"]["name"], ns, w.TRAIN_CONTAINER)
        assert f"VERIFIED objects={ds.objects} bytes={ds.bytes}" in log, log
    return sent, pods


def summaries(pods: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for p in pods:
        s = init_summary(p)
        assert s["bucket_bytes"] + s["peer_bytes"] == s["fetched_bytes"], s
        out[p["spec"]["nodeName"]] = s
    return out


def write_report(cfg, name: str, ds: w.Dataset, sent: int, by_node: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The run's figures, in build/<name> and on stdout."""
    report = {
        **extra,
        "dataset_bytes": ds.bytes,
        "bucket_sent_bytes": sent,
        "link_mbit": LINK_MBIT,
        "nodes": {n: {k: s[k] for k in ("bucket_bytes", "peer_bytes", "seconds")} for n, s in by_node.items()},
    }
    (cfg.results / name).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return report


def test_fanout_single_egress(cfg, kube, cache_factory, fan_dataset, nodes):
    cache = cache_factory("fan", ds=fan_dataset, extra=_small_stager())
    ns, name = cache["namespace"], cache["name"]
    sent, pods = run_spread(cfg, kube, ns, name, fan_dataset)
    by_node = summaries(pods)
    report = write_report(cfg, "fanout-e2e.json", fan_dataset, sent, by_node)
    assert sum(s["peer_bytes"] for s in by_node.values()) > 0, report
    # The bucket's side: each object once, plus listings and headers.
    assert sent <= 1.1 * fan_dataset.bytes, report
    assert sum(s["bucket_bytes"] for s in by_node.values()) <= 1.1 * fan_dataset.bytes, report


def _served_bytes(kube, node: str) -> float:
    """What this node's agent has served to other nodes' stagers so far (its own metric)."""
    code, body = agent_call(kube, node, "GET", "/metrics")
    assert code == 200, (code, body[:200])
    text = body.decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dscache_node_peer_served_bytes_total")
    )


def _kill_agent_when_copying(kube, ns: str, job: str, killed: list[dict[str, Any]]) -> None:
    """Once every pod's stager runs and bytes flow between nodes, SIGKILL the agent that is
    serving them: a peer dying mid-transfer, not a receiver's agent that nobody asks."""

    def stagers_running() -> list[dict[str, Any]] | None:
        pods = kube.items("pods", namespace=ns, selector=f"job-name={job}")
        running = [
            p
            for p in pods
            for cs in (p.get("status") or {}).get("initContainerStatuses") or []
            if cs.get("name") == w.INIT_NAME and "running" in (cs.get("state") or {})
        ]
        return running if len(running) == 3 else None

    pods = wait_for("3 stagers running", stagers_running, timeout=120, describe=lambda: describe_pods(kube, ns))
    names = sorted(p["spec"]["nodeName"] for p in pods)
    before = {n: _served_bytes(kube, n) for n in names}

    def serving() -> tuple[str, float] | None:
        # The agent metrics count every cache: the growth since this Job started is its own.
        grown = {n: _served_bytes(kube, n) - before[n] for n in names}
        node = max(grown, key=lambda n: grown[n])
        return (node, grown[node]) if grown[node] > 0 else None

    node, served = wait_for("an agent serving its peers", serving, timeout=60, interval=0.2)
    p = node_sh("pkill -9 -f 'python3 /opt/dscache/[b]in/dscache-node' && echo killed", node=node)
    assert "killed" in p.stdout, p.stderr
    killed.append({"node": node, "served_before_kill": served})


def test_fanout_peer_dies(cfg, kube, cache_factory, fan_dataset, nodes):
    cache = cache_factory("fandie", ds=fan_dataset, extra=_small_stager())
    ns, name = cache["namespace"], cache["name"]
    killed: list[dict[str, Any]] = []
    sent, pods = run_spread(
        cfg, kube, ns, name, fan_dataset, lambda job: _kill_agent_when_copying(kube, ns, job, killed)
    )
    assert killed, "no agent was killed"
    by_node = summaries(pods)
    report = write_report(cfg, "fanout-e2e-peer-dies.json", fan_dataset, sent, by_node, killed=killed)
    # Every node exact (each pod verified every byte above). The dead node's own stager read
    # the bucket for its share; what it had not yet served came from the bucket once more, by
    # one surviving node each (the other takes it from that one): each object at most twice,
    # never once per node. The stagers' own count is exact; the S3 side adds listings and
    # HTTP/TCP headers (~2%, see test_fanout_single_egress).
    assert sum(s["bucket_bytes"] for s in by_node.values()) <= 2 * fan_dataset.bytes, report
    assert sent <= 2.1 * fan_dataset.bytes, report
