"""Operator configuration from the environment, and the source-check helpers."""

from __future__ import annotations

import base64

import pytest

from dscache_operator.control import sourcecheck
from dscache_operator.settings import Settings


def test_defaults():
    s = Settings.from_env({})
    assert s.cache_root == "/var/lib/dscache"
    assert s.watch_namespaces == ()


def test_from_env():
    s = Settings.from_env(
        {
            "DSCACHE_CACHE_ROOT": "/mnt/nvme/dscache/",
            "DSCACHE_STAGER_IMAGE": "reg/stager:1",
            "DSCACHE_NAMESPACE": "ops",
            "DSCACHE_WATCH_NAMESPACES": "ml, research,,",
            "DSCACHE_WEBHOOK_PORT": "8443",
            "DSCACHE_WEBHOOK_CERT": "/tls/tls.crt",
            "DSCACHE_RECONCILE_INTERVAL": "2.5",
            "DSCACHE_STAGER_CONCURRENCY": "64",
        }
    )
    assert s.cache_root == "/mnt/nvme/dscache"
    assert s.cache_dir("ml", "imagenet") == "/mnt/nvme/dscache/ml/imagenet"
    assert s.stager_image == "reg/stager:1" and s.namespace == "ops"
    assert s.watch_namespaces == ("ml", "research")
    assert s.webhook_port == 8443 and s.webhook_cert == "/tls/tls.crt" and s.webhook_key is None
    assert s.reconcile_interval == 2.5 and s.stager_concurrency == 64


def test_leader_election_settings():
    import socket

    d = Settings.from_env({})
    assert d.leader_election and d.lease_name == "dscache-controller" and d.pod_name == socket.gethostname()
    assert d.image_pull_secrets == ()
    s = Settings.from_env(
        {"DSCACHE_LEADER_ELECTION": "false", "DSCACHE_LEASE_NAME": "x-ctl", "DSCACHE_POD_NAME": "x-ctl-abc"}
    )
    assert not s.leader_election and s.lease_name == "x-ctl" and s.pod_name == "x-ctl-abc"


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
        {"data": {"AWS_ACCESS_KEY_ID": _b64("k"), "AWS_SECRET_ACCESS_KEY": _b64("s")}}, "ml", "s3"
    )
    assert ok == {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}


@pytest.mark.parametrize("root", ["/", "/var", "/var/lib/", "/etc", "relative/dir"])
def test_cache_root_refuses_system_and_relative_dirs(root: str):

    with pytest.raises(ValueError, match="DSCACHE_CACHE_ROOT"):
        Settings.from_env({"DSCACHE_CACHE_ROOT": root})


def test_cache_root_is_normalised():

    assert Settings.from_env({"DSCACHE_CACHE_ROOT": "/mnt/nvme/dscache/"}).cache_root == "/mnt/nvme/dscache"


# --- revision refresh triggers (issue 7) ---------------------------------------------------

import datetime as _dt  # noqa: E402

_NOW = _dt.datetime(2026, 11, 21, 12, 0, 0, tzinfo=_dt.UTC)


def _due(meta, status, interval="1h"):
    refresh = (meta.get("annotations") or {}).get("dscache.io/refresh")
    return sourcecheck.source_due(meta.get("generation"), refresh, status, 0.0, 60.0, interval, _NOW)


def test_revision_refresh_triggers():
    listed = {
        "observedGeneration": 2,
        "phase": "Ready",
        "revision": {"id": "r-0123456789abcdef0123", "listedAt": "2026-11-21T11:30:00Z"},
    }
    meta = {"generation": 2}
    assert _due(meta, listed) is None  # fresh: nothing to do
    assert _due({"generation": 3}, listed) == "spec"  # spec changed
    assert _due(meta, listed, interval="20m") == "interval"  # older than spec.refresh.interval
    assert _due(meta, listed, interval="Never") is None  # immutable prefix
    poked = {**meta, "annotations": {"dscache.io/refresh": "2026-11-21T12:00"}}
    assert _due(poked, listed) == "annotation"  # on demand
    assert _due(poked, {**listed, "observedRefresh": "2026-11-21T12:00"}) is None  # already acted on


def test_source_listing_pins_the_contract_revision(monkeypatch):
    """The operator's digest is the contract's, over exactly the selected objects."""
    from dscache_contract import RevisionHasher, RevisionRef
    from dscache_operator.api.models import Source

    pages = [
        {"Contents": [{"Key": "p/a.bin", "Size": 3, "ETag": '"e1"'}, {"Key": "p/skip.tmp", "Size": 9, "ETag": '"e2"'}]},
        {"Contents": [{"Key": "p/sub/b.bin", "Size": 4, "ETag": '"e3"'}]},
    ]

    class Client:
        def get_bucket_versioning(self, Bucket):
            return {}  # never versioned: ListObjectsV2 and ETags alone

        def get_paginator(self, name):
            assert name == "list_objects_v2"
            return self

        def paginate(self, Bucket, Prefix):
            assert (Bucket, Prefix) == ("bkt", "p/")
            return iter(pages)

    monkeypatch.setattr(sourcecheck, "_client", lambda *a: Client())
    got = sourcecheck._list_sync(Source(uri="s3://bkt/p", exclude=["*.tmp"]), None, 5)
    h = RevisionHasher()
    h.add("p/a.bin", 3, '"e1"')
    h.add("p/sub/b.bin", 4, '"e3"')
    # Unversioned: the revision carries no as-of time.
    assert (got.ok, got.objects, got.bytes, got.revision) == (True, 2, 7, RevisionRef(h.revision_id()))


def test_logging_and_pull_secret_settings():
    s = Settings.from_env({"DSCACHE_LOG_LEVEL": "debug", "DSCACHE_LOG_FORMAT": "JSON"})
    assert (s.log_level, s.log_format) == ("DEBUG", "json")
    assert (Settings.from_env({}).log_level, Settings.from_env({}).log_format) == ("INFO", "text")
    with pytest.raises(ValueError, match="DSCACHE_LOG_FORMAT"):
        Settings.from_env({"DSCACHE_LOG_FORMAT": "xml"})
