"""4. Two Jobs on one cache on one node at once: the data is copied once, both succeed.

"At once" is proved, not assumed: the kubelet's timestamps of both init
containers' log lines show the two stagers running at the same time (the
waiter started before the copier finished), and exactly one of them fetched.
Both stagers run under a 100m CPU limit (the cache's spec.resources) so the
copy lasts long enough for the second pod to arrive while it runs.
"""

import datetime
import json

from conftest import assert_complete, cache_status, host_copy, init_summary, job_pods, send_go, wait_verified
from support import revs
from support import workloads as w
from support.kube import node_path_exists, schedulable_nodes, wait_for

SLOW = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "100m", "memory": "1Gi"}}


def _log_span(kube, ns: str, pod: str) -> tuple[float, float]:
    """First and last line of the init container's log, as the kubelet timestamped them."""
    out = kube.kubectl("logs", pod, "-n", ns, "-c", w.INIT_NAME, "--timestamps").stdout
    stamps = [line.split(" ", 1)[0] for line in out.splitlines() if line.strip()]
    assert stamps, f"no log lines from {pod}'s stager"

    def ts(text: str) -> float:
        # RFC 3339 with nanoseconds: keep microseconds for fromisoformat.
        head, _, frac = text.rstrip("Z").partition(".")
        return datetime.datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()

    return ts(stamps[0]), ts(stamps[-1])


def test_two_jobs_copy_once(cfg, kube, cache_factory, dataset, namespaces):
    ns = namespaces["main"]
    name = "shared-slow"
    kube.apply(w.dataset_cache(name, ns, dataset, cfg.endpoint_pod, "s3-keys", resources=SLOW))
    wait_for(
        f"DatasetCache {ns}/{name} phase Ready",
        lambda: cache_status(kube, ns, name).get("phase") == "Ready",
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    # One annotated on the Job, the other only on its pod template. Both on one node: the
    # test is about two stagers sharing one copy; where the scheduler puts the second pod
    # while the first has not staged yet is placement's business (test_30), and it may pick
    # another node (it did once).
    node = schedulable_nodes(kube)[0]
    for job in (
        w.training_job("pair-a", ns, name, cfg.stager_image, dataset, wait=True),
        w.training_job("pair-b", ns, name, cfg.stager_image, dataset, wait=True, on_template=True),
    ):
        job["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
        kube.create(job)
    pods = {j: wait_verified(kube, ns, j) for j in ("pair-a", "pair-b")}
    nodes = {p["spec"]["nodeName"] for p in pods.values()}
    assert len(nodes) == 1, nodes
    node = nodes.pop()
    # Both Jobs were admitted with the same revision, and it exists on the node while
    # both run (so "wiped" below means something).
    (rev,) = {revs.pod_revision(p) for p in pods.values()}
    assert node_path_exists(revs.complete_marker(host_copy(cfg, ns, name), rev), node)

    spans = {j: _log_span(kube, ns, p["metadata"]["name"]) for j, p in pods.items()}
    starts, ends = [s for s, _ in spans.values()], [e for _, e in spans.values()]
    assert max(starts) < min(ends), (
        f"the two stagers did not run at the same time (first/last log line per Job: {spans}); "
        "this test then proves nothing about copying once at once"
    )

    for p in pods.values():
        send_go(kube, ns, p["metadata"]["name"])
    assert_complete(kube, ns, "pair-a")
    assert_complete(kube, ns, "pair-b")
    sums = [init_summary(job_pods(kube, ns, j)[0]) for j in ("pair-a", "pair-b")]
    fetched = sorted(s["fetched_bytes"] for s in sums)
    # Exactly one stager fetched the data; the other waited for it and reused it.
    assert fetched == [0, dataset.bytes], sums
    waiter = next(s for s in sums if s["fetched_bytes"] == 0)
    assert waiter["skipped"] == dataset.objects and waiter["objects"] == dataset.objects, sums
    revs.wait_revision_wiped(kube, ns, name, host_copy(cfg, ns, name), rev, node)
