"""3. Admission: a Job naming an unknown cache is refused with the message; others pass untouched."""

from support import workloads as w


def test_unknown_cache_is_refused(cfg, kube, release, namespaces):
    ns = namespaces["main"]
    job = w.training_job("train-unknown", ns, "no-such-cache", cfg.stager_image, None)
    p = kube.create(job, check=False)
    assert p.returncode != 0, p.stdout
    assert "denied the request" in p.stderr, p.stderr
    assert f"DatasetCache {ns}/no-such-cache does not exist" in p.stderr, p.stderr
    assert kube.get("job", "train-unknown", ns) is None


def test_unknown_cache_on_pod_template_is_refused(cfg, kube, release, namespaces):
    ns = namespaces["main"]
    job = w.training_job("train-unknown-tpl", ns, "missing-too", cfg.stager_image, None, on_template=True)
    p = kube.create(job, check=False)
    assert p.returncode != 0 and f"DatasetCache {ns}/missing-too does not exist" in p.stderr, p.stderr


def test_job_without_annotation_is_not_touched(cfg, kube, release, namespaces):
    ns = namespaces["main"]
    kube.create(w.training_job("plain", ns, None, cfg.stager_image, None))
    spec = kube.get("job", "plain", ns)["spec"]["template"]["spec"]
    assert not spec.get("initContainers") and not spec.get("volumes"), spec
    kube.delete("job", "plain", ns, extra=["--cascade=background"])
