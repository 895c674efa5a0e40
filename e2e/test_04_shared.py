"""4. Two Jobs on one cache on one node at once: the data is copied once, both succeed."""

from conftest import assert_complete, init_summary, job_pods, wait_wiped
from support import workloads as w


def test_two_jobs_copy_once(cfg, kube, cache_factory, dataset):
    cache = cache_factory("shared")
    ns, name = cache["namespace"], cache["name"]
    # One annotated on the Job, the other only on its pod template.
    kube.create(w.training_job("pair-a", ns, name, cfg.stager_image, dataset))
    kube.create(w.training_job("pair-b", ns, name, cfg.stager_image, dataset, on_template=True))
    assert_complete(kube, ns, "pair-a")
    assert_complete(kube, ns, "pair-b")
    sums = [init_summary(job_pods(kube, ns, j)[0]) for j in ("pair-a", "pair-b")]
    nodes = {job_pods(kube, ns, j)[0]["spec"]["nodeName"] for j in ("pair-a", "pair-b")}
    assert len(nodes) == 1, nodes
    fetched = sorted(s["fetched_bytes"] for s in sums)
    # Exactly one stager fetched the data; the other found the completed copy.
    assert fetched == [0, dataset.bytes], sums
    waiter = next(s for s in sums if s["fetched_bytes"] == 0)
    assert waiter["skipped"] == dataset.objects and waiter["objects"] == dataset.objects, sums
    wait_wiped(cfg, kube, ns, name)
