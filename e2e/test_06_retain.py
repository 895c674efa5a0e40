"""7. RetainWhileUsed keeps the node's copy for the next Job, which skips the copy."""

import json
import time

from conftest import assert_complete, cache_status, host_copy, init_summary, job_pods, node_entry, wait_wiped
from support import revs
from support import workloads as w
from support.kube import node_path_exists, wait_for


def test_retained_copy_is_reused(cfg, kube, cache_factory, dataset):
    cache = cache_factory("retain", retention={"policy": "RetainWhileUsed", "ttlAfterLastUse": "1h"})
    ns, name = cache["namespace"], cache["name"]
    path = host_copy(cfg, ns, name)

    kube.create(w.training_job("retain-1", ns, name, cfg.stager_image, dataset))
    assert_complete(kube, ns, "retain-1")
    pod1 = job_pods(kube, ns, "retain-1")[0]
    node = pod1["spec"]["nodeName"]
    first = init_summary(pod1)
    rev = revs.pod_revision(pod1)
    assert first["fetched_bytes"] == dataset.bytes and (first["revision"], first["warm"]) == (rev, False), first
    # No consumer left: the controller has seen that (consumers 0) and still keeps the copy.
    wait_for(
        "consumers 0 in the status",
        lambda: node_entry(kube, ns, name).get("consumers") == 0 and node_entry(kube, ns, name).get("state") == "Ready",
        timeout=30,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    time.sleep(5)  # more than two reconcile intervals (2 s in the e2e install)
    assert node_path_exists(revs.complete_marker(path, rev), node), "RetainWhileUsed copy was wiped"
    assert node_entry(kube, ns, name)["state"] == "Ready"

    kube.create(w.training_job("retain-2", ns, name, cfg.stager_image, dataset))
    assert_complete(kube, ns, "retain-2")
    pod2 = job_pods(kube, ns, "retain-2")[0]
    second = init_summary(pod2)
    # The same revision (the bucket did not change), already complete: warm, nothing listed or fetched.
    assert revs.pod_revision(pod2) == rev and pod2["spec"]["nodeName"] == node
    assert (second["revision"], second["warm"], second["fetched_bytes"]) == (rev, True, 0), second
    assert node_path_exists(revs.complete_marker(path, rev), node)

    # Deleting the DatasetCache removes the whole cache dir (no lease is left) and then lets it go.
    kube.kubectl("delete", "jobs", "retain-1", "retain-2", "-n", ns, "--cascade=foreground", "--wait=true", timeout=120)
    kube.delete("datasetcache", name, ns)
    wait_wiped(cfg, kube, ns, name, node=node)
    wait_for("the DatasetCache to be deleted", lambda: kube.get("datasetcache", name, ns) is None, timeout=60)
