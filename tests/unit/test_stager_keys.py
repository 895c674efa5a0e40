from __future__ import annotations

import pytest

from dscache_stager.errors import UsageError
from dscache_stager.keys import TreeShape, unsafe_reason
from dscache_stager.source import S3Source


@pytest.mark.parametrize(
    "rel, why",
    [
        ("", "empty name"),
        ("/etc/passwd", "absolute path"),
        ("a//b", "empty path segment"),
        ("a/", "empty path segment"),
        ("../x", "'..' segment"),
        ("a/../../x", "'..' segment"),
        ("a/./b", "'.' segment"),
        ("a/" + "n" * 256, "segment longer than 255 bytes"),
        ("é" * 128, "segment longer than 255 bytes"),  # 256 bytes in UTF-8
        ("tab\there", "control character"),
        ("nul\x00", "control character"),
    ],
)
def test_unsafe_keys_are_named(rel: str, why: str):
    assert unsafe_reason(rel) == why


@pytest.mark.parametrize(
    "rel", ["a.bin", "a/b/c.bin", "sp ace/é+%.txt", "n" * 255, ".dscache/manifest.jsonl", "..a", "a.."]
)
def test_safe_keys(rel: str):
    assert unsafe_reason(rel) is None


def test_tree_shape_finds_file_directory_clashes_both_ways():
    s = TreeShape()
    assert s.clash("a/b") is None
    assert s.clash("a") == "a/"  # 'a' is already a directory
    assert s.clash("a/b/c") == "a/b"  # 'a/b' is already a file
    assert s.clash("a/c") is None


@pytest.mark.parametrize(
    "uri, bucket, prefix",
    [
        ("s3://b", "b", ""),
        ("s3://b/", "b", ""),
        ("s3://b/a/b", "b", "a/b/"),
        ("s3://b/a/b/", "b", "a/b/"),
    ],
)
def test_source_uri(uri: str, bucket: str, prefix: str):
    s = S3Source.parse(uri)
    assert (s.bucket, s.prefix) == (bucket, prefix)
    assert s.relative(prefix + "x/y") == "x/y"


@pytest.mark.parametrize("uri", ["b/x", "s3:///x", "gs://b/x"])
def test_bad_source_uri(uri: str):
    with pytest.raises(UsageError, match="s3://BUCKET"):
        S3Source.parse(uri)


def test_tree_shape_in_listing_order_finds_clashes_across_keys_in_between():
    # In S3's order, keys such as 'x.txt' and 'x-1/y' sort between a file 'x' and 'x/y'.
    s = TreeShape()
    assert [s.clash(k) for k in ["x", "x-1/y", "x.txt", "x/y", "y"]] == [None, None, None, "x", None]
    assert s.clash("y") == "y"  # the same path twice
    assert s.file_at_or_above("y/empty") == "y"  # an empty object under a file, checked without recording it


def test_tree_shape_holds_directories_and_the_open_prefix_chain_not_every_file():
    s = TreeShape()
    keys = sorted(f"d{i % 50:02d}/f{i:06d}.bin" for i in range(20_000))
    assert all(s.clash(k) is None for k in keys)
    assert len(s._dirs) == 50  # grows with directories
    assert len(s._open) <= 2  # not with files: only those a later key could still sit under
