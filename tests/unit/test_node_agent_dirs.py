"""The revisions' directories the agent keeps open (peers.RevisionDirs, issue 30): an object is
opened from the kept descriptor only while C/revs/<rev> (and its data/) still name the directory
that was reached through real directories; a revision renamed aside, replaced, or swapped for a
symlink after it was served is walked from C again (new content served, symlinks refused)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract.peers import RevisionState
from dscache_node.peers import REVISION_DIRS, RevisionDirs, open_object, revision_state

REV = "r-" + "a" * 20


@pytest.fixture
def cache(tmp_path: Path) -> str:
    c = contract.cache_dir(str(tmp_path / "root"), "team-a", "imagenet")
    os.makedirs(os.path.join(contract.data_dir(c, REV), "train"))
    Path(contract.data_dir(c, REV), "a.bin").write_bytes(b"old")
    return c


def read(c: str, path: str) -> bytes:
    opened = open_object(c, REV, path)
    try:
        return os.pread(opened.fd, opened.size + 1, 0)
    finally:
        os.close(opened.fd)


def test_a_revision_renamed_aside_and_staged_again_serves_the_new_copy(cache):
    assert read(cache, "a.bin") == b"old"
    rev_dir = contract.revision_dir(cache, REV)
    os.rename(rev_dir, os.path.join(os.path.dirname(rev_dir), ".gone-x"))  # as a wipe does
    with pytest.raises(FileNotFoundError):
        read(cache, "a.bin")
    os.makedirs(contract.data_dir(cache, REV))
    Path(contract.data_dir(cache, REV), "a.bin").write_bytes(b"new")
    assert read(cache, "a.bin") == b"new"


def test_a_data_dir_swapped_for_a_symlink_after_serving_is_refused(cache, tmp_path):
    assert read(cache, "a.bin") == b"old"
    data = contract.data_dir(cache, REV)
    os.rename(data, data + ".real")
    os.symlink(data + ".real", data)
    with pytest.raises(FileNotFoundError):
        read(cache, "a.bin")


def test_a_revision_dir_swapped_for_a_symlink_after_serving_is_refused(cache, tmp_path):
    assert read(cache, "a.bin") == b"old"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "a.bin").write_text("another pod's data")
    rev_dir = contract.revision_dir(cache, REV)
    shutil.rmtree(rev_dir)
    os.symlink(elsewhere, rev_dir)
    with pytest.raises(FileNotFoundError):
        read(cache, "a.bin")
    assert revision_state(cache, REV, True) is RevisionState.ABSENT


def test_a_removed_revision_is_not_served_from_its_kept_descriptor(cache):
    assert read(cache, "a.bin") == b"old"
    shutil.rmtree(contract.revision_dir(cache, REV))
    with pytest.raises(FileNotFoundError):
        read(cache, "a.bin")


def test_descriptors_are_bounded_and_closed(tmp_path):
    dirs = RevisionDirs()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(RevisionDirs.MAX + 20):
        c = contract.cache_dir(str(tmp_path / "root"), "ns", f"c{i}")
        os.makedirs(contract.data_dir(c, REV))
        Path(contract.data_dir(c, REV), "x").write_bytes(b"x")
        os.close(dirs.open(c, REV, [contract.DATA_DIR, "x"], os.O_RDONLY))
    assert len(os.listdir("/proc/self/fd")) - before <= 2 * RevisionDirs.MAX
    dirs.clear()
    assert len(os.listdir("/proc/self/fd")) - before <= 1


def test_the_agents_set_walks_only_what_is_beneath(cache):
    """A path under data/ still goes one component at a time from the kept data/ descriptor."""
    os.symlink("train", os.path.join(contract.data_dir(cache, REV), "train2"))
    Path(contract.data_dir(cache, REV), "train", "b.bin").write_bytes(b"B")
    assert read(cache, "train/b.bin") == b"B"
    with pytest.raises(FileNotFoundError):
        read(cache, "train2/b.bin")
    REVISION_DIRS.clear()
    assert read(cache, "train/b.bin") == b"B"


def test_a_directory_unused_for_a_while_is_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(RevisionDirs, "IDLE_S", 0.2)
    dirs = RevisionDirs()
    caches = []
    for name in ("a", "b"):
        c = contract.cache_dir(str(tmp_path / "root"), "ns", name)
        os.makedirs(contract.data_dir(c, REV))
        Path(contract.data_dir(c, REV), "x").write_bytes(b"x")
        caches.append(c)
    before = len(os.listdir("/proc/self/fd"))
    os.close(dirs.open(caches[0], REV, [contract.DATA_DIR, "x"], os.O_RDONLY))
    assert len(os.listdir("/proc/self/fd")) - before == 2  # its revision dir and data/ kept open
    time.sleep(0.3)
    os.close(dirs.open(caches[1], REV, [contract.DATA_DIR, "x"], os.O_RDONLY))
    assert len(os.listdir("/proc/self/fd")) - before == 2  # a's closed, b's open
    dirs.clear()
