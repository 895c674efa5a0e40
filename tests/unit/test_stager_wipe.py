"""The wipe: leases, revisions, and the safety rules, on a real filesystem."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract import StageSummary, WipeArgs
from dscache_stager import wipe as wipe_mod
from dscache_stager.errors import BusyError, UsageError
from dscache_stager.layout import Revision, cache_lock, write_lease
from dscache_stager.wipe import wipe

R1 = "r-" + "1" * 20
R2 = "r-" + "2" * 20


def make_revision(c: Path, rev: str, files: dict[str, bytes]) -> Path:
    """A complete, sealed revision as the stager leaves it."""
    r = Revision(str(c), rev)
    os.makedirs(r.tmp)
    os.makedirs(r.meta)
    for rel, body in files.items():
        p = Path(r.data, rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body)
        p.chmod(0o444)
    Path(r.journal_path).write_text("")
    dirs = {str(p.relative_to(r.data)) for p in Path(r.data).rglob("*") if p.is_dir()}
    manifest = Path(r.tmp, "manifest.listed")
    manifest.write_text("")
    r.seal(str(manifest), dirs, StageSummary(objects=len(files), revision=rev))
    return Path(r.dir)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "cache-root"
    c = r / "ns" / "ds"
    make_revision(c, R1, {"a/f.bin": b"one"})
    make_revision(c, R2, {"a/f.bin": b"two"})
    for uid in ("u1", "u2"):
        write_lease(str(c), R1, uid)
    return r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    o = tmp_path / "precious"
    o.mkdir()
    (o / "keep.txt").write_text("keep")
    return o


def leases(c: str, rev: str) -> list[str]:
    """The names in C/leases/<rev>, as they are on disk."""
    try:
        return sorted(os.listdir(contract.lease_dir(c, rev)))
    except FileNotFoundError:
        return []


def C(root: Path) -> Path:
    return root / "ns" / "ds"


def test_an_unreleased_lease_keeps_the_revision(root: Path):
    out = wipe(WipeArgs(str(C(root)), str(root), revision=R1, release=("u1",)))
    assert (out.removed, out.existed, out.leases, out.released) == (False, True, ["u2"], ["u1"])
    assert (C(root) / "revs" / R1 / "data/a/f.bin").read_bytes() == b"one"
    assert leases(str(C(root)), R1) == ["u2"]


def test_released_leases_let_it_go_and_nothing_else(root: Path):
    out = wipe(WipeArgs(str(C(root)), str(root), revision=R1, release=("u1", "u2")))
    assert (out.removed, out.leases) == (True, [])
    assert not (C(root) / "revs" / R1).exists() and not (C(root) / "leases" / R1).exists()
    # The other revision and C itself (a pod's mount source) stay.
    assert (C(root) / "revs" / R2 / "data/a/f.bin").read_bytes() == b"two"
    assert (C(root) / "lock").exists()
    again = wipe(WipeArgs(str(C(root)), str(root), revision=R1))
    assert (again.removed, again.existed) == (False, False)


def test_a_revision_nobody_leased_is_removed(root: Path):
    assert wipe(WipeArgs(str(C(root)), str(root), revision=R2)).removed
    assert not (C(root) / "revs" / R2).exists() and (C(root) / "revs" / R1).exists()


def test_all_removes_the_cache_dir_only_once_no_lease_remains(root: Path):
    out = wipe(WipeArgs(str(C(root)), str(root), all_revisions=True, release=("u1",)))
    assert (out.removed, out.leases, out.stray) == (False, ["u2"], [])
    assert C(root).is_dir()
    out = wipe(WipeArgs(str(C(root)), str(root), all_revisions=True, release=("u2",)))
    assert out.removed and not C(root).exists() and (root / "ns").is_dir()
    assert not wipe(WipeArgs(str(C(root)), str(root), all_revisions=True)).removed  # idempotent


def test_leases_are_plain_uids_each_once_in_both_modes(root: Path):
    """One pod may hold two revisions on a node (two containers' Jobs, or a retry):
    --all reports its UID once, and exactly what --revision would report."""
    c = str(C(root))
    write_lease(c, R2, "u2")
    write_lease(c, R2, "u3")
    assert wipe(WipeArgs(c, str(root), revision=R1)).leases == ["u1", "u2"]
    assert wipe(WipeArgs(c, str(root), revision=R2)).leases == ["u2", "u3"]
    out = wipe(WipeArgs(c, str(root), all_revisions=True))
    assert (out.leases, out.stray, out.removed) == (["u1", "u2", "u3"], [], False)
    # They go back as --release as they are, and then nothing holds C any more.
    assert wipe(WipeArgs(c, str(root), all_revisions=True, release=tuple(out.leases))).removed


def test_hundreds_of_leases_still_give_a_json_termination_message(root: Path, tmp_path: Path):
    c = C(root)
    uids = [f"6f1c4c2e-8b1a-4c1e-9d7e-{i:012d}" for i in range(300)]
    for uid in uids:
        write_lease(str(c), R2, uid)
    r = _cli(str(c), "--root", str(root), "--all", "--termination-log", str(tmp_path / "t"))
    assert r.returncode == 0, r.stderr
    logged = (tmp_path / "t").read_text()
    assert len(logged.encode()) <= 4096
    d = json.loads(logged)
    assert d["truncated"] is True and d["removed"] is False and d["leases"][:2] == uids[:2]
    assert d["leases"] == sorted({*uids, "u1", "u2"})[: len(d["leases"])]


def test_stray_entries_are_reported_apart_and_keep_the_copy(root: Path):
    """A name under leases/ that is no pod UID (or no revision) cannot be released:
    it keeps the copy, and is reported with its path so a person can look at it."""
    c = C(root)
    (c / "leases" / R1 / "not a uid").write_text("?")
    (c / "leases" / R2).write_text("a file where a lease dir belongs")
    (c / "leases" / "README").write_text("?")
    out = wipe(WipeArgs(str(c), str(root), revision=R1, release=("u1", "u2")))
    assert (out.removed, out.leases, out.stray) == (False, [], [f"leases/{R1}/not a uid"])
    assert (c / "revs" / R1 / "data/a/f.bin").read_bytes() == b"one"
    out = wipe(WipeArgs(str(c), str(root), revision=R2))
    assert (out.removed, out.leases, out.stray) == (False, [], [f"leases/{R2}"])
    out = wipe(WipeArgs(str(c), str(root), all_revisions=True))
    assert (out.removed, out.leases) == (False, [])
    assert out.stray == ["leases/README", f"leases/{R1}/not a uid", f"leases/{R2}"]
    assert c.is_dir()
    # Once they are gone, the same wipes go through.
    for p in (c / "leases" / R1 / "not a uid", c / "leases" / R2, c / "leases" / "README"):
        p.unlink()
    assert wipe(WipeArgs(str(c), str(root), revision=R1)).removed
    assert wipe(WipeArgs(str(c), str(root), all_revisions=True)).removed and not c.exists()


@pytest.mark.parametrize("name", ["revs", "leases"])
def test_refuses_a_symlinked_revs_or_leases_dir(tmp_path: Path, outside: Path, name: str):
    """C/revs or C/leases as a symlink would make paths below them resolve outside ROOT."""
    root = tmp_path / "r"
    c = root / "ns" / "ds"
    c.mkdir(parents=True)
    (outside / R1 / "u1").mkdir(parents=True)
    (c / name).symlink_to(outside)
    with pytest.raises(UsageError, match=f"{name}' is a symlink"):
        wipe(WipeArgs(str(c), str(root), revision=R1, release=("u1",)))
    with pytest.raises(UsageError, match="is a symlink"):
        wipe(WipeArgs(str(c), str(root), all_revisions=True, release=("u1",)))
    assert (outside / R1 / "u1").is_dir() and (outside / "keep.txt").read_text() == "keep"


def test_sealed_revisions_are_removed_by_a_non_root_wipe_too(tmp_path: Path):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="dscache-wipe-"))
    os.chmod(base, 0o755)
    root = base / "root"
    root.mkdir()
    os.chown(root, 65532, 65532)
    pid = os.fork()
    if pid == 0:  # the whole life of the copy as uid 65532
        code = 1
        try:
            os.setgid(65532)
            os.setuid(65532)
            make_revision(root / "ns" / "ds", R1, {"d/e/f": b"x"})
            code = 0 if wipe(WipeArgs(str(root / "ns" / "ds"), str(root), revision=R1)).removed else 2
            code = code or (3 if (root / "ns" / "ds" / "revs" / R1).exists() else 0)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(base)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("target", ["{outside}", "{root}", "{root}/../precious", "{root}/ns/../../precious"])
def test_refuses_anything_not_strictly_inside_root(root: Path, outside: Path, target: str):
    with pytest.raises(UsageError, match="not inside the cache root"):
        wipe(WipeArgs(target.format(root=root, outside=outside), str(root), all_revisions=True))
    assert (outside / "keep.txt").exists() and C(root).exists()


def test_refuses_relative_paths(root: Path):
    with pytest.raises(UsageError, match="absolute"):
        wipe(WipeArgs("ns/ds", str(root), all_revisions=True))


def test_refuses_a_symlinked_cache_dir_or_component(root: Path, outside: Path):
    (root / "ns" / "link").symlink_to(outside)
    with pytest.raises(UsageError, match="symlink"):
        wipe(WipeArgs(str(root / "ns" / "link"), str(root), all_revisions=True))
    with pytest.raises(UsageError, match="symlink"):
        wipe(WipeArgs(str(root / "ns" / "link" / "sub"), str(root), all_revisions=True))
    assert (outside / "keep.txt").read_text() == "keep"


def test_never_follows_symlinks_inside_the_tree(root: Path, outside: Path):
    c = C(root)
    rev = c / "revs" / R2
    rev.chmod(0o755)
    (rev / "data").chmod(0o755)
    (rev / "data" / "escape").symlink_to(outside)
    (rev / "data" / "file-link").symlink_to(outside / "keep.txt")
    # A revision dir that is itself a symlink is unlinked, not followed.
    (c / "revs" / ("r-" + "3" * 20)).symlink_to(outside)
    assert wipe(WipeArgs(str(c), str(root), revision=R2)).removed
    assert wipe(WipeArgs(str(c), str(root), revision="r-" + "3" * 20)).removed
    assert wipe(WipeArgs(str(c), str(root), all_revisions=True, release=("u1", "u2"))).removed
    assert (outside / "keep.txt").read_text() == "keep"


def test_root_may_itself_be_a_symlink(tmp_path: Path, root: Path):
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    assert wipe(WipeArgs(str(alias / "ns" / "ds"), str(alias), revision=R2)).removed
    assert not (C(root) / "revs" / R2).exists()


def test_busy_while_a_stager_holds_the_lock_and_nothing_changes(root: Path):
    with cache_lock(str(C(root))), pytest.raises(BusyError, match="locked by a running stager"):
        wipe(WipeArgs(str(C(root)), str(root), revision=R1, release=("u1", "u2")))
    assert leases(str(C(root)), R1) == ["u1", "u2"]  # not even released


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dscache_stager", "wipe", *args], capture_output=True, text=True)


def test_cli_exit_codes_0_2_and_8_with_json_and_termination_log(root: Path, outside: Path, tmp_path: Path):
    c = C(root)
    lock = os.open(c / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        busy = _cli(str(c), "--root", str(root), "--revision", R2, "--termination-log", str(tmp_path / "t8"))
    finally:
        os.close(lock)
    assert busy.returncode == 8, busy.stderr
    assert "locked by a running stager" in busy.stderr
    assert (tmp_path / "t8").read_text().startswith("error: ")
    assert (c / "revs" / R2).exists()

    ok = _cli(str(c), "--root", str(root), "--revision", R2)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {
        "cache": str(c),
        "revision": R2,
        "released": [],
        "removed": True,
        "existed": True,
        "leases": [],
        "stray": [],
        "legacy": False,
        "legacy_entries": 0,
        "truncated": False,
    }
    bad = _cli(str(outside), "--root", str(root), "--all", "--termination-log", str(tmp_path / "t"))
    assert bad.returncode == 2 and "not inside the cache root" in bad.stderr
    assert (tmp_path / "t").read_text().startswith("error: refusing to wipe")
    usage = _cli(str(c), "--root", str(root))
    assert usage.returncode == 2 and "--revision" in usage.stderr


def test_a_stager_waiting_behind_a_real_wipe_starts_over(root: Path, monkeypatch: pytest.MonkeyPatch):
    """wipe() holds the lock while it deletes; a stager blocked on the lock then
    finds the revision gone (so it stages it again) and writes its lease after."""
    c = str(C(root))
    deleting, go_on = threading.Event(), threading.Event()
    real_discard = wipe_mod.discard

    def slow_discard(path: str, remove=None) -> None:
        deleting.set()
        go_on.wait(10)
        real_discard(path, remove)

    monkeypatch.setattr(wipe_mod, "discard", slow_discard)
    seen: dict = {}

    def stager() -> None:
        with cache_lock(c, on_wait=lambda: seen.setdefault("waited", True)):
            seen["complete"] = Revision(c, R1).read_complete()
            write_lease(c, R1, "late-pod")

    w = threading.Thread(
        target=lambda: seen.setdefault("wipe", wipe(WipeArgs(c, str(root), revision=R1, release=("u1", "u2"))))
    )
    w.start()
    assert deleting.wait(10)
    s = threading.Thread(target=stager)
    s.start()
    s.join(0.5)
    assert s.is_alive()  # blocked on the lock the wipe holds
    go_on.set()
    w.join(10)
    s.join(10)
    assert seen["wipe"].removed and seen.get("waited")
    assert seen["complete"] is None  # it sees no revision: it stages it again, cold
    assert leases(c, R1) == ["late-pod"]


def test_a_stager_waiting_behind_a_wipe_of_everything_gets_a_fresh_cache_dir(
    root: Path, monkeypatch: pytest.MonkeyPatch
):
    c = str(C(root))
    deleting, go_on = threading.Event(), threading.Event()
    real_discard = wipe_mod.discard

    def slow_discard(path: str, remove=None) -> None:
        deleting.set()
        go_on.wait(10)
        real_discard(path, remove)

    monkeypatch.setattr(wipe_mod, "discard", slow_discard)
    out: dict = {}
    w = threading.Thread(
        target=lambda: out.setdefault("wipe", wipe(WipeArgs(c, str(root), all_revisions=True, release=("u1", "u2"))))
    )
    w.start()
    assert deleting.wait(10)

    def holds_the_live_lock() -> bool:
        """Whether the lock file now at C/lock is the one held (not an unlinked one).
        Compared by behaviour, not inode numbers: a new file may reuse the old number."""
        try:
            fd = os.open(contract.lock_path(c), os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # flock: another open file description conflicts
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def stager() -> None:
        with cache_lock(c):
            out["live"] = holds_the_live_lock()
            out["revs"] = os.path.exists(contract.revisions_root(c))

    s = threading.Thread(target=stager)
    s.start()
    s.join(0.5)
    assert s.is_alive()
    go_on.set()
    w.join(10)
    s.join(10)
    assert out["wipe"].removed
    assert out["live"] and out["revs"] is False  # a fresh C, not the deleted one


def test_the_wipe_helper_as_root_without_capabilities_removes_sealed_revisions(root: Path):
    """The helper pod runs as uid 0 with every capability dropped: 0555 dirs refuse it unlinks."""
    c = C(root)
    script = (
        "import sys; from dscache_contract import WipeArgs; from dscache_stager.wipe import wipe; "
        f"print(wipe(WipeArgs({str(c)!r}, {str(root)!r}, revision={R2!r})).to_json())"
    )
    p = subprocess.run(
        ["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-c", script],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["removed"] is True
    assert not (c / "revs" / R2).exists() and (c / "revs" / R1).exists()
    # And the same binary with capabilities really is refused by a sealed dir (the test is not vacuous).
    sealed = c / "revs" / R1 / "data" / "a"
    probe = subprocess.run(
        [
            "setpriv",
            "--bounding-set=-all",
            "--inh-caps=-all",
            sys.executable,
            "-c",
            f"import os; os.unlink({str(sealed / 'f.bin')!r})",
        ],
        capture_output=True,
        text=True,
    )
    assert probe.returncode != 0 and "Permission denied" in probe.stderr


# --- --legacy: the version 1 copy at the top of C -------------------------------------------


def make_v1_copy(c: Path, age: float = 3600.0) -> set[str]:
    """What version 1 left in C: the data at its top, its metadata in C/.dscache
    (last changed ``age`` seconds ago). Returns the top-level names it made."""
    for rel, body in {"train/0/a.jpg": b"v1a", "train/1/b.jpg": b"v1b", "labels.csv": b"x,y"}.items():
        p = c / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body)
    meta = c / ".dscache"
    (meta / "tmp").mkdir(parents=True)
    for name in ("lock", "manifest.jsonl", "complete"):
        (meta / name).write_text("")
    age_v1_traces(c, age)
    return {"train", "labels.csv", ".dscache"}


def age_v1_traces(c: Path, age: float) -> None:
    """Make version 1's last run ``age`` seconds old."""
    then = time.time() - age
    for p in (c / ".dscache").iterdir():
        os.utime(p, (then, then), follow_symlinks=False)


def current_tree(c: Path) -> dict[str, bytes | None]:
    """Every path under revs/ and leases/ (and the lock), with file bytes."""
    out: dict[str, bytes | None] = {"lock": (c / "lock").read_bytes()}
    for top in ("revs", "leases"):
        for p in sorted((c / top).rglob("*")):
            out[str(p.relative_to(c))] = p.read_bytes() if p.is_file() else None
    return out


def test_legacy_removes_only_the_version_1_entries(root: Path):
    c = C(root)
    (c / "lock").write_text("")
    before = current_tree(c)
    v1 = make_v1_copy(c)
    out = wipe(WipeArgs(str(c), str(root), legacy=True))
    assert (out.existed, out.removed, out.legacy, out.legacy_entries) == (True, True, True, len(v1))
    assert sorted(os.listdir(c)) == ["leases", "lock", "revs"]
    assert current_tree(c) == before  # every revision, lease and the lock: byte for byte
    again = wipe(WipeArgs(str(c), str(root), legacy=True))
    assert (again.existed, again.removed, again.legacy_entries) == (False, False, 0)


def test_legacy_on_a_cache_dir_that_only_has_a_version_1_copy(tmp_path: Path):
    root = tmp_path / "r"
    c = root / "ns" / "ds"
    make_v1_copy(c)
    assert wipe(WipeArgs(str(c), str(root), legacy=True)).removed
    # C stays (it is the pods' mount source), with the current layout's lock in it.
    assert os.listdir(c) == ["lock"]
    assert not wipe(WipeArgs(str(root / "ns" / "gone"), str(root), legacy=True)).existed


def test_legacy_waits_for_a_version_1_stager_that_holds_its_lock(root: Path):
    c = C(root)
    make_v1_copy(c)
    fd = os.open(c / ".dscache" / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(BusyError, match="version 1 stager is staging"):
            wipe(WipeArgs(str(c), str(root), legacy=True))
    finally:
        os.close(fd)
    assert (c / "train/0/a.jpg").read_bytes() == b"v1a"
    assert wipe(WipeArgs(str(c), str(root), legacy=True)).removed


def test_legacy_waits_until_version_1_has_been_quiet(root: Path):
    """A version 1 stager that finished moments ago changed C/.dscache: its pod may be
    reading the copy already, before the operator's view shows that pod."""
    c = C(root)
    make_v1_copy(c, age=5)
    with pytest.raises(BusyError, match=r"ran in .* 5 s ago"):
        wipe(WipeArgs(str(c), str(root), legacy=True))
    assert (c / "train/1/b.jpg").read_bytes() == b"v1b" and (c / ".dscache").is_dir()
    age_v1_traces(c, wipe_mod.LEGACY_QUIET_S + 1)
    assert wipe(WipeArgs(str(c), str(root), legacy=True)).removed


def test_legacy_is_busy_while_a_current_stager_holds_the_lock(root: Path):
    c = C(root)
    make_v1_copy(c)
    with cache_lock(str(c)), pytest.raises(BusyError, match="locked by a running stager"):
        wipe(WipeArgs(str(c), str(root), legacy=True))
    assert (c / "labels.csv").exists()


def test_legacy_never_follows_symlinks(root: Path, outside: Path):
    c = C(root)
    make_v1_copy(c)
    (c / "escape").symlink_to(outside)
    (c / "file-link").symlink_to(outside / "keep.txt")
    (c / "train" / "inner").symlink_to(outside)
    out = wipe(WipeArgs(str(c), str(root), legacy=True))
    assert out.removed and out.legacy_entries == 5
    assert (outside / "keep.txt").read_text() == "keep" and sorted(os.listdir(outside)) == ["keep.txt"]
    assert sorted(os.listdir(c)) == ["leases", "lock", "revs"]


def test_legacy_with_a_symlinked_v1_meta_dir_takes_no_lock_through_it(root: Path, outside: Path):
    c = C(root)
    (outside / "lock").write_text("")
    (c / ".dscache").symlink_to(outside)
    fd = os.open(outside / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a lock outside the root must not matter (nor be touched)
    try:
        assert wipe(WipeArgs(str(c), str(root), legacy=True)).removed
    finally:
        os.close(fd)
    assert not os.path.lexists(c / ".dscache") and (outside / "lock").exists()


def test_legacy_cli_json_and_usage(root: Path, tmp_path: Path):
    c = C(root)
    make_v1_copy(c)
    ok = _cli(str(c), "--root", str(root), "--legacy", "--termination-log", str(tmp_path / "t"))
    assert ok.returncode == 0, ok.stderr
    got = json.loads(ok.stdout)
    assert (got["legacy"], got["removed"], got["legacy_entries"], got["revision"]) == (True, True, 3, None)
    assert json.loads((tmp_path / "t").read_text()) == got
    bad = _cli(str(c), "--root", str(root), "--legacy", "--release", "u1")
    assert bad.returncode == 2 and "takes no --release" in bad.stderr
    assert (c / "revs" / R1).is_dir() and sorted(os.listdir(c / "leases" / R1)) == ["u1", "u2"]


@pytest.mark.parametrize("missing", [".dscache/lock", ".dscache"])
def test_legacy_makes_and_holds_version_1_lock_so_a_starting_v1_stager_waits(
    root: Path, monkeypatch: pytest.MonkeyPatch, missing: str
):
    """Without a lock to take, a version 1 stager starting mid-delete could stage
    into entries being removed. The wipe makes version 1's lock and holds it: that
    stager (whose locked() makes .dscache and the lock, then blocks) waits, and
    afterwards finds its lock file unlinked, so it starts over on a fresh copy."""
    c = C(root)
    make_v1_copy(c)
    target = c / missing
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    deleting, go_on = threading.Event(), threading.Event()
    real_remove = wipe_mod.remove_tree

    def slow_remove(path: str) -> None:
        deleting.set()
        go_on.wait(10)
        real_remove(path)

    monkeypatch.setattr(wipe_mod, "remove_tree", slow_remove)
    out: dict = {}
    w = threading.Thread(target=lambda: out.setdefault("wipe", wipe(WipeArgs(str(c), str(root), legacy=True))))
    w.start()
    try:
        assert deleting.wait(10)
        # What version 1's Layout.locked() does: make .dscache, open (creating) the lock, flock it.
        os.makedirs(c / ".dscache", exist_ok=True)
        fd = os.open(c / ".dscache" / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        go_on.set()
        w.join(10)
    assert out["wipe"].removed and out["wipe"].legacy_entries == (2 if missing == ".dscache" else 3)
    assert sorted(os.listdir(c)) == ["leases", "lock", "revs"]
