"""11. A tenant with the built-in `edit` role uses dscache (the chart's aggregated ClusterRoles).

A ServiceAccount bound only to Kubernetes' own `edit` ClusterRole, in one namespace, creates a
DatasetCache and a Job there (kubectl --as, impersonation); the cache becomes Ready, the Job
is staged and completes, and the tenant deletes the cache. Before the binding it may do none
of that, and it never may write a cache's status or act in another namespace.
"""

from __future__ import annotations

import json

from conftest import assert_complete, cache_status, init_summary, job_pods
from support import workloads as w
from support.kube import wait_for

TENANT = "tenant"


def can_i(kube, user: str, verb: str, resource: str, ns: str, subresource: str = "") -> bool:
    extra = [f"--subresource={subresource}"] if subresource else []
    p = kube.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", user, *extra, check=False)
    # "yes", or "no" with an optional " - <reason>"; anything else is an error, not a "no".
    answer = p.stdout.strip().split(" - ")[0]
    assert answer in ("yes", "no"), f"kubectl auth can-i: {p.stdout}{p.stderr}"
    return answer == "yes"


def test_edit_role_can_use_dscache(cfg, kube, release, namespaces, dataset):
    ns, other = namespaces["main"], namespaces["baseline"]
    user = f"system:serviceaccount:{ns}:{TENANT}"
    kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": TENANT, "namespace": ns}})
    # Nothing yet: the ServiceAccount alone may not create DatasetCaches.
    assert not can_i(kube, user, "create", "datasetcaches.dscache.io", ns)
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": f"{TENANT}-edit", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": TENANT, "namespace": ns}],
    }
    kube.apply(binding)
    # The built-in role picks up the chart's rules through aggregation (the controller-manager's
    # clusterrole-aggregation controller), and the authorizer sees the binding a moment later.
    wait_for(
        "edit to grant DatasetCaches",
        lambda: can_i(kube, user, "create", "datasetcaches.dscache.io", ns),
        timeout=60,
        describe=lambda: kube.kubectl("get", "clusterrole", "edit", "-o", "yaml", check=False).stdout[-3000:],
    )
    for verb in ("get", "list", "watch", "update", "patch", "delete"):
        assert can_i(kube, user, verb, "datasetcaches.dscache.io", ns), verb
    assert not can_i(kube, user, "patch", "datasetcaches.dscache.io", ns, subresource="status")
    assert not can_i(kube, user, "create", "datasetcaches.dscache.io", other)

    name = f"tenant-{cfg.run_id}"
    as_tenant = ["--as", user]
    cache = w.dataset_cache(name, ns, dataset, cfg.endpoint_pod, "s3-keys")
    kube.kubectl("create", "-f", "-", *as_tenant, input=json.dumps(cache))

    def ready() -> bool:
        got = kube.kubectl("get", "datasetcache", name, "-n", ns, "-o", "json", *as_tenant)  # read as the tenant
        return (json.loads(got.stdout).get("status") or {}).get("phase") == "Ready"

    wait_for(
        f"DatasetCache {ns}/{name} Ready",
        ready,
        timeout=90,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    job = w.training_job(f"{TENANT}-train", ns, name, cfg.stager_image, dataset)
    kube.kubectl("create", "-f", "-", *as_tenant, input=json.dumps(job))
    assert_complete(kube, ns, job["metadata"]["name"])
    (pod,) = job_pods(kube, ns, job["metadata"]["name"])
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [w.INIT_NAME]
    summary = init_summary(pod)
    assert summary["objects"] == dataset.objects, summary

    # The tenant deletes its cache; the controller wipes and releases it.
    kube.kubectl("delete", "datasetcache", name, "-n", ns, "--wait=false", *as_tenant)
    wait_for(
        f"DatasetCache {ns}/{name} gone",
        lambda: kube.get("datasetcache", name, ns) is None,
        timeout=120,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    kube.kubectl("delete", "rolebinding", f"{TENANT}-edit", "-n", ns, "--ignore-not-found")
