"""The wipe safety rules, on a real filesystem."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dscache_stager.errors import BusyError, UsageError
from dscache_stager.layout import Layout
from dscache_stager.wipe import wipe


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "cache-root"
    (r / "ns" / "ds" / "sub").mkdir(parents=True)
    (r / "ns" / "ds" / "sub" / "f.bin").write_bytes(b"x")
    return r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    o = tmp_path / "precious"
    o.mkdir()
    (o / "keep.txt").write_text("keep")
    return o


def test_wipes_a_directory_inside_root_and_is_idempotent(root: Path):
    assert wipe(str(root / "ns" / "ds"), str(root)) is True
    assert not (root / "ns" / "ds").exists() and (root / "ns").is_dir()
    assert wipe(str(root / "ns" / "ds"), str(root)) is False


@pytest.mark.parametrize("target", ["{outside}", "{root}", "{root}/../precious", "{root}/ns/../../precious"])
def test_refuses_anything_not_strictly_inside_root(root: Path, outside: Path, target: str):
    with pytest.raises(UsageError, match="not inside the cache root"):
        wipe(target.format(root=root, outside=outside), str(root))
    assert (outside / "keep.txt").exists() and (root / "ns" / "ds").exists()


def test_refuses_relative_paths(root: Path):
    with pytest.raises(UsageError, match="absolute"):
        wipe("ns/ds", str(root))


def test_refuses_a_symlinked_target_or_component(root: Path, outside: Path):
    (root / "ns" / "link").symlink_to(outside)
    with pytest.raises(UsageError, match="symlink"):
        wipe(str(root / "ns" / "link"), str(root))
    with pytest.raises(UsageError, match="symlink"):
        wipe(str(root / "ns" / "link" / "keep.txt"), str(root))
    assert (outside / "keep.txt").read_text() == "keep"


def test_never_follows_symlinks_inside_the_tree(root: Path, outside: Path):
    (root / "ns" / "ds" / "escape").symlink_to(outside)
    (root / "ns" / "ds" / "file-link").symlink_to(outside / "keep.txt")
    assert wipe(str(root / "ns" / "ds"), str(root))
    assert (outside / "keep.txt").read_text() == "keep"


def test_root_may_itself_be_a_symlink(tmp_path: Path, root: Path):
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    assert wipe(str(alias / "ns" / "ds"), str(alias))
    assert not (root / "ns" / "ds").exists()


def test_cli_exit_codes_and_json(root: Path, outside: Path, tmp_path: Path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "dscache_stager", "wipe", *a], capture_output=True, text=True)
    ok = run(str(root / "ns" / "ds"), "--root", str(root))
    assert ok.returncode == 0 and '"existed": true' in ok.stdout
    bad = run(str(outside), "--root", str(root), "--termination-log", str(tmp_path / "t"))
    assert bad.returncode == 2 and "not inside the cache root" in bad.stderr
    assert (tmp_path / "t").read_text().startswith("error: refusing to wipe")


def test_wipe_refuses_while_a_stager_holds_the_lock_and_a_waiting_stager_starts_over(root: Path):
    copy = root / "ns" / "ds"
    layout = Layout(copy)
    with layout.locked():
        with pytest.raises(BusyError, match="being staged"):
            wipe(str(copy), str(root))
    assert (copy / "sub" / "f.bin").exists()

    # A wipe holding the lock; a stager waiting on it must end up in a fresh,
    # linked directory, not in the deleted one.
    fd = os.open(layout.lock_path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    entered = threading.Event()

    def stager() -> None:
        with layout.locked():
            (copy / "marker").write_text("after")
            entered.set()

    t = threading.Thread(target=stager)
    t.start()
    time.sleep(0.3)
    assert not entered.is_set()
    shutil.rmtree(copy)  # what wipe does while it holds the lock
    os.close(fd)
    t.join(10)
    assert entered.is_set() and (copy / "marker").read_text() == "after"
    assert (copy / ".dscache" / "lock").exists()
