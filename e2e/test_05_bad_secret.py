"""5. A bad Secret shows up as a condition before any Job runs, and Jobs naming it are refused."""

import json

from conftest import cache_status
from support import workloads as w
from support.kube import wait_for


def _failed(kube, ns, name):
    st = cache_status(kube, ns, name)
    cond = next((c for c in st.get("conditions") or [] if c["type"] == "SourceReady"), None)
    return st if st.get("phase") == "Failed" and cond and cond["status"] == "False" else None


def test_wrong_keys_show_access_denied(cfg, kube, cache_factory, namespaces):
    ns = namespaces["main"]
    kube.apply(w.s3_secret("wrong-keys", ns, cfg.s3["AWS_ACCESS_KEY_ID"], "not-the-secret"))
    cache = cache_factory("badsecret", secret="wrong-keys", ready=False)
    name = cache["name"]
    st = wait_for(
        "phase Failed with SourceReady=False",
        lambda: _failed(kube, ns, name),
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    cond = next(c for c in st["conditions"] if c["type"] == "SourceReady")
    assert cond["reason"] == "AccessDenied", cond
    assert "access denied" in cond["message"], cond
    # kubectl describe shows it too (condition and Event).
    described = kube.kubectl("describe", "dsc", name, "-n", ns).stdout
    assert "AccessDenied" in described, described
    # A Job naming the broken cache is refused at admission, saying why.
    p = kube.create(w.training_job("train-badsecret", ns, name, cfg.stager_image, None), check=False)
    assert p.returncode != 0, p.stdout
    assert f"DatasetCache {ns}/{name} is broken: AccessDenied" in p.stderr, p.stderr


def test_missing_secret_shows_secret_not_found(cfg, kube, cache_factory, namespaces):
    ns = namespaces["main"]
    cache = cache_factory("nosecret", secret="does-not-exist", ready=False)
    name = cache["name"]
    st = wait_for(
        "phase Failed",
        lambda: _failed(kube, ns, name),
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    cond = next(c for c in st["conditions"] if c["type"] == "SourceReady")
    assert cond["reason"] == "SecretNotFound" and "does-not-exist" in cond["message"], cond
