"""Where a revision is born: revs/ marked a top of hierarchies (FS_TOPDIR_FL) where the
filesystem has the flag, left alone where it has not; each revision dir made under an interim
name and renamed into place, leaving nothing behind."""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

import pytest

from dscache_stager import layout
from dscache_stager.layout import FS_IOC_GETFLAGS, FS_TOPDIR_FL, NEW_PREFIX, Revision, make_dir_unnamed, spread_subdirs

REV = "r-" + "a" * 20


def fs_flags(path: Path) -> int | None:
    """The inode flags as lsattr reads them; None where the filesystem has none."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = bytearray(8)
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
        return int.from_bytes(buf[:4], sys.byteorder)
    except OSError:
        return None
    finally:
        os.close(fd)


def topdir_supported(path: Path) -> bool:
    """Whether ``path``'s filesystem takes FS_TOPDIR_FL (ext2/3/4 do; tmpfs, xfs, overlayfs do not)."""
    probe = path / "probe"
    probe.mkdir()
    try:
        return spread_subdirs(str(probe)) and (fs_flags(probe) or 0) & FS_TOPDIR_FL != 0
    finally:
        probe.rmdir()


def test_prepare_marks_revs_a_top_of_hierarchies_where_the_filesystem_has_the_flag(tmp_path: Path) -> None:
    if not topdir_supported(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem has no FS_TOPDIR_FL (not ext2/3/4)")
    c = tmp_path / "c"
    rev = Revision(str(c), REV)
    assert rev.prepare() is False
    flags = fs_flags(c / "revs")
    assert flags is not None and flags & FS_TOPDIR_FL
    # Only revs/: the revision's own dirs keep their files next to them.
    assert not (fs_flags(Path(rev.dir)) or 0) & FS_TOPDIR_FL
    assert not (fs_flags(Path(rev.data)) or 0) & FS_TOPDIR_FL
    # Set once: a second run finds it and changes nothing else.
    assert spread_subdirs(str(c / "revs")) is True
    assert fs_flags(c / "revs") == flags


def test_a_filesystem_without_the_flag_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """xfs, tmpfs and overlayfs answer the ioctl with ENOTTY, EOPNOTSUPP or EINVAL; a revs/ of
    another uid with EPERM: the revision is prepared as before."""
    for code in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
        calls: list[int] = []

        def refuse(fd: int, request: int, *args: object, code: int = code, calls: list[int] = calls) -> None:
            calls.append(request)
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(layout.fcntl, "ioctl", refuse)
        c = tmp_path / f"c{code}"
        rev = Revision(str(c), REV)
        assert rev.prepare() is False
        assert calls, "the flag was never asked for"
        assert os.path.isdir(rev.data) and os.path.isdir(rev.meta) and os.path.isdir(rev.tmp)
        assert sorted(os.listdir(c / "revs")) == [REV]
        assert spread_subdirs(str(c / "revs")) is False


def test_a_filesystem_that_reads_flags_but_refuses_topdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs since 6.0 reads flags and refuses the ones it lacks (EOPNOTSUPP on the set)."""
    real = fcntl.ioctl
    sets: list[int] = []

    def refuse_set(fd: int, request: int, buf: bytearray, mutate: bool = True) -> object:
        if request == layout.FS_IOC_SETFLAGS:
            sets.append(int.from_bytes(bytes(buf[:4]), sys.byteorder))
            raise OSError(errno.EOPNOTSUPP, "not supported")
        return real(fd, request, buf, mutate)

    monkeypatch.setattr(layout.fcntl, "ioctl", refuse_set)
    (tmp_path / "d").mkdir()
    before = fs_flags(tmp_path / "d")
    if before is None:
        pytest.skip("this filesystem reads no flags at all (the test above covers it)")
    assert spread_subdirs(str(tmp_path / "d")) is False
    assert sets == [before | FS_TOPDIR_FL]  # the flags it had, plus TOPDIR: nothing else changed
    assert fs_flags(tmp_path / "d") == before


def test_a_path_that_is_not_a_directory_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert spread_subdirs(str(tmp_path / "link")) is False
    assert spread_subdirs(str(tmp_path / "missing")) is False
    assert not (fs_flags(tmp_path / "target") or 0) & FS_TOPDIR_FL


def test_the_revision_dir_is_renamed_into_place_leaving_nothing(tmp_path: Path) -> None:
    path = tmp_path / REV
    make_dir_unnamed(str(path))
    assert path.is_dir() and not path.is_symlink()
    assert os.listdir(tmp_path) == [REV]
    assert (path.stat().st_mode & 0o777) == 0o755 & ~_umask()


def test_a_revision_dir_made_meanwhile_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone else made it between the check and the rename, with a file in it: rename fails
    (ENOTEMPTY), the interim dir goes, and the other one stays as it was."""
    path = tmp_path / REV
    real_rename = os.rename

    def racing_rename(src: str, dst: str) -> None:
        path.mkdir()
        (path / "kept").write_text("x")
        real_rename(src, dst)

    monkeypatch.setattr(layout.os, "rename", racing_rename)
    make_dir_unnamed(str(path))
    assert sorted(os.listdir(tmp_path)) == [REV]
    assert (path / "kept").read_text() == "x"


def test_when_the_interim_dir_cannot_be_made_the_revision_dir_still_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mkdir = os.mkdir

    def no_interim(p: str, mode: int = 0o777) -> None:
        if os.path.basename(p).startswith(NEW_PREFIX):
            raise OSError(errno.ENAMETOOLONG, "too long")
        real_mkdir(p, mode)

    monkeypatch.setattr(layout.os, "mkdir", no_interim)
    make_dir_unnamed(str(tmp_path / REV))
    assert os.listdir(tmp_path) == [REV]


def test_an_interim_dir_left_by_a_killed_run_is_no_revision(tmp_path: Path) -> None:
    """It carries the NEW_PREFIX: the node agent's scan skips it and its leftovers pass leaves it
    alone (a stager may be between its mkdir and its rename: a removal running on inside the
    renamed revision would take the stager's dirs); the next stager's prepare removes it."""
    from dscache_node import disk

    c = tmp_path / "ns" / "cache"
    left = c / "revs" / f"{NEW_PREFIX}{REV}-1-2"
    left.mkdir(parents=True)
    assert disk.scan(str(tmp_path)) == []
    assert disk.leftovers(str(tmp_path)) == []
    Revision(str(c), REV).prepare()
    assert sorted(os.listdir(c / "revs")) == [REV]


def test_an_interim_name_that_is_not_empty_is_left_alone(tmp_path: Path) -> None:
    """Only an empty leftover is removed (a killed run's always is): rmdir, never a tree."""
    c = tmp_path / "c"
    odd = c / "revs" / f"{NEW_PREFIX}someone-else"
    odd.mkdir(parents=True)
    (odd / "f").write_text("x")
    Revision(str(c), REV).prepare()
    assert sorted(os.listdir(c / "revs")) == sorted([REV, odd.name])
    assert (odd / "f").read_text() == "x"


def test_prepare_keeps_an_existing_revision(tmp_path: Path) -> None:
    c = tmp_path / "c"
    rev = Revision(str(c), REV)
    rev.prepare()
    (Path(rev.data) / "obj").write_text("x")
    inode = os.stat(rev.dir).st_ino
    assert Revision(str(c), REV).prepare() is True
    assert os.stat(rev.dir).st_ino == inode
    assert sorted(os.listdir(c / "revs")) == [REV]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_prepare_makes_a_new_revision_dir_under_an_interim_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ext4 starts its search for the dir's block group from a hash of its name: the interim
    name, fresh each time, not the revision's (a wiped revision staged again would start where
    its old copy was freed)."""
    renames: list[tuple[str, str]] = []
    real_rename = os.rename

    def spy(src: str, dst: str) -> None:
        renames.append((os.path.basename(src), dst))
        real_rename(src, dst)

    monkeypatch.setattr(layout.os, "rename", spy)
    rev = Revision(str(tmp_path / "c"), REV)
    rev.prepare()
    assert [dst for _, dst in renames] == [rev.dir]
    assert renames[0][0].startswith(f"{NEW_PREFIX}{REV}-")
    rev.prepare()  # it exists now: made once
    assert len(renames) == 1


def test_a_real_tmpfs_refuses_the_flag_and_the_revision_is_prepared(tmp_path: Path) -> None:
    """The emptyDir mode's medium may be memory: tmpfs has no FS_TOPDIR_FL."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.statvfs(shm).f_fsid == os.statvfs(tmp_path).f_fsid:
        pytest.skip("no tmpfs at /dev/shm distinct from the test's filesystem")
    with open("/proc/self/mountinfo") as f:
        if not any(line.split()[4] == "/dev/shm" and " - tmpfs " in line for line in f):
            pytest.skip("/dev/shm is not a tmpfs here")
    c = shm / f"dscache-test-{os.getpid()}-{tmp_path.name}"
    try:
        rev = Revision(str(c), REV)
        assert rev.prepare() is False
        assert spread_subdirs(str(c / "revs")) is False
        assert not (fs_flags(c / "revs") or 0) & FS_TOPDIR_FL
        assert sorted(os.listdir(c / "revs")) == [REV]
    finally:
        layout.remove_tree(str(c))
