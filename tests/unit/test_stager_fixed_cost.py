"""A copy's fixed cost (issue 30): what a cold start imports and reads, and the shortcuts taken for it.

The figures are bench/stager.py's (--sets fixed); these tests hold the mechanisms in place:
modules that a cold start without peers must not import, the contract's lazy package, the
TLS roots read on plain HTTP, the parser's help width and garbage collection at start-up.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest

import dscache_contract
from dscache_contract import args as contract_args
from dscache_stager import stage
from dscache_stager.errors import SourceError
from dscache_stager.source import S3Source, roots_from_one_file

CONTRACT_INIT = Path(dscache_contract.__file__)

# Imported by a cold start without peers, they cost it files and CPU (each measured in the issue):
# shutil brings zlib, bz2 and lzma; the peers' modules http.client and email; the idna codec
# unicodedata; versions.py's email.utils only the operator needs.
NOT_ON_A_COLD_START = (
    "shutil",
    "zlib",
    "bz2",
    "lzma",
    "http.client",
    "email.utils",
    "encodings.idna",
    "unicodedata",
    "dscache_stager.peers",
    "dscache_contract.peers",
    "dscache_contract.node",
)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_cold_start_without_peers_imports_none_of_the_costly_modules() -> None:
    """What `dscache-stage sync` imports up to the copy: the parse, the source, the endpoint check,
    the cold path's modules and the native plane, in a fresh interpreter."""
    port = _closed_port()
    code = f"""
import json, sys
from dscache_contract import StageArgs, build_parser
from dscache_stager import stage, sync, native
from dscache_stager.source import S3Source
ns = build_parser().parse_args(["sync", "s3://b/p", "/tmp/c", "--revision", "r-0123456789abcdef0123"])
StageArgs.from_namespace(ns)
src = S3Source.parse("s3://b/p", endpoint_url="http://localhost:{port}")
try:
    src.check_reachable(timeout=1)
except Exception as e:
    assert "cannot reach" in str(e), e
native.load()
print(json.dumps(sorted(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out))
    assert "asyncio" in loaded and "dscache_stager.sync" in loaded  # the probe did import the cold path
    assert sorted(loaded & set(NOT_ON_A_COLD_START)) == []


def test_the_contract_imports_only_what_is_used() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; from dscache_contract import StageSummary, lock_path; print(json.dumps(sorted(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    loaded = set(json.loads(out))
    assert "dscache_contract.summary" in loaded and "dscache_contract.paths" in loaded
    for heavy in ("dscache_contract.versions", "dscache_contract.node", "dscache_contract.peers", "email.utils"):
        assert heavy not in loaded, heavy


def test_every_public_name_of_the_contract_resolves_to_its_module() -> None:
    for name in dscache_contract.__all__:
        value = getattr(dscache_contract, name)
        module = sys.modules[f"dscache_contract.{dscache_contract._WHERE[name]}"]
        assert value is getattr(module, name), name
    assert set(dscache_contract.__all__) <= set(dir(dscache_contract))
    with pytest.raises(AttributeError):
        _ = dscache_contract.no_such_name  # type: ignore[attr-defined]


def test_the_lazy_table_names_what_mypy_sees() -> None:
    """_WHERE (runtime) and the TYPE_CHECKING imports (mypy) list the same names from the same modules."""
    tree = ast.parse(CONTRACT_INIT.read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                typed.update({a.name: imp.module for a in imp.names})
    assert typed == dscache_contract._WHERE
    assert set(typed) == set(dscache_contract.__all__)


@pytest.fixture
def tls_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")


def test_plain_http_reads_its_roots_from_the_bundle_only(tls_env: None, tmp_path: Path) -> None:
    bundle = tmp_path / "ca-certificates.crt"
    bundle.write_text("")
    src = S3Source.parse("s3://b/p", endpoint_url="http://minio:9000")
    assert roots_from_one_file(src, (str(tmp_path / "absent.pem"), str(bundle)))
    assert os.environ["SSL_CERT_FILE"] == str(bundle)
    assert os.environ["SSL_CERT_DIR"] == ""


def test_plain_http_keeps_the_bundle_it_was_given(
    tls_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = tmp_path / "mine.pem"
    mine.write_text("")
    monkeypatch.setenv("SSL_CERT_FILE", str(mine))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))
    assert roots_from_one_file(S3Source.parse("s3://b/p", endpoint_url="http://minio:9000"), ())
    assert (os.environ["SSL_CERT_FILE"], os.environ["SSL_CERT_DIR"]) == (str(mine), "")


@pytest.mark.parametrize("endpoint", [None, "https://s3.example.com"])
def test_tls_endpoints_keep_every_root(tls_env: None, tmp_path: Path, endpoint: str | None) -> None:
    bundle = tmp_path / "ca.crt"
    bundle.write_text("")
    assert not roots_from_one_file(S3Source.parse("s3://b/p", endpoint_url=endpoint), (str(bundle),))
    assert "SSL_CERT_FILE" not in os.environ and "SSL_CERT_DIR" not in os.environ


def test_other_credentials_keep_every_root(tls_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Web identity (IRSA) asks STS over HTTPS, whatever the endpoint.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    bundle = tmp_path / "ca.crt"
    bundle.write_text("")
    assert not roots_from_one_file(S3Source.parse("s3://b/p", endpoint_url="http://minio:9000"), (str(bundle),))
    assert "SSL_CERT_FILE" not in os.environ and "SSL_CERT_DIR" not in os.environ


def test_no_bundle_changes_nothing(tls_env: None, tmp_path: Path) -> None:
    assert not roots_from_one_file(S3Source.parse("s3://b/p", endpoint_url="http://minio:9000"), (str(tmp_path / "x"),))
    assert "SSL_CERT_FILE" not in os.environ and "SSL_CERT_DIR" not in os.environ


def test_the_endpoint_check_still_resolves_names() -> None:
    # A name (not an address) through getaddrinfo as bytes: refused, not unresolvable.
    with pytest.raises(SourceError, match="Connection refused"):
        S3Source.parse("s3://b/p", endpoint_url=f"http://localhost:{_closed_port()}").check_reachable(timeout=2)


@pytest.mark.parametrize("columns", ["37", "120", "0", "junk", None])
def test_the_help_is_as_wide_as_argparse_makes_it(monkeypatch: pytest.MonkeyPatch, columns: str | None) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    ours = contract_args._Formatter("dscache-stage")
    theirs = argparse.RawDescriptionHelpFormatter("dscache-stage")  # sized by shutil
    assert ours._width == theirs._width == shutil.get_terminal_size().columns - 2


def test_gc_comes_back_frozen_after_start_up() -> None:
    assert gc.isenabled()
    stage.gc_from_here()  # on already: nothing frozen (a test process keeps collecting all)
    assert gc.get_freeze_count() == 0
    gc.disable()
    try:
        stage.gc_from_here()
        assert gc.isenabled()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()


# The common path's S3 client (store.py): with the native module and static keys, a cold start
# lists, HEADs and copies through dscache_native alone; obstore's 15 MiB extension is not read.
COMMON_PATH = """
import json, sys
from dscache_stager import cli, fetch, listing, listpage, native, stage, store, sync
from dscache_stager.source import S3Source, source_error
listpage.LIST_ATTEMPTS = 1  # one try of the page below: the endpoint does not answer
src = S3Source.parse("s3://b/p", endpoint_url="http://127.0.0.1:{port}", retry_timeout=0.2)
client = store.open_store(src, 8)
failures = []
for request in (lambda: client.head("p/k") if isinstance(client, store.NativeStore) else store.head(client, "p/k"),
                lambda: listpage.first_page(client, src.prefix)):
    try:
        request()
    except Exception as e:
        failures.append([store.kind(e), str(source_error(e, src, 0))])
print(json.dumps({{"client": type(client).__name__, "failures": failures,
                  "obstore": sorted(m for m in sys.modules if m.split(".")[0] == "obstore")}}))
"""


def _common_path(env: dict[str, str]) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "DSCACHE_NATIVE"}
    code = COMMON_PATH.format(port=_closed_port())
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}, timeout=60)
    assert p.returncode == 0, p.stderr
    out: dict[str, object] = json.loads(p.stdout)
    return out


STATIC_KEYS = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}


def test_the_common_path_never_imports_obstore() -> None:
    """Every module of a cold start, the client it opens and its failures (as the stager words
    them): all without obstore, when the native module loads and the keys are static."""
    pytest.importorskip("dscache_native")
    got = _common_path(STATIC_KEYS)
    assert got["client"] == "NativeStore"
    assert got["obstore"] == []
    failures = got["failures"]
    assert isinstance(failures, list) and len(failures) == 2
    for kind, message in failures:
        assert kind == "generic" and "cannot reach the S3 endpoint" in message, (kind, message)


def test_without_the_native_plane_obstore_is_the_client() -> None:
    """The fallback (DSCACHE_NATIVE=0, as without the extension): obstore's client, its failures alike."""
    got = _common_path({**STATIC_KEYS, "DSCACHE_NATIVE": "0"})
    assert got["client"] == "S3Store"
    assert "obstore" in cast(list[str], got["obstore"])
    failures = got["failures"]
    assert isinstance(failures, list) and len(failures) == 2
    for kind, message in failures:
        assert kind == "generic" and "cannot reach the S3 endpoint" in message, (kind, message)
