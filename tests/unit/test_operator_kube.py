"""Our API client survives a rotated service-account token (a local HTTP server
that accepts only the current token; the real API server test is in
tests/integration/test_operator_api.py)."""

from __future__ import annotations

import asyncio

import kopf
from aiohttp import web

from dscache_operator.kube.client import ApiError, Kube
from dscache_operator.kube.informer import Informer


async def _server(valid: dict):
    async def handler(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {valid['token']}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        return web.json_response({"items": [], "metadata": {"resourceVersion": "1"}})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_request_rereads_a_rotated_token_on_401(tmp_path):
    async def main():
        valid = {"token": "t1"}
        runner, url = await _server(valid)
        token_file = tmp_path / "token"
        token_file.write_text("t1\n")
        kube = Kube(kopf.ConnectionInfo(server=url, scheme="Bearer", token="t1"), token_file=str(token_file))
        try:
            await kube.request("GET", "/api/v1/pods")
            # The kubelet rotates the token; the API server stops accepting the old one.
            valid["token"] = "t2"
            token_file.write_text("t2\n")
            assert (await kube.request("GET", "/api/v1/pods"))["metadata"]["resourceVersion"] == "1"
            # Revoked with nothing new in the file: a clear 401, no endless retry.
            valid["token"] = "t3"
            try:
                await kube.request("GET", "/api/v1/pods")
                raise AssertionError("expected a 401")
            except ApiError as e:
                assert e.status == 401
        finally:
            await kube.close()
            await runner.cleanup()

    asyncio.run(main())


def test_informer_is_not_ready_while_unauthorised(tmp_path):
    async def main():
        valid = {"token": "other"}
        runner, url = await _server(valid)
        token_file = tmp_path / "token"
        token_file.write_text("t1")
        kube = Kube(kopf.ConnectionInfo(server=url, scheme="Bearer", token="t1"), token_file=str(token_file))
        inf = Informer(kube, "/api/v1/pods", "", lambda b: None)
        task = asyncio.create_task(inf.run())
        try:
            await asyncio.sleep(1.0)
            assert not inf.ready.is_set() and inf.auth_failing_since is not None
            token_file.write_text("other")  # rotated: the next attempt lists and is ready
            await asyncio.wait_for(inf.ready.wait(), 10)
            assert inf.auth_failing_since is None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await kube.close()
            await runner.cleanup()

    asyncio.run(main())
