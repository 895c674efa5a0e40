"""Type stubs of the native data plane (native/src/lib.rs)."""

from collections.abc import Callable, Mapping

#: (access key id, secret access key, session token or None, seconds the three stay valid)
Credential = tuple[str, str, str | None, float]
#: (key, final path, ETag without quotes or "", versionId or None, listed size: what it takes of buffer_bytes)
Item = tuple[str, str, str, str | None, int]
#: (index in the batch, bytes written, ETag the GET answered with, unquoted)
Done = tuple[int, int, str]
#: (kind, errno, message, key); kind is one of gone, precondition, permission,
#: unauthenticated, generic, os, cancelled (and invalid_path from a listing)
Failure = tuple[str, int, str, str]

class Copier:
    def __init__(
        self,
        bucket: str,
        config: Mapping[str, str],
        *,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        skip_signature: bool = False,
        credential_provider: Callable[[], Credential] | None = None,
        workers: int = 1,
        concurrency: int = 64,
        buffer_bytes: int = 64 << 20,
        attempts: int = 5,
        parts: int = 16,
        splice: bool = False,
        tmpfile: bool = True,
        link_proc: bool = False,
    ) -> None: ...
    @property
    def workers(self) -> int: ...
    # grow: per item, a temp file its body is written into as it comes, for the node agent to pass
    # on meanwhile ("": written whole once it is in memory).
    def fetch(self, tmp_dir: str, items: list[Item], grow: list[str] = ...) -> tuple[list[Done], Failure | None]: ...
    # grow: the object's grow file, whose user.dscache.grown xattr says how much of it is there from
    # its start as the parts land ("": a temp file of its own).
    def fetch_large(
        self, tmp_dir: str, item: Item, part_bytes: int, grow: str = ...
    ) -> tuple[tuple[int, str] | None, Failure | None]: ...
    def counters(self) -> dict[str, int]: ...
    def cancel(self) -> None: ...

#: (key, size, ETag without quotes or "") of one listed object
Listed = tuple[str, int, str]

class Store:
    """Listing and HEADs (native/src/list.rs): the common path's S3 client besides the Copier."""

    def __init__(
        self,
        bucket: str,
        config: Mapping[str, str],
        *,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        skip_signature: bool = False,
        credential_provider: Callable[[], Credential] | None = None,
    ) -> None: ...
    def list(self, prefix: str, offset: str | None = None, chunk: int = 1000) -> Pages: ...
    def head(self, key: str) -> tuple[tuple[int, str] | None, Failure | None]: ...

class Pages:
    def next(self) -> tuple[list[Listed], Failure | None]: ...

#: (request target, listed size, ETag: a plain MD5 without quotes, temp path to create)
PeerItem = tuple[str, int, str, str]
#: (kind, HTTP status or errno, detail); kind is one of placed, status (detail: the 404 body's
#: "state"), suspect (detail: the body's MD5), lied, stalled, refused, transport, local, cancelled
PeerOutcome = tuple[str, int, str]

class PeerFetcher:
    def __init__(
        self,
        *,
        revision_header: str,
        ca_pem: str | None = None,
        tls_name: str = "",
        workers: int = 1,
        per_peer: int = 12,
        answer_timeout_s: float = 50.0,
        read_timeout_s: float = 30.0,
        min_rate: float = 1048576.0,
        idle_s: float = 10.0,
    ) -> None: ...
    # batch: (namespace, cache, each item's path under data/): the small items asked in one request
    # of the agents' batch path first (OBJECTS_BATCH_PATH), the rest alone.
    def fetch(
        self,
        addr: str,
        token: str,
        revision: str,
        items: list[PeerItem],
        batch: tuple[str, str, list[str]] | None = None,
    ) -> list[PeerOutcome]: ...
    def start(
        self,
        addr: str,
        token: str,
        revision: str,
        items: list[PeerItem],
        id: int,
        batch: tuple[str, str, list[str]] | None = None,
    ) -> None: ...
    def notify_fd(self) -> int: ...
    # (id, [(item's index, its outcome)]): each outcome as it comes, not a call's at once.
    def completed(self) -> list[tuple[int, list[tuple[int, PeerOutcome]]]]: ...
    def cancel(self) -> None: ...

def version() -> str: ...
