"""2. An annotated Job: staged before the (non-root) training container, verified, then wiped."""

import json

from conftest import assert_complete, cache_status, host_copy, init_summary, node_entry, send_go, wait_verified
from support import revs
from support import workloads as w
from support.kube import node_path_exists, node_sh, wait_for


def test_annotated_job_gets_data_and_copy_is_wiped(cfg, kube, cache_factory, dataset):
    cache = cache_factory("job")
    ns, name = cache["namespace"], cache["name"]
    job = "train-basic"
    kube.create(w.training_job(job, ns, name, cfg.stager_image, dataset, wait=True))

    # The Job and its pod were mutated by the webhook.
    jobobj = kube.get("job", job, ns)
    tpl = jobobj["spec"]["template"]["spec"]
    assert [c["name"] for c in tpl["initContainers"]] == [w.INIT_NAME]
    vol = next(v for v in tpl["volumes"] if v["name"] == "dscache-data")
    # The revision is pinned on the pod template: every pod the Job creates stages it.
    rev = tpl_rev = jobobj["spec"]["template"]["metadata"]["annotations"][revs.REVISION_ANNOTATION]
    # The node's copy as the node agent's CSI volume (the chart's default volume.type).
    assert vol["csi"]["driver"] == "cache.dscache.io", vol
    assert vol["csi"]["volumeAttributes"] == {"cache": name, "revision": rev}, vol
    assert rev == cache_status(kube, ns, name)["revision"]["id"], cache_status(kube, ns, name)
    train = tpl["containers"][0]
    mounts = [m for m in train["volumeMounts"] if m["name"] == "dscache-data"]
    # Read-only views of the revision: its data at mountPath, its metadata beside, never inside.
    assert sorted(mounts, key=lambda m: m["mountPath"]) == [
        {"name": "dscache-data", "mountPath": "/data", "readOnly": True, "subPath": f"revs/{rev}/data"},
        {"name": "dscache-data", "mountPath": revs.META_MOUNT_PATH, "readOnly": True, "subPath": f"revs/{rev}/meta"},
    ], mounts
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env["DSCACHE_DIR"] == "/data" and env["DSCACHE_MANIFEST"] == f"{revs.META_MOUNT_PATH}/manifest.jsonl", env

    pod = wait_verified(kube, ns, job)
    pod_name = pod["metadata"]["name"]
    log = kube.logs(pod_name, ns, w.TRAIN_CONTAINER)
    assert f"VERIFIED objects={dataset.objects} bytes={dataset.bytes} uid={w.TRAIN_UID}" in log, log

    # While the pod runs: the revision is on the node's disk under cacheRoot, complete,
    # and the pod holds a lease on it (its volume's NodePublishVolume took it).
    path = host_copy(cfg, ns, name)
    node = pod["spec"]["nodeName"]
    assert revs.pod_revision(pod) == tpl_rev
    assert node_path_exists(revs.complete_marker(path, rev), node), path
    assert node_path_exists(revs.lease(path, rev, pod["metadata"]["uid"]), node)
    count = node_sh(f"wc -l < {revs.manifest(path, rev)}", node=node).stdout.strip()
    assert count == str(dataset.objects)

    summary = init_summary(kube.get("pod", pod_name, ns))
    assert summary["objects"] == dataset.objects and summary["bytes"] == dataset.bytes, summary
    assert summary["fetched_bytes"] == dataset.bytes, summary
    assert (summary["revision"], summary["warm"]) == (rev, False), summary

    # The DatasetCache shows that node's bytes and seconds.
    entry = wait_for(
        "node state Ready in the DatasetCache status",
        lambda: (e := node_entry(kube, ns, name)).get("state") == "Ready" and e,
        timeout=30,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    assert entry["node"] == pod["spec"]["nodeName"]
    assert entry["bytes"] == dataset.bytes and entry["objects"] == dataset.objects, entry
    assert entry["seconds"] > 0 and abs(entry["seconds"] - summary["seconds"]) < 0.01, (entry, summary)
    assert entry["volume"] == "CSI" and entry["consumers"] == 1, entry

    send_go(kube, ns, pod_name)
    assert_complete(kube, ns, job)

    # Job complete: the node's copy of the revision (and its lease) is wiped from the
    # host filesystem; the cache dir, the mount source of later pods, stays.
    revs.wait_revision_wiped(kube, ns, name, path, rev, node)
    entry = wait_for(
        "node state Wiped in the status",
        lambda: (e := node_entry(kube, ns, name)).get("state") == "Wiped" and e,
        timeout=30,
    )
    assert entry["bytes"] == dataset.bytes and entry["seconds"] > 0 and entry.get("wipedAt"), entry
    assert entry["consumers"] == 0
