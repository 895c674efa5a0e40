"""Pod identity's pure parts: the spec's rule, the stager's web identity, the credential cache."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import pydantic
import pytest
import yaml

from dscache_contract import STAGER_CONTAINER_NAME, RevisionRef
from dscache_operator.admission.injection import WEB_IDENTITY_FILE, WEB_IDENTITY_VOLUME, WebIdentity, inject_object
from dscache_operator.api.models import DatasetCacheSpec, Source
from dscache_operator.cluster import identity
from dscache_operator.cluster.identity import Identities, IdentityError
from dscache_operator.control import sourcecheck
from dscache_operator.kube.client import ApiError
from dscache_operator.settings import Settings
from tests.unit.test_operator_injection import job

REPO_CRD = "crds/datasetcache.yaml"
ROLE = "arn:aws:iam::1:role/reader"


def sa_spec(**source: Any) -> DatasetCacheSpec:
    return DatasetCacheSpec.model_validate(
        {"source": {"uri": "s3://bkt/p/", "serviceAccountName": "reader", **source}, "mountPath": "/data"}
    )


def test_secret_and_service_account_are_exclusive():
    with pytest.raises(pydantic.ValidationError, match="not both"):
        sa_spec(credentials={"secretRef": {"name": "keys"}})
    assert sa_spec().source.serviceAccountName == "reader"
    assert Source(uri="s3://bkt/p/", credentials={"secretRef": {"name": "k"}}).secret_name == "k"


def test_the_crd_says_the_same_to_kubectl():
    from tests.unit.test_docs_troubleshooting import REPO

    crd = yaml.safe_load((REPO / REPO_CRD).read_text())
    source = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["source"]
    (rule,) = source["x-kubernetes-validations"]
    assert "serviceAccountName" in rule["rule"] and "secretRef" in rule["rule"] and "not both" in rule["message"]
    assert "serviceAccountName" in source["properties"]


def _inject(spec: DatasetCacheSpec, web: WebIdentity | None) -> dict:
    obj = job()
    inject_object(
        obj,
        kind="Job",
        namespace="ml",
        cache_name="imagenet",
        spec=spec,
        settings=Settings(stager_image="stager:test"),
        mode="HostPath",
        revision=RevisionRef("r-0123456789abcdef0123"),
        web_identity=web,
    )
    return obj["spec"]["template"]["spec"]


def test_the_stager_alone_gets_the_pods_web_identity():
    web = WebIdentity(ROLE, "sts.amazonaws.com", "http://sts.local:8080")
    pod = _inject(sa_spec(), web)
    stager = next(c for c in pod["initContainers"] if c["name"] == STAGER_CONTAINER_NAME)
    env = {e["name"]: e.get("value") for e in stager["env"]}
    assert env["AWS_ROLE_ARN"] == ROLE
    assert env["AWS_WEB_IDENTITY_TOKEN_FILE"] == WEB_IDENTITY_FILE
    assert env["AWS_ENDPOINT_URL_STS"] == "http://sts.local:8080"
    (vol,) = [v for v in pod["volumes"] if v["name"] == WEB_IDENTITY_VOLUME]
    token = vol["projected"]["sources"][0]["serviceAccountToken"]
    assert token["audience"] == "sts.amazonaws.com" and token["expirationSeconds"] >= 600
    assert any(m["name"] == WEB_IDENTITY_VOLUME and m["readOnly"] for m in stager["volumeMounts"])
    for c in pod["containers"]:
        assert all(m["name"] != WEB_IDENTITY_VOLUME for m in c.get("volumeMounts") or [])
        assert "AWS_ROLE_ARN" not in {e["name"] for e in c.get("env") or []}
    # Idempotent: the Job's pod passing through the webhook again adds nothing.
    again = _inject(sa_spec(), web)
    assert [v["name"] for v in again["volumes"]].count(WEB_IDENTITY_VOLUME) == 1


def test_no_sts_endpoint_leaves_boto3s_default():
    pod = _inject(sa_spec(), WebIdentity(ROLE, "sts.amazonaws.com"))
    stager = next(c for c in pod["initContainers"] if c["name"] == STAGER_CONTAINER_NAME)
    assert "AWS_ENDPOINT_URL_STS" not in {e["name"] for e in stager["env"]}


def test_no_web_identity_without_one():
    pod = _inject(sa_spec(), None)
    assert all(v["name"] != WEB_IDENTITY_VOLUME for v in pod["volumes"])


class FakeKube:
    def __init__(self, sa: dict | None, status: int | None = None) -> None:
        self.sa, self.status, self.tokens = sa, status, 0

    async def get(self, path: str) -> dict | None:
        if self.status:
            raise ApiError(self.status, "no")
        return self.sa

    async def request(self, method: str, path: str, body: Any = None) -> dict:
        assert method == "POST" and path.endswith("/serviceaccounts/reader/token")
        assert body["spec"]["audiences"] == ["aud-x"] and body["spec"]["expirationSeconds"] == 600
        self.tokens += 1
        return {"status": {"token": f"jwt-{self.tokens}"}}


def _identities(monkeypatch, lifetimes: list[float]) -> tuple[Identities, list[tuple]]:
    calls: list[tuple] = []

    def assume(endpoint, region, role, token, session, timeout):
        calls.append((endpoint, role, token, session))
        return identity.Credentials("AK", "SK", "ST", time.time() + lifetimes[len(calls) - 1])

    monkeypatch.setattr(identity, "assume_role_sync", assume)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    return Identities(pool, audience="aud-x", sts_endpoint="http://sts"), calls


SA = {"metadata": {"name": "reader", "annotations": {"eks.amazonaws.com/role-arn": ROLE}}}


def test_credentials_are_kept_until_shortly_before_they_expire(monkeypatch):
    ids, calls = _identities(monkeypatch, [3600, 60, 3600])
    kube = FakeKube(SA)

    async def run():
        first = await ids.credentials(kube, "ml", "reader", "us-east-1")
        assert (first.access_key_id, calls) == ("AK", [("http://sts", ROLE, "jwt-1", "dscache-ml.reader")])
        # A burst of checks over one ServiceAccount: one exchange.
        await asyncio.gather(*(ids.credentials(kube, "ml", "reader", "us-east-1") for _ in range(20)))
        assert len(calls) == 1
        ids._held.clear()
        await ids.credentials(kube, "ml", "reader", "us-east-1")  # lives 60 s: inside RENEW_BEFORE
        await ids.credentials(kube, "ml", "reader", "us-east-1")
        assert len(calls) == 3 and kube.tokens == 3

    asyncio.run(run())


@pytest.mark.parametrize(
    ("sa", "status", "reason"),
    [
        (None, None, "ServiceAccountNotFound"),
        ({"metadata": {"name": "reader"}}, None, "RoleNotAnnotated"),
        (SA, 403, "ServiceAccountForbidden"),
    ],
)
def test_what_is_wrong_with_the_service_account_is_said(monkeypatch, sa, status, reason):
    ids, calls = _identities(monkeypatch, [3600])

    async def run():
        with pytest.raises(IdentityError) as e:
            await ids.credentials(FakeKube(sa, status), "ml", "reader", "us-east-1")
        return e.value

    err = asyncio.run(run())
    assert err.reason == reason and "ml/reader" in err.message and calls == []


def test_sts_refusal_names_the_subject_and_audience():
    from botocore.exceptions import ClientError

    exc = ClientError(
        {"Error": {"Code": "AccessDenied", "Message": "nope"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
        "AssumeRoleWithWebIdentity",
    )
    err = identity._refused(exc, "ml", "reader", ROLE, "sts.amazonaws.com", "http://sts")
    assert err.reason == "IdentityRefused"
    assert "system:serviceaccount:ml:reader" in err.message and "sts.amazonaws.com" in err.message


def test_no_identity_at_all_is_not_usable():
    from botocore.exceptions import NoCredentialsError

    got = sourcecheck._classify(NoCredentialsError(), Source(uri="s3://bkt/p/"), sourcecheck.OWN_IDENTITY)
    assert (got.ok, got.reason) == (False, "NoIdentity")
    assert "spec.source.serviceAccountName" in got.message and "secretRef" in got.message


def test_settings_read_the_sts_endpoint_and_audience():
    s = Settings.from_env({"DSCACHE_STS_ENDPOINT": "http://sts:8080", "DSCACHE_STS_AUDIENCE": "aud"})
    assert (s.sts_endpoint, s.sts_audience) == ("http://sts:8080", "aud")
    d = Settings.from_env({"DSCACHE_STS_ENDPOINT": ""})
    assert (d.sts_endpoint, d.sts_audience) == (None, "sts.amazonaws.com")


def test_a_pod_identity_caches_prestage_pod_runs_as_its_service_account():
    from dscache_operator.control import prestage

    spec = sa_spec(endpoint="http://s3:9000")
    spec = spec.model_copy(update={"prestage": prestage.Prestage()})
    web = WebIdentity(ROLE, "sts.amazonaws.com", "http://sts")
    pod = prestage.build_pod(
        "ml", "c", "uid-1", "g1", spec, Settings(stager_image="s:t"), RevisionRef("r-0123456789abcdef0123"), 1, web
    )
    assert pod["spec"]["serviceAccountName"] == "reader"
    stager = pod["spec"]["initContainers"][0]
    assert {e["name"]: e.get("value") for e in stager["env"]}["AWS_ROLE_ARN"] == ROLE
    assert any(v["name"] == WEB_IDENTITY_VOLUME for v in pod["spec"]["volumes"])


def test_an_empty_session_token_is_none_on_the_native_plane(monkeypatch):
    """An STS may answer <SessionToken/>: botocore then sends no x-amz-security-token; the
    native plane must not send an empty one either (versitygw answers 400, seen in e2e)."""
    import datetime as dt

    from dscache_stager import native

    def provider() -> dict:
        expires = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        return {"access_key_id": "AK", "secret_access_key": "SK", "token": "", "expires_at": expires}

    monkeypatch.setattr(native, "credentials_for_store", lambda: {"credential_provider": provider})
    key, secret, token, valid = native._credentials()["credential_provider"]()
    assert (key, secret, token) == ("AK", "SK", None) and valid > 3000
    monkeypatch.setattr(
        native, "credentials_for_store", lambda: {"access_key_id": "AK", "secret_access_key": "SK", "session_token": ""}
    )
    assert native._credentials()["session_token"] is None
