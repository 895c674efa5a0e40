"""Pod identity (issue 29) against the real kube-apiserver, versitygw and a checking STS.

The STS (tests/support/sts.py) verifies each ServiceAccount token against the test
API server's own issuer and JWKS (it has a service-account issuer and signing key:
tests/support/kubeapi.py), and hands out the keys of a versitygw IAM user that owns
the bucket only to the subject the role trusts. The controller and the webhook run
with DSCACHE_STS_ENDPOINT pointing at it (restarted for this module, then put back).
"""

from __future__ import annotations

import base64
import http.client
import json
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from tests.integration.test_operator_api import DSC, condition, create_job, get_cache, job_body, wait_phase
from tests.support.kubeapi import ApiError, KubeAPI, Operator
from tests.support.s3server import S3Server
from tests.support.stager import data_dir, data_tree, expected_tree, stage, stage_env
from tests.support.sts import ACCEPT, STS, Role, Verifier

pytestmark = pytest.mark.integration

AUDIENCE = "sts.amazonaws.com"
FILES = {"data/a.bin": b"a" * 10, "data/b.bin": b"b" * 20, "data/sub/c.bin": b"c" * 30}
ROLE = "arn:aws:iam::000000000000:role/dataset-reader"
USER, USER_SECRET = "dataset-reader", "dataset-reader-secret"


@pytest.fixture(scope="module")
def iam_s3(tmp_path_factory: pytest.TempPathFactory):
    """versitygw with its internal IAM: a bucket owned by an IAM user (not root)."""
    d = tmp_path_factory.mktemp("iam-s3")
    server = S3Server(root=d / "data", iam_dir=d / "iam").start()
    server.make_bucket("ident")
    server.put_tree("ident", FILES)
    server.add_user(USER, USER_SECRET, owns="ident")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ident_ns(kube_api: KubeAPI) -> str:
    return kube_api.namespace("ml-ident", {"dscache.io/injection": "enabled"})


def subject(ns: str, name: str) -> str:
    return f"system:serviceaccount:{ns}:{name}"


@pytest.fixture(scope="module")
def sts(kube_api: KubeAPI, ident_ns: str):
    def fetch(path: str) -> bytes:
        # As the admin (the test API server's client certificate), with the JWKS's own media type.
        conn = http.client.HTTPSConnection("127.0.0.1", kube_api.port, context=kube_api._ssl(), timeout=10)
        try:
            conn.request("GET", path, headers={"Accept": ACCEPT})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        assert resp.status == 200, (path, resp.status, body)
        return body

    # The role trusts exactly one ServiceAccount: `reader` of the test namespace.
    server = STS(Verifier(fetch, AUDIENCE), {ROLE: Role(subject(ident_ns, "reader"), USER, USER_SECRET)}).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def operator_with_sts(dscache_operator: Operator, sts: STS):
    """The controller and the webhook with the chart's podIdentity.stsEndpoint set."""
    roles = ("controller", "webhook")
    for role in roles:
        dscache_operator.stop(role)
    dscache_operator.extra_env["DSCACHE_STS_ENDPOINT"] = sts.endpoint
    for role in roles:
        dscache_operator.start(role)
    yield dscache_operator
    for role in roles:
        dscache_operator.stop(role)
    dscache_operator.extra_env.pop("DSCACHE_STS_ENDPOINT")
    for role in roles:
        dscache_operator.start(role)


def settle(k: KubeAPI, op: Operator, ns: str, name: str, phase: str) -> dict:
    """The cache once in ``phase``; on a timeout, its status and the controller's log say why."""
    try:
        return wait_phase(k, ns, name, phase, timeout=60)
    except AssertionError as e:
        status = (get_cache(k, ns, name) or {}).get("status")
        raise AssertionError(f"{e}\nstatus: {status}\ncontroller: {op.log('controller')[-3000:]}") from None


def service_account(k: KubeAPI, ns: str, name: str, role: str | None = ROLE) -> None:
    annotations = {"eks.amazonaws.com/role-arn": role} if role else {}
    try:
        k.create(
            f"/api/v1/namespaces/{ns}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "annotations": annotations}},
        )
    except ApiError as e:
        if e.status != 409:
            raise


def token(k: KubeAPI, ns: str, name: str, audience: str = AUDIENCE, seconds: int = 600) -> str:
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest"}
    body["spec"] = {"audiences": [audience], "expirationSeconds": seconds}
    got = k.create(f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token", body)
    return str(got["status"]["token"])


def sa_cache(k: KubeAPI, ns: str, name: str, server: S3Server, account: str) -> None:
    source = {
        "uri": "s3://ident/data/",
        "endpoint": server.endpoint,
        "region": "us-east-1",
        "addressingStyle": "path",
        "serviceAccountName": account,
    }
    body = {
        "apiVersion": "dscache.io/v1alpha1",
        "kind": "DatasetCache",
        "metadata": {"name": name},
        "spec": {"source": source, "mountPath": "/data"},
    }
    k.create(DSC.format(ns=ns), body)


def test_a_service_account_cache_pins_a_revision(kube_api, operator_with_sts, iam_s3, sts, ident_ns):
    service_account(kube_api, ident_ns, "reader")
    sa_cache(kube_api, ident_ns, "by-sa", iam_s3, "reader")
    c = settle(kube_api, operator_with_sts, ident_ns, "by-sa", "Ready")
    got = condition(c)
    assert (got["status"], got["reason"]) == ("True", "Listed"), got
    status = c["status"]
    assert (status["objects"], status["bytes"]) == (3, 60)
    # The very revision the bucket's owner would pin (the contract's digest over the listing).
    bucket_owner = iam_s3.client()
    want = contract.pin(bucket_owner, "ident", contract.Selection.from_source("s3://ident/data/", [], []))
    assert status["revision"]["id"] == want.revision
    assert (ROLE, subject(ident_ns, "reader"), "ok") in sts.decisions


def test_a_token_of_another_service_account_is_refused(kube_api, operator_with_sts, iam_s3, sts, ident_ns):
    # `intruder` claims the same role, but the role trusts only `reader`.
    service_account(kube_api, ident_ns, "intruder")
    sa_cache(kube_api, ident_ns, "by-intruder", iam_s3, "intruder")
    c = settle(kube_api, operator_with_sts, ident_ns, "by-intruder", "Failed")
    got = condition(c)
    assert (got["status"], got["reason"]) == ("False", "IdentityRefused"), got
    assert "AccessDenied" in got["message"] and subject(ident_ns, "intruder") in got["message"], got
    assert not c["status"].get("revision")
    refused = [d for d in sts.decisions if d[1] == subject(ident_ns, "intruder")]
    assert refused and refused[-1][2] == f"role {ROLE} trusts {subject(ident_ns, 'reader')}, not {refused[-1][1]}"
    # And a Job naming it is refused, saying why.
    with pytest.raises(ApiError) as e:
        create_job(kube_api, ident_ns, job_body("train-intruder", "by-intruder"))
    assert "IdentityRefused" in e.value.body


def test_a_service_account_without_a_role_says_so(kube_api, operator_with_sts, iam_s3, ident_ns):
    service_account(kube_api, ident_ns, "plain", role=None)
    sa_cache(kube_api, ident_ns, "by-plain", iam_s3, "plain")
    got = condition(settle(kube_api, operator_with_sts, ident_ns, "by-plain", "Failed"))
    assert got["reason"] == "RoleNotAnnotated" and "eks.amazonaws.com/role-arn" in got["message"], got


def test_secret_and_service_account_together_are_rejected(kube_api, operator_with_sts, ident_ns):
    source = {"uri": "s3://ident/data/", "serviceAccountName": "reader", "credentials": {"secretRef": {"name": "k"}}}
    body = {"apiVersion": "dscache.io/v1alpha1", "kind": "DatasetCache", "metadata": {"name": "both"}}
    body["spec"] = {"source": source, "mountPath": "/data"}
    with pytest.raises(ApiError) as e:
        kube_api.create(DSC.format(ns=ident_ns), body)
    assert e.value.status == 422 and "not both" in e.value.body, e.value.body


def _forge(real: str) -> str:
    """The real token's header and signature, with its subject changed."""
    head, claims, sig = real.split(".")
    body = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
    body["sub"] = body["sub"].replace(":intruder", ":reader")
    forged = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    return f"{head}.{forged}.{sig}"


def test_the_sts_checks_signature_issuer_audience_and_subject(kube_api, sts, ident_ns):
    service_account(kube_api, ident_ns, "reader")
    service_account(kube_api, ident_ns, "intruder")

    def ask(tok: str) -> tuple[int, str]:
        status, body = sts.answer(
            {"Action": "AssumeRoleWithWebIdentity", "RoleArn": ROLE, "RoleSessionName": "t", "WebIdentityToken": tok}
        )
        return status, body.decode()

    status, body = ask(token(kube_api, ident_ns, "reader"))
    assert status == 200 and f"<AccessKeyId>{USER}</AccessKeyId>" in body
    for tok, why in [
        (token(kube_api, ident_ns, "intruder"), "trusts"),
        (token(kube_api, ident_ns, "reader", audience="some-other-audience"), "audience"),
        (_forge(token(kube_api, ident_ns, "intruder")), "signature"),
        ("not-a-jwt", "not a JWT"),
    ]:
        status, body = ask(tok)
        assert status == 403 and "<Code>AccessDenied</Code>" in body and why in body, body
        assert USER_SECRET not in body


@pytest.mark.parametrize("data_plane", ["native", "python"], indirect=True)
def test_the_stager_uses_its_pods_web_identity(kube_api, iam_s3, sts, ident_ns, tmp_path: Path, data_plane):
    """IRSA's variables as the webhook sets them: boto3's web-identity provider goes to the STS of
    AWS_ENDPOINT_URL_STS, and the copy is made with the role's keys; another pod's token is refused."""
    service_account(kube_api, ident_ns, "reader")
    service_account(kube_api, ident_ns, "intruder")
    revision = contract.pin(
        iam_s3.client(), "ident", contract.Selection.from_source("s3://ident/data/", [], [])
    ).revision
    results = {}
    for account in ("reader", "intruder"):
        token_file = tmp_path / f"{account}.token"
        token_file.write_text(token(kube_api, ident_ns, account))
        env = {k: v for k, v in stage_env(iam_s3).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        env.update(
            AWS_ROLE_ARN=ROLE,
            AWS_WEB_IDENTITY_TOKEN_FILE=str(token_file),
            AWS_ENDPOINT_URL_STS=sts.endpoint,
            AWS_EC2_METADATA_DISABLED="true",
        )
        results[account] = stage(iam_s3, "s3://ident/data/", tmp_path / account, revision, env=env, timeout=120)
    ok = results["reader"]
    assert ok.code == 0, ok.stderr
    assert data_tree(data_dir(tmp_path / "reader", revision)) == expected_tree(FILES, "data/")
    refused = results["intruder"]
    # Exit code 3 (access), naming STS's refusal and whom the role trusts.
    assert refused.code == 3 and "STS refused this pod's web identity" in refused.stderr, refused.stderr
    assert "AccessDenied" in refused.stderr and subject(ident_ns, "reader") in refused.stderr
    assert not data_dir(tmp_path / "intruder", revision).exists() or not any(
        data_dir(tmp_path / "intruder", revision).iterdir()
    )


def test_the_webhook_gives_the_stager_its_pods_identity(kube_api, operator_with_sts, iam_s3, sts, ident_ns):
    service_account(kube_api, ident_ns, "reader")
    service_account(kube_api, ident_ns, "trainer", role="arn:aws:iam::000000000000:role/trainer")
    if get_cache(kube_api, ident_ns, "by-sa") is None:
        sa_cache(kube_api, ident_ns, "by-sa", iam_s3, "reader")
    settle(kube_api, operator_with_sts, ident_ns, "by-sa", "Ready")
    body = job_body("train-sa", "by-sa")
    body["spec"]["template"]["spec"]["serviceAccountName"] = "trainer"
    job = create_job(kube_api, ident_ns, body)
    pod = job["spec"]["template"]["spec"]
    (stager,) = [c for c in pod["initContainers"] if c["name"] == contract.STAGER_CONTAINER_NAME]
    env = {e["name"]: e.get("value") for e in stager["env"]}
    # The pod's own ServiceAccount's role, not the cache's: the stager is the pod.
    assert env["AWS_ROLE_ARN"] == "arn:aws:iam::000000000000:role/trainer"
    assert env["AWS_ENDPOINT_URL_STS"] == sts.endpoint
    assert "AWS_ACCESS_KEY_ID" not in env
    (vol,) = [v for v in pod["volumes"] if v["name"] == "dscache-web-identity"]
    (src,) = vol["projected"]["sources"]
    assert src["serviceAccountToken"]["audience"] == AUDIENCE
    mount = next(m for m in stager["volumeMounts"] if m["name"] == "dscache-web-identity")
    assert env["AWS_WEB_IDENTITY_TOKEN_FILE"] == f"{mount['mountPath']}/token"
    # Training containers get neither the token nor the role.
    for c in pod["containers"]:
        assert all(m["name"] != "dscache-web-identity" for m in c.get("volumeMounts") or [])


def test_credentials_are_reused_until_shortly_before_expiry(kube_api, operator_with_sts, iam_s3, sts, ident_ns):
    """Ten caches over one ServiceAccount: one exchange at STS, not ten."""
    service_account(kube_api, ident_ns, "reader")
    if get_cache(kube_api, ident_ns, "by-sa") is None:
        sa_cache(kube_api, ident_ns, "by-sa", iam_s3, "reader")
    settle(kube_api, operator_with_sts, ident_ns, "by-sa", "Ready")
    before = len([d for d in sts.decisions if d[1] == subject(ident_ns, "reader")])
    for i in range(10):
        sa_cache(kube_api, ident_ns, f"many-{i}", iam_s3, "reader")
    for i in range(10):
        settle(kube_api, operator_with_sts, ident_ns, f"many-{i}", "Ready")
    time.sleep(0.5)
    after = len([d for d in sts.decisions if d[1] == subject(ident_ns, "reader")])
    assert after == before, sts.decisions
