"""The seam between operator and stager: argv round trips, the digest's canonical form, selection."""

from __future__ import annotations

import hashlib
import json

import pytest

import dscache_contract as c
from dscache_contract.args import ArgsError

REV = "r-0123456789abcdef0123"


@pytest.mark.parametrize(
    "args",
    [
        c.StageArgs(source="s3://b/p", revision=REV),
        c.StageArgs(
            source="s3://b",
            revision=REV,
            cache_dir="/x/y",
            as_of="2026-11-23T02:33:10Z",
            pod_uid=c.POD_UID_ARG,
            endpoint_url="http://minio:9000",
            region="eu-west-1",
            addressing_style="virtual",
            include=("train/*", "-odd", "a b"),
            exclude=("*.tmp", "--x"),
            concurrency=8,
            termination_log="/dev/termination-log",
            progress_interval=0.5,
            retry_timeout=2.5,
        ),
        c.StageArgs(source="s3://b/p/", revision=REV, pod_uid="6f1c4c2e-8b1a-4c1e-9d7e-0e5a3c1b2a9f"),
    ],
)
def test_stage_args_round_trip(args: c.StageArgs):
    argv = args.to_argv()
    assert argv[0] == "sync"
    assert c.StageArgs.from_argv(argv) == args


@pytest.mark.parametrize(
    "args",
    [
        c.WipeArgs("/root/ns/ds", "/root", revision=REV),
        c.WipeArgs("/root/ns/ds", "/root", revision=REV, release=("u1", "u-2"), termination_log="/t"),
        c.WipeArgs("/root/ns/ds", "/root", all_revisions=True, release=("u1",)),
        c.WipeArgs("/root/ns/ds", "/root", legacy=True, termination_log="/t"),
    ],
)
def test_wipe_args_round_trip(args: c.WipeArgs):
    assert c.WipeArgs.from_argv(args.to_argv()) == args


def test_release_may_be_repeated_or_comma_separated():
    w = c.WipeArgs.from_argv(
        ["wipe", "/r/n/c", "--root", "/r", "--revision", REV, "--release", "a,b", "--release", "c"]
    )
    assert w.release == ("a", "b", "c")


@pytest.mark.parametrize(
    "argv, why",
    [
        (["sync", "s3://b/p", "/c"], "--revision"),
        (["sync", "s3://b/p", "/c", "--revision", "latest"], "not a dscache revision id"),
        (["sync", "bucket/p", "/c", "--revision", REV], "s3://BUCKET"),
        (["sync", "s3://b/p", "/c", "--revision", REV, "--pod-uid", "../etc"], "plain token"),
        (["sync", "s3://b/p", "/c", "--revision", REV, "--concurrency", "0"], "at least 1"),
        (["sync", "s3://b/p", "/c", "--revision", REV, "--as-of", "2026-11-23"], "as-of must be a UTC time"),
        (["sync", "s3://b/p", "/c", "--revision", REV, "--cohort"], "--cohort needs --peer-token-file"),
        (["wipe", "/r/n/c", "--root", "/r"], "one of the arguments --revision --all --legacy is required"),
        (["wipe", "/r/n/c", "--root", "/r", "--revision", REV, "--all"], "not allowed with"),
        (["wipe", "/r/n/c", "--root", "/r", "--legacy", "--all"], "not allowed with"),
        (["wipe", "/r/n/c", "--root", "/r", "--legacy", "--release", "u1"], "takes no --release"),
        (["wipe", "/r/n/c", "--root", "/r", "--all", "--release", "a/b"], "plain token"),
    ],
)
def test_bad_argv_says_what_is_wrong(argv: list[str], why: str):
    cls = c.StageArgs if argv[0] == "sync" else c.WipeArgs
    with pytest.raises(ArgsError, match=why.replace("(", r"\(")):
        cls.from_argv(argv)


def test_digest_canonical_encoding_is_as_documented():
    h = c.RevisionHasher()
    h.add("p/a.bin", 3, '"abc"')
    h.add("p/dir/", 0, "d41d8cd98f00b204e9800998ecf8427e")
    h.add("p/v", 10, 'W/"e1"', "v1")
    want = hashlib.sha256(
        b"dscache-revision-v1\n"
        b"7:p/a.bin,1:3,3:abc,-"
        b"5:p/dir,1:0,32:d41d8cd98f00b204e9800998ecf8427e,-"
        b"3:p/v,2:10,2:e1,2:v1,"
    ).hexdigest()
    assert h.hexdigest() == want
    assert h.revision_id() == "r-" + want[:20]
    assert (h.objects, h.bytes) == (3, 13)
    c.validate_revision(h.revision_id())


def test_digest_depends_on_every_field_and_on_order():
    def rev(*objs) -> str:
        h = c.RevisionHasher()
        for o in objs:
            h.add(*o)
        return h.revision_id()

    base = rev(("a", 1, "e"), ("b", 2, "f"))
    variants = [
        rev(("b", 2, "f"), ("a", 1, "e")),
        rev(("a", 1, "e"), ("b", 3, "f")),
        rev(("a", 1, "e"), ("b", 2, "g")),
        rev(("a", 1, "e"), ("b", 2, "f", "v")),
        rev(("a", 1, "e")),
        rev(("a", 1, "e"), ("b", 2, "f"), ("c", 0, "")),
        rev(("a", 1, "e,1:2"), ("b", 2, "f")),  # netstrings: no field can spill into the next
    ]
    assert len({base, *variants}) == len(variants) + 1
    # Quotes and the directory marker's trailing '/' are not part of the identity.
    assert rev(("a", 1, '"e"'), ("b/", 2, "f")) == rev(("a", 1, "e"), ("b", 2, "f"))
    assert rev() == "r-" + hashlib.sha256(b"dscache-revision-v1\n").hexdigest()[:20]


def test_selection_include_exclude_and_prefix():
    s = c.Selection.from_source("s3://b/data", include=["train/*", "*.json"], exclude=["*.tmp"])
    assert s.prefix == "data/"
    assert s.relative("data/train/a/b.rec") == "train/a/b.rec"  # '*' crosses '/'
    assert s.relative("data/meta.json") == "meta.json"
    assert s.relative("data/train/x.tmp") is None  # exclude wins
    assert s.relative("data/val/a.rec") is None  # no include matched
    assert s.relative("data/") is None  # the prefix's own marker
    assert s.relative("data2/train/a") is None  # outside the prefix
    assert s.relative("data/train/dir/") == "train/dir"  # marker as the stager's lister shows it
    assert c.Selection().relative("x") == "x"
    assert not c.selected("x", [], ["*"])


@pytest.mark.parametrize(
    "uri, bucket, prefix",
    [
        ("s3://b", "b", ""),
        ("s3://b/", "b", ""),
        ("s3://b/a/b", "b", "a/b/"),
        ("s3://b//a//", "b", "a/"),
    ],
)
def test_parse_source(uri: str, bucket: str, prefix: str):
    assert c.parse_source(uri) == (bucket, prefix)


def test_layout_paths_and_subpaths():
    C = c.cache_dir("/mnt/nvme/dscache", "ml", "imagenet")
    assert C == "/mnt/nvme/dscache/ml/imagenet"
    assert c.lock_path(C) == C + "/lock"
    assert c.data_dir(C, REV) == f"{C}/revs/{REV}/data"
    assert c.manifest_path(C, REV) == f"{C}/revs/{REV}/meta/manifest.jsonl"
    assert c.complete_path(C, REV) == f"{C}/revs/{REV}/meta/complete"
    assert c.tmp_dir(C, REV) == f"{C}/revs/{REV}/tmp"
    assert c.lease_path(C, REV, "uid-1") == f"{C}/leases/{REV}/uid-1"
    assert c.data_subpath(REV) == f"revs/{REV}/data" and c.meta_subpath(REV) == f"revs/{REV}/meta"
    assert c.manifest_env_value() == "/var/run/dscache/manifest.jsonl"
    for bad in ("../x", "r-XYZ", "r-0123456789abcdef012", ""):
        with pytest.raises(ValueError):
            c.revision_dir(C, bad)
    with pytest.raises(ValueError):
        c.cache_dir("/root", "..", "x")


def test_s3_defaults():
    assert c.resolve_region(None) == "us-east-1" and c.resolve_region("eu-west-1") == "eu-west-1"
    assert c.resolve_addressing_style("http://minio:9000", None) == "path"
    assert c.resolve_addressing_style(None, None) == "virtual"
    assert c.resolve_addressing_style("https://oss-cn-hangzhou.aliyuncs.com", "virtual") == "virtual"


def test_summary_and_manifest_entry_json():
    s = c.StageSummary(objects=2, bytes=10, fetched_bytes=10, seconds=2.0, revision=REV)
    d = s.to_dict()
    assert d["mb_s"] == 0.0 and d["revision"] == REV and d["warm"] is False
    assert {"objects", "bytes", "skipped", "fetched_bytes", "deleted", "seconds", "mb_s"} <= set(d)
    assert c.StageSummary.from_message(json.dumps({**d, "future": 1})) == s  # as the completion marker holds it
    e = c.ManifestEntry("p/a", "a", 1, "e")
    assert c.ManifestEntry.from_json(e.to_json()) == e and "versionId" not in e.to_json()
    assert int(c.ExitCode.REVISION_GONE) == 9 and set(c.EXIT_CODE_HELP) == set(c.ExitCode)


def test_wipe_summary_round_trip_reports_plain_uids_and_strays_apart():
    w = c.WipeSummary(cache="/r/n/c", leases=["u1", "u2"], stray=["leases/junk", f"leases/{REV}/a b"], existed=True)
    d = json.loads(w.to_json())
    assert d["leases"] == ["u1", "u2"] and d["stray"] == ["leases/junk", f"leases/{REV}/a b"]
    assert c.WipeSummary.from_dict({**d, "future": 1}) == w
    # A summary from before these fields still parses (an older helper image mid-upgrade).
    old = c.WipeSummary.from_dict({"cache": "/r/n/c", "removed": True, "existed": True, "leases": []})
    assert (old.stray, old.legacy, old.legacy_entries) == ([], False, 0)
    assert c.WipeArgs("/r/n/c", "/r", legacy=True).to_argv() == ["wipe", "/r/n/c", "--root", "/r", "--legacy"]
    assert {"lock", "revs", "leases"} == c.TOP_NAMES


def test_a_wipe_summary_with_many_leases_stays_valid_json_within_the_termination_message():
    """The kubelet keeps 4096 bytes: a cut line would be no JSON, read as no summary."""
    uids = [f"{i:08d}-8b1a-4c1e-9d7e-0e5a3c1b2a9f" for i in range(400)]
    w = c.WipeSummary(cache="/r/n/c", revision=REV, existed=True, leases=uids, stray=["leases/junk"])
    text = w.to_json()
    assert len(text.encode()) <= c.summary.WIPE_JSON_MAX
    d = json.loads(text)
    assert d["truncated"] is True and d["stray"] == ["leases/junk"]
    assert 50 < len(d["leases"]) < 400 and d["leases"] == uids[: len(d["leases"])]
    small = c.WipeSummary(cache="/r/n/c", leases=uids[:3])
    assert json.loads(small.to_json())["truncated"] is False and json.loads(small.to_json())["leases"] == uids[:3]
