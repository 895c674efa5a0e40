"""13. The leading controller's pod is deleted mid-Job: the standby leads within 20 s, the
Job's copy is still wiped when it completes, and a cache created during the failover gets
its revision (issue 29: two replicas, Lease leader election).

The delete is an ordinary `kubectl delete pod` (what a drain or a rollout does): the
leader gets SIGTERM and releases the Lease first, before the rest of its shutdown
(operator __main__.operate), so the standby takes it on its next try (every 2 s); the
Deployment's replacement pod stands only once its views are listed, plus 2 s (a CI run saw
it win the race before that wait existed). The
webhook is its own Deployment: it admits Jobs all through the handover. A leader that dies without releasing (SIGKILL, a lost node) is the
integration test's case (tests/integration/test_operator_leader.py): ~15 s.
"""

import json
import time

from conftest import (
    RELEASE_NS,
    assert_complete,
    cache_status,
    controller_pods,
    host_copy,
    leader_pod,
    lease_holder,
    node_entry,
    send_go,
    wait_verified,
)
from support import revs
from support import workloads as w
from support.kube import node_path_exists, wait_for


def _ready(pod: dict) -> bool:
    return all(cs.get("ready") for cs in (pod.get("status") or {}).get("containerStatuses") or [{}])


def _two_ready(kube) -> list[dict] | None:
    pods = [p for p in controller_pods(kube) if _ready(p)]
    return pods if len(pods) == 2 else None


def _admitted(kube, cfg, ns: str, cache: str, dataset) -> bool:
    """A server-side dry run of a Job naming ``cache``: the webhook injected the stager."""
    job = w.training_job("failover-probe", ns, cache, cfg.stager_image, dataset)
    out = kube.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(job)).stdout
    inits = json.loads(out)["spec"]["template"]["spec"].get("initContainers") or []
    return any(c["name"] == w.INIT_NAME for c in inits)


def test_controller_failover(cfg, kube, cache_factory, dataset):
    cache = cache_factory("failover")
    ns, name = cache["namespace"], cache["name"]
    job = "train-failover"
    kube.create(w.training_job(job, ns, name, cfg.stager_image, dataset, wait=True))
    pod = wait_verified(kube, ns, job)
    node, rev = pod["spec"]["nodeName"], revs.pod_revision(pod)
    wait_for("node Ready in the status", lambda: node_entry(kube, ns, name).get("state") == "Ready", timeout=30)
    assert node_path_exists(revs.complete_marker(host_copy(cfg, ns, name), rev), node)

    # Two ready replicas: one leads, the other stands by with warm views.
    pods = wait_for("two ready controller replicas", lambda: _two_ready(kube), timeout=120)
    leader = leader_pod(kube)["metadata"]["name"]
    (standby,) = [p["metadata"]["name"] for p in pods if p["metadata"]["name"] != leader]

    t0 = time.monotonic()
    kube.kubectl("delete", "pod", leader, "-n", RELEASE_NS, "--wait=false")
    # The webhook keeps admitting while the leadership changes hands.
    assert _admitted(kube, cfg, ns, name, dataset), "a Job was not injected during the failover"
    # A cache created while the leadership changes hands.
    during = cache_factory("failover-new", ready=False)

    wait_for(
        f"the standby {standby} holds the Lease",
        lambda: lease_holder(kube) == standby,
        timeout=20,
        interval=0.25,
        describe=lambda: json.dumps(kube.get("lease", "dscache-controller", RELEASE_NS), indent=1),
    )
    took_over = time.monotonic() - t0
    assert _admitted(kube, cfg, ns, name, dataset), "a Job was not injected right after the failover"

    # The Job completes under the new leader: its copy is wiped.
    send_go(kube, ns, pod["metadata"]["name"])
    assert_complete(kube, ns, job)
    revs.wait_revision_wiped(kube, ns, name, host_copy(cfg, ns, name), rev, node, timeout=90)
    wiped = time.monotonic() - t0

    dns, dname = during["namespace"], during["name"]
    status = wait_for(
        "the cache created during the failover has a revision",
        lambda: (s := cache_status(kube, dns, dname)).get("revision", {}).get("id") and s,
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, dns, dname), indent=1),
    )
    assert status["phase"] == "Ready", status
    print(
        f"failover timeline: leader {leader} deleted at 0 s; {standby} leads at {took_over:.1f} s; "
        f"the Job's copy wiped at {wiped:.1f} s; {dname} pinned {status['revision']['id']} "
        f"by {time.monotonic() - t0:.1f} s"
    )

    # The Deployment replaces the deleted pod: two replicas again for the tests after this one.
    wait_for("two ready controller replicas again", lambda: _two_ready(kube), timeout=180)
    assert lease_holder(kube) == standby
