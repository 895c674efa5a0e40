"""A small STS that speaks AssumeRoleWithWebIdentity and really checks the token.

Our S3 server (versitygw) has no STS, and MinIO (which has one) is not served
here, so the tests of pod identity use this one. It is stdlib only (one file), so
the e2e suite runs it in a pod of the stager image: ``python sts.py --config
FILE --port 8080`` reads the cluster's keys with its own ServiceAccount token.

What it checks, for every request, before it hands out anything:
- the JWT's signature (RS256 in pure Python, ES256 with ``cryptography`` when it
  is installed) against the API server's JWKS (``/openid/v1/jwks``, fetched again
  when a token names a key id it has not seen);
- ``iss`` is the API server's service-account issuer (``issuer`` of its
  ``/.well-known/openid-configuration``);
- ``aud`` holds the audience it is configured with (``sts.amazonaws.com``);
- ``exp`` is in the future and ``nbf``/``iat`` are not (30 s of clock skew);
- ``sub`` is exactly the subject the requested role trusts
  (``system:serviceaccount:NS:NAME``, configured per role ARN).
On success it answers with AWS's XML and the S3 keys configured for that role
(in the tests: a versitygw IAM user that owns the bucket); any failure gets
AWS's AccessDenied error XML (HTTP 403) with the reason.

versitygw refuses requests that carry a session token it did not issue, so the
credentials carry an empty SessionToken (botocore then sends none).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import hashlib
import hmac
import http.server
import json
import os
import ssl
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any
from xml.sax.saxutils import escape

NS = "https://sts.amazonaws.com/doc/2011-06-15/"
#: The API server serves the JWKS as application/jwk-set+json only (406 for application/json alone).
ACCEPT = "application/json, application/jwk-set+json"
SKEW = 30.0
#: DER prefix of a SHA-256 DigestInfo (RFC 8017, 9.2): what an RS256 signature wraps.
_SHA256_INFO = bytes.fromhex("3031300d060960864801650304020105000420")


class Refused(Exception):
    """The token or the request does not pass; the message says which check failed."""


@dataclasses.dataclass(frozen=True)
class Role:
    #: The one subject this role trusts: system:serviceaccount:NS:NAME.
    subject: str
    access_key: str
    secret_key: str


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _int(part: str) -> int:
    return int.from_bytes(_b64(part), "big")


def _verify_rs256(jwk: dict[str, Any], signed: bytes, signature: bytes) -> bool:
    n, e = _int(jwk["n"]), _int(jwk["e"])
    k = (n.bit_length() + 7) // 8
    if len(signature) != k:
        return False
    em = pow(int.from_bytes(signature, "big"), e, n).to_bytes(k, "big")
    t = _SHA256_INFO + hashlib.sha256(signed).digest()
    want = b"\x00\x01" + b"\xff" * (k - len(t) - 3) + b"\x00" + t
    return hmac.compare_digest(em, want)


def _verify_es256(jwk: dict[str, Any], signed: bytes, signature: bytes) -> bool:
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
    except ImportError as e:  # the stager image has no cryptography; kind's keys are RSA
        raise Refused("ES256 tokens need the cryptography package in this STS") from e
    if len(signature) != 64:
        return False
    key = ec.EllipticCurvePublicNumbers(_int(jwk["x"]), _int(jwk["y"]), ec.SECP256R1()).public_key()
    der = encode_dss_signature(int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big"))
    try:
        key.verify(der, signed, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


class Verifier:
    """Checks Kubernetes ServiceAccount tokens against the API server's issuer and JWKS."""

    def __init__(self, fetch: Callable[[str], bytes], audience: str) -> None:
        #: fetch(path) -> body of a GET on the API server, authenticated.
        self.fetch, self.audience = fetch, audience
        self._keys: list[dict[str, Any]] = []
        self._issuer: str | None = None
        self._lock = threading.Lock()

    @property
    def issuer(self) -> str:
        if self._issuer is None:
            self._issuer = json.loads(self.fetch("/.well-known/openid-configuration"))["issuer"]
        return self._issuer

    def _jwks(self, kid: str | None) -> list[dict[str, Any]]:
        with self._lock:
            if not self._keys or (kid and not any(k.get("kid") == kid for k in self._keys)):
                self._keys = json.loads(self.fetch("/openid/v1/jwks"))["keys"]
            return list(self._keys)

    def claims(self, token: str) -> dict[str, Any]:
        """The token's claims once every check passed; Refused otherwise."""
        parts = token.split(".")
        if len(parts) != 3:
            raise Refused("not a JWT")
        try:
            header, claims, signature = json.loads(_b64(parts[0])), json.loads(_b64(parts[1])), _b64(parts[2])
        except ValueError as e:
            raise Refused(f"malformed JWT: {e}") from e
        alg, kid = header.get("alg"), header.get("kid")
        verify = {"RS256": _verify_rs256, "ES256": _verify_es256}.get(alg)
        if verify is None:
            raise Refused(f"unsupported alg {alg!r}")
        kty = "RSA" if alg == "RS256" else "EC"
        keys = [k for k in self._jwks(kid) if k.get("kty") == kty and (kid is None or k.get("kid") == kid)]
        signed = f"{parts[0]}.{parts[1]}".encode()
        if not any(verify(k, signed, signature) for k in keys):
            raise Refused("signature does not verify against the API server's JWKS")
        if claims.get("iss") != self.issuer:
            raise Refused(f"issuer {claims.get('iss')!r} is not the cluster's {self.issuer!r}")
        aud = claims.get("aud")
        auds = aud if isinstance(aud, list) else [aud]
        if self.audience not in auds:
            raise Refused(f"audience {aud!r} does not include {self.audience!r}")
        now = time.time()
        exp = claims.get("exp")
        if not isinstance(exp, (int, float)) or exp <= now:
            raise Refused("token expired")
        for claim in ("nbf", "iat"):
            at = claims.get(claim)
            if isinstance(at, (int, float)) and at > now + SKEW:
                raise Refused(f"token not valid yet ({claim})")
        return claims


def _xml_error(code: str, message: str) -> bytes:
    return (
        f'<ErrorResponse xmlns="{NS}"><Error><Type>Sender</Type><Code>{escape(code)}</Code>'
        f"<Message>{escape(message)}</Message></Error><RequestId>{uuid.uuid4()}</RequestId></ErrorResponse>"
    ).encode()


def _xml_credentials(role_arn: str, session: str, role: Role, subject: str, audience: str, seconds: int) -> bytes:
    expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    assumed = role_arn.replace(":role/", ":assumed-role/", 1) + f"/{session}"
    return (
        f'<AssumeRoleWithWebIdentityResponse xmlns="{NS}"><AssumeRoleWithWebIdentityResult>'
        f"<SubjectFromWebIdentityToken>{escape(subject)}</SubjectFromWebIdentityToken>"
        f"<Audience>{escape(audience)}</Audience>"
        f"<AssumedRoleUser><Arn>{escape(assumed)}</Arn><AssumedRoleId>AROA{uuid.uuid4().hex[:16].upper()}:"
        f"{escape(session)}</AssumedRoleId></AssumedRoleUser>"
        f"<Credentials><AccessKeyId>{escape(role.access_key)}</AccessKeyId>"
        f"<SecretAccessKey>{escape(role.secret_key)}</SecretAccessKey><SessionToken></SessionToken>"
        f"<Expiration>{expires.strftime('%Y-%m-%dT%H:%M:%SZ')}</Expiration></Credentials>"
        f"<Provider>kubernetes</Provider></AssumeRoleWithWebIdentityResult>"
        f"<ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId></ResponseMetadata>"
        f"</AssumeRoleWithWebIdentityResponse>"
    ).encode()


@dataclasses.dataclass
class STS:
    verifier: Verifier
    roles: dict[str, Role]
    host: str = "127.0.0.1"
    port: int = 0
    #: Longest credentials it grants (AWS's default for AssumeRoleWithWebIdentity: 1 h).
    max_seconds: int = 3600
    #: What it decided, in order: (role ARN, subject or None, "ok" or the refusal).
    decisions: list[tuple[str, str | None, str]] = dataclasses.field(default_factory=list)
    _server: http.server.ThreadingHTTPServer | None = dataclasses.field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def answer(self, form: dict[str, str]) -> tuple[int, bytes]:
        """One request's (HTTP status, XML body)."""
        role_arn = form.get("RoleArn", "")
        subject = None
        try:
            if form.get("Action") != "AssumeRoleWithWebIdentity":
                raise Refused(f"this STS speaks AssumeRoleWithWebIdentity only, not {form.get('Action')!r}")
            role = self.roles.get(role_arn)
            if role is None:
                raise Refused(f"no role {role_arn!r}")
            claims = self.verifier.claims(form.get("WebIdentityToken", ""))
            subject = claims.get("sub")
            if subject != role.subject:
                raise Refused(f"role {role_arn} trusts {role.subject}, not {subject}")
            seconds = min(int(form.get("DurationSeconds") or self.max_seconds), self.max_seconds)
        except Refused as e:
            self.decisions.append((role_arn, subject, str(e)))
            return 403, _xml_error("AccessDenied", f"Not authorized to perform sts:AssumeRoleWithWebIdentity: {e}")
        self.decisions.append((role_arn, subject, "ok"))
        session = form.get("RoleSessionName") or "session"
        return 200, _xml_credentials(role_arn, session, role, subject, self.verifier.audience, seconds)

    def start(self) -> STS:
        sts = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode()
                self._reply(dict(urllib.parse.parse_qsl(body)))

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self.send_response(200)
                    self.end_headers()
                    return
                self._reply(dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query)))

            def _reply(self, form: dict[str, str]) -> None:
                try:
                    status, body = sts.answer(form)
                except Exception as e:  # the API server unreachable, a bad JWKS: never hand out keys
                    status, body = 500, _xml_error("InternalFailure", f"{type(e).__name__}: {e}")
                self.send_response(status)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((self.host, self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="sts").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def in_cluster_fetch() -> Callable[[str], bytes]:
    """GETs on the API server with this pod's own ServiceAccount token (system:serviceaccounts
    may read the issuer's discovery documents: ClusterRole system:service-account-issuer-discovery)."""
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")

    def fetch(path: str) -> bytes:
        with open(f"{sa}/token") as f:
            token = f.read().strip()
        headers = {"Authorization": f"Bearer {token}", "Accept": ACCEPT}
        # The Service's address from the pod's environment, not its DNS name: a cluster may run
        # no DNS (e2e/kind has none), and the API server's certificate names the address too.
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        req = urllib.request.Request(f"https://{host}:{port}{path}", headers=headers)
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            body: bytes = resp.read()
            return body

    return fetch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="JSON: {audience, roles: {ARN: {subject, access_key, secret_key}}}")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    a = p.parse_args()
    with open(a.config) as f:
        conf = json.load(f)
    roles = {arn: Role(**r) for arn, r in conf["roles"].items()}
    sts = STS(Verifier(in_cluster_fetch(), conf.get("audience", "sts.amazonaws.com")), roles, a.host, a.port).start()
    print(f"sts listening on {sts.endpoint}", flush=True)
    last = 0
    while True:
        time.sleep(0.5)
        for decision in sts.decisions[last:]:
            print(json.dumps(decision), flush=True)  # kubectl logs shows what it decided
        last = len(sts.decisions)


if __name__ == "__main__":
    main()
