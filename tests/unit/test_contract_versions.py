"""dscache_contract.versions: which version of each key a revision means, and when a listing may be pinned."""

from __future__ import annotations

import datetime

import pytest

from dscache_contract import (
    ANNOTATION_AS_OF,
    ANNOTATION_REVISION,
    Pin,
    RevisionHasher,
    RevisionRef,
    Selection,
    VersionPicker,
    format_as_of,
    page_versions,
    parse_as_of,
    pin,
)

T0 = 1_790_000_000  # epoch seconds


def when(t: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t, datetime.UTC)


def v(key, vid, t, size=1, etag='"e"', latest=False):
    return {"Key": key, "VersionId": vid, "LastModified": when(t), "Size": size, "ETag": etag, "IsLatest": latest}


def marker(key, vid, t, latest=False):
    return {"Key": key, "VersionId": vid, "LastModified": when(t), "IsLatest": latest}


def test_as_of_round_trips_and_rejects_other_forms():
    assert parse_as_of(format_as_of(T0)) == T0
    assert format_as_of(0) == "1970-01-01T00:00:00Z"
    for bad in ("2026-01-01", "2026-01-01T00:00:00+01:00", "", "yesterday"):
        with pytest.raises(ValueError, match="as-of must be"):
            parse_as_of(bad)


def test_page_versions_merges_delete_markers_back_in_s3_order():
    page = {
        "Versions": [v("a", "a2", T0 + 5, latest=False), v("a", "a1", T0), v("b", "b1", T0 + 1, latest=True)],
        "DeleteMarkers": [marker("a", "ad", T0 + 9, latest=True)],
    }
    got = [(e.key, e.version_id, e.deleted) for e in page_versions(page)]
    assert got == [("a", "ad", True), ("a", "a2", False), ("a", "a1", False), ("b", "b1", False)]


def test_picker_takes_the_newest_entry_not_after_as_of_across_pages():
    # "a": three versions and a later delete; "b" born after as_of; "c" deleted before as_of.
    page1 = page_versions({"Versions": [v("a", "a3", T0 + 20, latest=True), v("a", "a2", T0 + 10)]})
    page2 = page_versions(
        {
            "Versions": [v("a", "a1", T0), v("b", "b1", T0 + 30, latest=True), v("c", "c1", T0)],
            "DeleteMarkers": [marker("c", "cd", T0 + 5, latest=True)],
        }
    )
    picker = VersionPicker(T0 + 10)
    picked = [*picker.feed(page1), *picker.feed(page2)]
    assert [(e.key, e.version_id, e.deleted) for e in picked] == [("a", "a2", False), ("c", "cd", True)]
    latest = VersionPicker(None)
    picked = [*latest.feed(page1), *latest.feed(page2)]
    assert [(e.key, e.version_id) for e in picked] == [("a", "a3"), ("b", "b1"), ("c", "cd")]


class FakeBucket:
    """A boto3-shaped client over an in-memory version history; time advances on each listing."""

    def __init__(self, history: list[dict], versioned: bool = True, now: int = T0 + 100) -> None:
        self.history, self.versioned, self.now = history, versioned, now
        self.listings = 0
        self.on_list = lambda: None

    def get_bucket_versioning(self, Bucket):
        date = when(self.now).strftime("%a, %d %b %Y %H:%M:%S GMT")
        status = {"Status": "Enabled"} if self.versioned else {}
        return {**status, "ResponseMetadata": {"HTTPHeaders": {"date": date}}}

    def get_paginator(self, name):
        self.name = name
        return self

    def paginate(self, Bucket, Prefix):
        self.listings += 1
        self.on_list()
        entries = sorted((e for e in self.history if e["Key"].startswith(Prefix)), key=lambda e: (e["Key"], -e["t"]))
        if self.name == "list_objects_v2":
            seen, contents = set(), []
            for e in entries:
                if e["Key"] not in seen:
                    seen.add(e["Key"])
                    if not e.get("deleted"):
                        contents.append({"Key": e["Key"], "Size": e["size"], "ETag": e["etag"]})
            return iter([{"Contents": contents}])
        versions, markers = [], []
        for i, e in enumerate(entries):
            latest = i == 0 or entries[i - 1]["Key"] != e["Key"]
            if e.get("deleted"):
                markers.append(marker(e["Key"], e["vid"], e["t"], latest))
            else:
                versions.append(v(e["Key"], e["vid"], e["t"], e["size"], e["etag"], latest))
        # One page per two versions, markers with the page of their key: keys span pages.
        pages = [{"Versions": versions[i : i + 2]} for i in range(0, len(versions), 2)]
        pages[-1]["DeleteMarkers"] = markers
        return iter(pages)


def put(key, vid, t, size=3, etag='"e"'):
    return {"Key": key, "vid": vid, "t": t, "size": size, "etag": etag}


def test_pin_in_a_versioned_bucket_digests_version_ids_and_dates_as_of():
    bucket = FakeBucket(
        [
            put("p/a", "a1", T0, etag='"x1"'),
            put("p/a", "a2", T0 + 7, etag='"x2"'),
            put("p/b", "b1", T0 + 2),
            {"Key": "p/gone", "vid": "gd", "t": T0 + 9, "deleted": True},
            put("p/gone", "g1", T0 + 1),
            put("q/other", "o1", T0 + 50),  # outside the prefix: does not date the pin
        ]
    )
    got = pin(bucket, "bkt", Selection("p/"), sleep=pytest.fail)
    h = RevisionHasher()
    h.add("p/a", 3, '"x2"', "a2")
    h.add("p/b", 3, '"e"', "b1")
    assert (got.revision, got.objects, got.bytes) == (h.revision_id(), 2, 6)
    assert got.as_of == format_as_of(T0 + 9) and got.versioned  # the delete marker is the newest entry


def test_pin_lists_again_until_the_prefix_has_settled():
    """A version written in the last two seconds before the listing could share
    as_of's second with one written right after it: wait and list again."""
    bucket = FakeBucket([put("p/a", "a1", T0)], now=T0 + 1)
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        bucket.now += 2

    got = pin(bucket, "bkt", Selection("p/"), sleep=sleep)
    assert bucket.listings == 2 and len(slept) == 1 and 0 < slept[0] <= 2.1
    assert got.as_of == format_as_of(T0)


def test_pin_of_a_prefix_that_never_settles_still_pins():
    bucket = FakeBucket([put("p/a", "a1", T0)], now=T0)

    def write_more():
        bucket.history.append(put("p/a", f"a{bucket.listings + 1}", bucket.now))

    bucket.on_list = write_more
    got = pin(bucket, "bkt", Selection("p/"), sleep=lambda s: None)
    assert bucket.listings == 4 and got.versioned


def test_unversioned_pin_is_the_plain_listing_digest():
    bucket = FakeBucket([put("p/a", "a1", T0), put("p/a", "a2", T0 + 1, etag='"new"')], versioned=False)
    got = pin(bucket, "bkt", Selection("p/"))
    h = RevisionHasher()
    h.add("p/a", 3, '"new"')
    assert (got.revision, got.as_of, got.versioned) == (h.revision_id(), None, False)


def test_versioning_status_the_server_refuses_to_tell_means_unversioned():
    class Refusing(FakeBucket):
        def get_bucket_versioning(self, Bucket):
            err = Exception("denied")
            err.response = {"Error": {"Code": "AccessDenied"}}  # type: ignore[attr-defined]
            raise err

    got = pin(Refusing([put("p/a", "a1", T0)]), "bkt", Selection("p/"))
    assert got.as_of is None and got.objects == 1


# --- RevisionRef: a pinned revision as one value -------------------------------------------

REV = "r-0123456789abcdef0123"
AS_OF = "2026-01-31T12:00:00Z"


def test_revision_ref_validates_both_parts_on_construction():
    assert RevisionRef(REV).versioned is False and RevisionRef(REV, AS_OF).versioned is True
    with pytest.raises(ValueError, match="not a dscache revision id"):
        RevisionRef("../../etc")
    with pytest.raises(ValueError, match="not a dscache revision id"):
        RevisionRef("r-0123")
    # Garbled, and parseable but not the canonical form format_as_of writes: one
    # revision must have one spelling, or two refs to it would compare unequal.
    for bad in ("yesterday", "", "2026-01-31 12:00:00Z", "2026-1-31T12:00:00Z", "2026-01-31T12:00:00+00:00"):
        with pytest.raises(ValueError, match="as-of must be a UTC time like"):
            RevisionRef(REV, bad)
    assert RevisionRef(REV, format_as_of(parse_as_of(AS_OF))) == RevisionRef(REV, AS_OF)
    assert RevisionRef(REV) != RevisionRef(REV, AS_OF)


def test_revision_ref_annotation_round_trip():
    for ref in (RevisionRef(REV), RevisionRef(REV, AS_OF)):
        annotations = {"dscache.io/cache": "c", "other": "x", **ref.to_annotations()}
        assert RevisionRef.from_annotations(annotations, "c") == ref
    # The annotation names are the contract's, and an unversioned revision sets no as-of at all.
    assert RevisionRef(REV).to_annotations() == {ANNOTATION_REVISION: REV}
    assert RevisionRef(REV, AS_OF).to_annotations() == {ANNOTATION_REVISION: REV, ANNOTATION_AS_OF: AS_OF}
    assert (ANNOTATION_REVISION, ANNOTATION_AS_OF) == ("dscache.io/revision", "dscache.io/revision-as-of")
    assert RevisionRef.from_annotations({"dscache.io/cache": "c"}, "c") is None


def test_revision_ref_from_annotations_refuses_with_the_annotation_and_the_fix():
    with pytest.raises(ValueError) as e:
        RevisionRef.from_annotations({ANNOTATION_REVISION: "../../etc"}, "imagenet")
    msg = str(e.value)
    assert "'imagenet'" in msg and f"{ANNOTATION_REVISION}='../../etc'" in msg and "not a revision id" in msg
    assert "remove it" in msg and "kubectl get dsc imagenet" in msg
    with pytest.raises(ValueError) as e:
        RevisionRef.from_annotations({ANNOTATION_REVISION: REV, ANNOTATION_AS_OF: "yesterday"}, "imagenet")
    msg = str(e.value)
    assert f"{ANNOTATION_AS_OF}='yesterday'" in msg and "malformed" in msg
    assert f"remove it together with {ANNOTATION_REVISION}" in msg
    # An as-of time without its revision would be paired with whatever revision the
    # cache has now: a time that belongs to another listing. Refused, not completed.
    with pytest.raises(ValueError) as e:
        RevisionRef.from_annotations({ANNOTATION_AS_OF: AS_OF}, "imagenet")
    msg = str(e.value)
    assert f"{ANNOTATION_AS_OF}={AS_OF!r}" in msg and f"without {ANNOTATION_REVISION}" in msg
    assert "belongs to one revision" in msg and "Remove it" in msg


def test_a_pin_gives_its_revision_with_its_own_as_of_time():
    assert Pin(REV, 3, 30, AS_OF).ref == RevisionRef(REV, AS_OF)
    assert Pin(REV, 3, 30).ref == RevisionRef(REV)
    with pytest.raises(ValueError):
        _ = Pin(REV, 3, 30, "garbage").ref
