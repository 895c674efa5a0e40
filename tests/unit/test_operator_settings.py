"""Operator configuration from the environment, and the source-check helpers."""

from __future__ import annotations

import base64

import pytest

from dscache_operator import sourcecheck
from dscache_operator.settings import Settings


def test_defaults():
    s = Settings.from_env({})
    assert s.cache_root == "/var/lib/dscache"
    assert s.watch_namespaces == ()
    assert s.wipe_tolerations == ({"operator": "Exists"},)


def test_from_env():
    s = Settings.from_env({
        "DSCACHE_CACHE_ROOT": "/mnt/nvme/dscache/", "DSCACHE_STAGER_IMAGE": "reg/stager:1",
        "DSCACHE_NAMESPACE": "ops", "DSCACHE_WATCH_NAMESPACES": "ml, research,,",
        "DSCACHE_WEBHOOK_PORT": "8443", "DSCACHE_WEBHOOK_CERT": "/tls/tls.crt",
        "DSCACHE_WIPE_TOLERATIONS": '[{"key": "gpu", "operator": "Exists"}]',
        "DSCACHE_RECONCILE_INTERVAL": "2.5", "DSCACHE_STAGER_CONCURRENCY": "64",
    })
    assert s.cache_root == "/mnt/nvme/dscache"
    assert s.cache_dir("ml", "imagenet") == "/mnt/nvme/dscache/ml/imagenet"
    assert s.stager_image == "reg/stager:1" and s.namespace == "ops"
    assert s.watch_namespaces == ("ml", "research")
    assert s.webhook_port == 8443 and s.webhook_cert == "/tls/tls.crt" and s.webhook_key is None
    assert s.wipe_tolerations == ({"key": "gpu", "operator": "Exists"},)
    assert s.reconcile_interval == 2.5 and s.stager_concurrency == 64


def test_include_exclude_match_the_stager_rule():
    assert sourcecheck.selected("a/b.tar", ["*.tar"], [])
    assert not sourcecheck.selected("a/b.txt", ["*.tar"], [])
    assert not sourcecheck.selected("tmp/x.tar", ["*.tar"], ["tmp/*"])
    assert sourcecheck.selected("anything", [], [])


def _b64(s):
    return base64.b64encode(s.encode()).decode()


def test_secret_problems_are_precise():
    missing = sourcecheck.credentials_from_secret(None, "ml", "s3")
    assert missing.reason == "SecretNotFound" and "ml/s3" in missing.message
    partial = sourcecheck.credentials_from_secret({"data": {"AWS_ACCESS_KEY_ID": _b64("k")}}, "ml", "s3")
    assert partial.reason == "SecretKeyMissing" and "AWS_SECRET_ACCESS_KEY" in partial.message
    ok = sourcecheck.credentials_from_secret(
        {"data": {"AWS_ACCESS_KEY_ID": _b64("k"), "AWS_SECRET_ACCESS_KEY": _b64("s")}}, "ml", "s3")
    assert ok == {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}


@pytest.mark.parametrize("root", ["/", "/var", "/var/lib/", "/etc", "relative/dir"])
def test_cache_root_refuses_system_and_relative_dirs(root: str):

    with pytest.raises(ValueError, match="DSCACHE_CACHE_ROOT"):
        Settings.from_env({"DSCACHE_CACHE_ROOT": root})


def test_cache_root_is_normalised():

    assert Settings.from_env({"DSCACHE_CACHE_ROOT": "/mnt/nvme/dscache/"}).cache_root == "/mnt/nvme/dscache"
