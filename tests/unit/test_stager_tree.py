from __future__ import annotations

from pathlib import Path

from dscache_stager.tree import LocalTree


def test_stale_file_or_symlink_in_the_way_is_replaced_never_followed(tmp_path: Path):
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "a").write_text("stale file where a directory must go")
    (dest / "b").symlink_to(outside)
    tree = LocalTree(str(dest))
    tree.ensure_parent("a/x.bin")
    tree.ensure_parent("b/y.bin")
    assert (dest / "a").is_dir() and (dest / "b").is_dir() and not (dest / "b").is_symlink()
    assert list(outside.iterdir()) == []


def test_place_replaces_a_stale_directory(tmp_path: Path):
    (tmp_path / "d" / "x").mkdir(parents=True)
    tmp = tmp_path / "t"
    tmp.write_bytes(b"new")
    LocalTree(str(tmp_path)).place(str(tmp), "d")
    assert (tmp_path / "d").read_bytes() == b"new"


def test_stale_files_and_empty_dirs_are_removed(tmp_path: Path):
    for rel in ["keep/a", "gone/deep/b", "c", ".hidden/x"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "link").symlink_to("/etc")
    tree = LocalTree(str(tmp_path))
    stale = tree.stale({"keep/a"})
    assert sorted(stale) == [".hidden/x", "c", "gone/deep/b", "link"]
    tree.remove(stale)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["keep", "keep/a"]


def test_a_destination_owned_by_someone_else_is_used_as_it_is(tmp_path: Path):
    """An emptyDir is root-owned 0777; a non-root stager must not need to chmod it."""
    import os
    import shutil
    import tempfile

    from dscache_stager.layout import Revision, cache_lock, write_lease

    # pytest's tmp_path is private to root; uid 65532 must be able to reach it.
    base = Path(tempfile.mkdtemp(prefix="dscache-emptydir-"))
    os.chmod(base, 0o755)
    dest = base / "emptydir"
    dest.mkdir()
    os.chmod(dest, 0o777)
    pid = os.fork()
    if pid == 0:  # the stager, as uid 65532
        code = 1
        try:
            os.setgid(65532)
            os.setuid(65532)
            rev = Revision(str(dest), "r-" + "0" * 20)
            with cache_lock(str(dest)):
                write_lease(str(dest), rev.rev, "pod")
                rev.prepare()
            st = os.stat(rev.data)
            code = 0 if st.st_mode & 0o777 == 0o755 and st.st_uid == 65532 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(base)
    assert os.waitstatus_to_exitcode(status) == 0
