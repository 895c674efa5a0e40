from __future__ import annotations

from pathlib import Path

from dscache_stager.tree import LocalTree


def test_stale_file_or_symlink_in_the_way_is_replaced_never_followed(tmp_path: Path):
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir(); outside.mkdir()
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


def test_stale_files_and_empty_dirs_are_removed_but_not_bookkeeping(tmp_path: Path):
    for rel in ["keep/a", "gone/deep/b", "c", ".dscache/manifest.jsonl"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "link").symlink_to("/etc")
    tree = LocalTree(str(tmp_path))
    stale = tree.stale({"keep/a"})
    assert sorted(stale) == ["c", "gone/deep/b", "link"]
    tree.remove(stale)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        ".dscache", ".dscache/manifest.jsonl", "keep", "keep/a"]
