"""Where the data comes from: an ``s3://bucket/prefix`` and how to reach it."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from dscache_contract import parse_source, resolve_addressing_style, resolve_region

from .errors import SourceError, StageError, TransientError, UsageError
from .store import kind

if TYPE_CHECKING:
    # obstore is imported where its client is opened (open_store): the common path lists and
    # copies through dscache_native alone (store.py).
    from obstore.store import ClientConfig, RetryConfig, S3Config, S3Store

AddressingStyle = Literal["path", "virtual"]
# obstore's own per-request retry budget; see open_store.
DEFAULT_RETRY_TIMEOUT = 120.0
# The client's timeouts and backoff, one set for obstore and the native data
# plane (native.py), so both paths talk to S3 alike.
CONNECT_TIMEOUT_S = 5
TIMEOUT_S = 300
MAX_RETRIES = 10
INIT_BACKOFF_MS = 100
MAX_BACKOFF_S = 10
BACKOFF_BASE = 2


@dataclass(frozen=True)
class S3Source:
    bucket: str
    prefix: str  # "" or a directory ending in "/": s3://b/a/b means s3://b/a/b/
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: AddressingStyle | None = None
    retry_timeout: float = DEFAULT_RETRY_TIMEOUT

    @classmethod
    def parse(cls, uri: str, **kw: Any) -> S3Source:
        try:
            bucket, prefix = parse_source(uri)
        except ValueError as e:
            raise UsageError(str(e)) from e
        return cls(bucket=bucket, prefix=prefix, **kw)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def relative(self, key: str) -> str:
        """The path of ``key`` under DEST: the key minus the prefix."""
        return key[len(self.prefix) :]

    def check_reachable(self, timeout: float = 5.0) -> None:
        """Fail in seconds, not after a minute of retries, when a custom endpoint is down."""
        if not self.endpoint_url:
            return
        url = urlsplit(self.endpoint_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UsageError(f"--endpoint-url must look like https://HOST[:PORT], got {self.endpoint_url!r}")
        port = url.port or (443 if url.scheme == "https" else 80)
        # An ASCII name as bytes: a str goes through the idna codec in getaddrinfo, whose import
        # (stringprep, unicodedata) cost a cold start ~2 ms and four files; the bytes are the same.
        host: str | bytes = url.hostname.encode("ascii") if url.hostname.isascii() else url.hostname
        try:
            socket.create_connection((host, port), timeout=timeout).close()  # type: ignore[arg-type]  # (bytes: as getaddrinfo)
        except OSError as e:
            raise SourceError(
                f"cannot reach the S3 endpoint {self.endpoint_url}: {e.strerror or e}; "
                f"check the endpoint URL and that the network allows it"
            ) from e

    def open_store(self, concurrency: int) -> S3Store:
        """An obstore client with pooled connections and retries with jittered backoff.

        obstore retries 5xx (including 503 SlowDown), dropped connections and
        timeouts with exponential backoff and jitter; 4xx errors fail at once.
        The fallback's, and fetch.py's (store.open_store says when).
        """
        from obstore.store import S3Store

        # Region and addressing style come from the contract, so the operator's
        # source check talks to the bucket exactly as we do.
        config: S3Config = {"region": resolve_region(self.region)}
        if self.endpoint_url:
            config["endpoint"] = self.endpoint_url
        style = resolve_addressing_style(self.endpoint_url, self.addressing_style)
        config["virtual_hosted_style_request"] = style == "virtual"
        client_options: ClientConfig = {
            "allow_http": self.allow_http,
            "connect_timeout": f"{CONNECT_TIMEOUT_S}s",
            "timeout": f"{TIMEOUT_S}s",
            "pool_max_idle_per_host": str(max(concurrency, 16)),
        }
        retry: RetryConfig = {
            "max_retries": MAX_RETRIES,
            "retry_timeout": timedelta(seconds=self.retry_timeout),
            "backoff": {
                "init_backoff": timedelta(milliseconds=INIT_BACKOFF_MS),
                "max_backoff": timedelta(seconds=MAX_BACKOFF_S),
                "base": BACKOFF_BASE,
            },
        }
        return S3Store(
            self.bucket,
            config=config,
            client_options=client_options,
            retry_config=retry,
            **credentials_for_store(),
        )

    @property
    def allow_http(self) -> bool:
        return bool(self.endpoint_url and self.endpoint_url.startswith("http://"))

    def store_settings(self, concurrency: int) -> dict[str, str]:
        """open_store's settings as the native data plane takes them (native/src/settings.rs)."""
        settings = {
            "region": resolve_region(self.region),
            "virtual_hosted_style_request": str(
                resolve_addressing_style(self.endpoint_url, self.addressing_style) == "virtual"
            ).lower(),
            "allow_http": str(self.allow_http).lower(),
            "connect_timeout_ms": str(CONNECT_TIMEOUT_S * 1000),
            "timeout_ms": str(TIMEOUT_S * 1000),
            "pool_max_idle_per_host": str(max(concurrency, 16)),
            "max_retries": str(MAX_RETRIES),
            "retry_timeout_ms": str(round(self.retry_timeout * 1000)),
            "init_backoff_ms": str(INIT_BACKOFF_MS),
            "max_backoff_ms": str(MAX_BACKOFF_S * 1000),
            "backoff_base": str(BACKOFF_BASE),
        }
        if self.endpoint_url:
            settings["endpoint"] = self.endpoint_url
        return settings


#: One file holding every trusted root, where distributions keep it (openssl-probe's list, which
#: rustls-native-certs follows; the stager image is Debian's).
CA_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
)


def roots_from_one_file(source: S3Source, bundles: tuple[str, ...] = CA_BUNDLES) -> bool:
    """On a plain-HTTP endpoint, make the S3 clients load their TLS roots from one file, not two.

    obstore's client and the native plane's each load the system's roots when built
    (rustls-native-certs): the bundle file, then every file of /etc/ssl/certs (~140
    certificates, each opened, read and parsed; also when SSL_CERT_DIR names it). Over
    plain HTTP no handshake uses them, yet the directory cost each client ~5 ms of CPU
    (9 after a page-cache drop, as bench/stager.py's fixed set makes) and ~25 ms of
    wall after the drop: about 150 small reads. SSL_CERT_FILE alone (the one set, else
    the system's bundle) with SSL_CERT_DIR empty (which the loader skips) is one read,
    and still the distribution's whole set for anything that does make a TLS connection.
    HTTPS endpoints keep both: a root added to the directory only stays trusted; so
    do other credentials than static keys (web identity asks STS over HTTPS). The
    environment is the process's: cli.entry calls this in dscache-stage's own process,
    before any thread starts. Returns whether it narrowed anything.
    """
    static_keys = os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not source.allow_http or not static_keys:
        return False
    bundle = os.environ.get("SSL_CERT_FILE") or next((b for b in bundles if os.path.isfile(b)), None)
    if bundle is None or not os.path.isfile(bundle):
        return False
    os.environ["SSL_CERT_FILE"] = bundle
    os.environ["SSL_CERT_DIR"] = ""
    return True


def credentials_for_store() -> dict[str, Any]:
    """Credentials from the standard AWS chain, as S3Store keyword arguments.

    Static keys in the environment are the first link of boto3's chain, so
    they are passed straight through: importing boto3 costs ~0.3 s, which
    would dominate a warm restart. Anything else (web identity for IRSA,
    profiles, SSO, container and instance roles) goes through boto3's own
    chain, refreshed by obstore when it expires.
    """
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        creds = {"access_key_id": key, "secret_access_key": secret}
        if token := os.environ.get("AWS_SESSION_TOKEN"):
            creds["session_token"] = token
        return creds
    import boto3
    from obstore.auth.boto3 import Boto3CredentialProvider

    session = boto3.Session()
    if session.get_credentials() is None:
        # Public buckets work without credentials; say so only if S3 refuses.
        return {"skip_signature": True}
    return {"credential_provider": Boto3CredentialProvider(session)}


def source_error(e: Exception, source: S3Source, fetched: int) -> StageError:
    """An S3 client's failure (obstore's or dscache_native's, store.kind) as the stager reports
    it: access (3), or S3 kept failing (7)."""
    text = (str(e) or type(e).__name__).split("\n")[0]
    where = f"{source.uri}" + (f" at {source.endpoint_url}" if source.endpoint_url else "")
    if "AssumeRoleWithWebIdentity" in text:
        # Pod identity: STS refused this pod's projected token, before any request to S3.
        return SourceError(
            f"STS refused this pod's web identity for {where} (role {os.environ.get('AWS_ROLE_ARN')}, "
            f"token {os.environ.get('AWS_WEB_IDENTITY_TOKEN_FILE')}): the role's trust policy must allow "
            f"the pod's ServiceAccount (system:serviceaccount:NAMESPACE:NAME) with the token's audience "
            f"({text})"
        )
    # "403" as a word: the message holds the endpoint's URL, whose port may be 41403.
    if kind(e) in ("permission", "unauthenticated") or "AccessDenied" in str(e) or re.search(r"\b403\b", text):
        return SourceError(
            f"access denied to {where} with this pod's credentials: check the credentials "
            f"Secret (or the pod's IAM role) and that the bucket policy allows ListBucket and "
            f"GetObject; a copy already on the node is not served without access ({text})"
        )
    if "NoSuchBucket" in str(e):
        return SourceError(
            f"no such bucket: {source.bucket} at {source.endpoint_url or 'AWS S3'}; "
            f"check the bucket name, region and endpoint"
        )
    if (
        any(s in str(e) for s in ("error sending request", "Connection refused", "dns error", "connect"))
        and fetched == 0
    ):
        return SourceError(
            f"cannot reach the S3 endpoint for {where}: check the endpoint URL and network policy ({text})"
        )
    return TransientError(f"S3 kept failing for {where} after retries with backoff: {text}; re-run to resume")
