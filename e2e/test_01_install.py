"""1. helm install, a labelled namespace, a DatasetCache over a real bucket turns Ready."""

from conftest import RELEASE_NS, cache_status


def test_chart_installed(kube, release):
    deps = {d["metadata"]["name"]: d for d in kube.items("deployments", namespace=RELEASE_NS)}
    assert set(deps) >= {"dscache-controller", "dscache-webhook"}, sorted(deps)
    ctl, wh = deps["dscache-controller"], deps["dscache-webhook"]
    # Two replicas, one leading by Lease (test_13_failover.py), so RollingUpdate is safe.
    assert ctl["spec"]["replicas"] == 2 and ctl["spec"]["strategy"]["type"] == "RollingUpdate"
    assert wh["spec"]["replicas"] == 2
    for d in (ctl, wh):
        assert d["status"].get("readyReplicas") == d["spec"]["replicas"], d["status"]
    mwc = kube.get("mutatingwebhookconfiguration", "dscache")
    assert mwc is not None
    *injection, caches = mwc["webhooks"]
    # New DatasetCaches get the controller's finalizer; never refused (the controller adds it otherwise).
    assert caches["name"] == "datasetcaches.dscache.io" and caches["failurePolicy"] == "Ignore"
    assert caches["clientConfig"].get("caBundle")
    for hook in injection:
        assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
        assert hook["timeoutSeconds"] <= 10 and hook["reinvocationPolicy"] == "IfNeeded"
        assert hook["clientConfig"].get("caBundle"), hook["name"]
        exprs = {e["key"]: e for e in hook["namespaceSelector"]["matchExpressions"]}
        assert exprs["dscache.io/injection"]["values"] == ["enabled"]
    assert kube.get("crd", "datasetcaches.dscache.io") is not None


def test_cache_ready_with_objects_and_bytes(kube, cache_factory, dataset):
    cache = cache_factory("ready")
    ns, name = cache["namespace"], cache["name"]
    status = cache_status(kube, ns, name)
    assert status["objects"] == dataset.objects, status
    assert status["bytes"] == dataset.bytes, status
    cond = next(c for c in status["conditions"] if c["type"] == "SourceReady")
    assert cond["status"] == "True", cond
    # What a user sees: the printer columns.
    out = kube.kubectl("get", "dsc", name, "-n", ns).stdout
    header, row = out.strip().splitlines()[:2]
    assert header.split()[:3] == ["NAME", "PHASE", "OBJECTS"], out
    assert row.split()[1] == "Ready" and row.split()[2] == str(dataset.objects), out
    explain = kube.kubectl("explain", "datasetcache.spec.source").stdout
    assert "uri" in explain and "credentials" in explain
