"""The bring-up's `/init` doubles as its readiness check (`envd_client.init`,
`SandboxHost.bring_up`): it is sent until the new sandbox's envd answers it, gives up when the sandbox
is gone, and never repeats an answer that repeating cannot change. Against a real envd on a loopback
address at envd's own port, as the host reaches a sandbox's slot."""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest
import requests

from agentenv.constants import ENVD_PORT
from agentenv.errors import RuntimeFailure
from agentenv.orchestrator import envd_client


def loopback() -> str:
    """A loopback address nobody listens on (as a slot's address before its sandbox runs)."""
    return f"127.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 2}"


def init_kwargs(host_token: str, token: str) -> dict:
    return dict(access_token=token, env_vars={"BRING_UP": "yes"}, host_token=host_token,
                default_user="root", default_workdir="/")


async def test_the_bring_up_init_is_sent_until_envd_answers_it(envd_factory):
    ip, host_token, token = loopback(), secrets.token_hex(16), secrets.token_hex(8)
    began = time.monotonic()
    sending = asyncio.create_task(envd_client.init(ip, **init_kwargs(host_token, token), timeout=30))
    await asyncio.sleep(1.0)
    assert not sending.done()  # nothing listens yet: refused, sent again
    envd = await asyncio.to_thread(envd_factory, {"AGENTENV_ENVD_HOST_TOKEN": host_token}, host=ip, port=ENVD_PORT)
    await asyncio.wait_for(sending, 30)
    assert time.monotonic() - began > 1.0
    # envd took it: the new token guards it, and the environment is the one sent
    assert requests.get(envd.url + "/envs", timeout=10).status_code == 401
    r = requests.get(envd.url + "/envs", headers={"X-Access-Token": token}, timeout=10)
    assert r.status_code == 200 and r.json().get("BRING_UP") == "yes", r.text


async def test_a_bring_up_init_gives_up_as_soon_as_the_sandbox_is_gone():
    async def gone() -> bool:
        return False

    began = time.monotonic()
    with pytest.raises(RuntimeFailure, match="sandbox exited before envd answered /init"):
        await envd_client.init(loopback(), **init_kwargs("h", "t"), timeout=30, is_alive=gone)
    assert time.monotonic() - began < 5


async def test_a_refused_bring_up_init_is_not_sent_again(envd_factory):
    ip = loopback()
    envd = await asyncio.to_thread(envd_factory, host=ip, port=ENVD_PORT)
    r = requests.post(envd.url + "/init", json={"accessToken": "first"}, timeout=10)
    assert r.status_code == 204, r.text
    began = time.monotonic()
    with pytest.raises(RuntimeFailure, match="HTTP 401"):  # neither the current token nor the host's
        await envd_client.init(ip, **init_kwargs("not-the-host-token", "second"), timeout=30)
    assert time.monotonic() - began < 5
    assert requests.get(envd.url + "/envs", headers={"X-Access-Token": "first"}, timeout=10).status_code == 200


async def test_an_init_applied_but_unanswered_is_resent_with_the_token_it_set(envd_factory):
    """A restore of another node's image: envd holds the image's token and that node's host token.
    The first /init reaches envd and sets the new token, but its answer is lost on the way back;
    the copy sent again must not be refused for carrying the old token (seen in the cluster soak)."""
    envd_ip, ip = loopback(), loopback()
    envd = await asyncio.to_thread(envd_factory, {"AGENTENV_ENVD_HOST_TOKEN": "the-other-nodes"},
                                   host=envd_ip, port=ENVD_PORT)
    r = requests.post(envd.url + "/init", json={"accessToken": "old"}, timeout=10)
    assert r.status_code == 204, r.text
    answers_dropped = 0

    async def message(stream: asyncio.StreamReader) -> bytes:
        head = await stream.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        return head + await stream.readexactly(length)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Passes each request on to envd; the first answer goes nowhere (the connection just ends)."""
        nonlocal answers_dropped
        up_r, up_w = await asyncio.open_connection(envd_ip, ENVD_PORT)
        try:
            up_w.write(await message(reader))
            answer = await message(up_r)
            if answers_dropped == 0:
                answers_dropped += 1
                return
            writer.write(answer)
            await writer.drain()
        finally:
            up_w.close()
            writer.close()

    server = await asyncio.start_server(relay, ip, ENVD_PORT)
    try:
        await envd_client.init(ip, **init_kwargs("this-nodes", "new"), current_token="old", timeout=30)
    finally:
        server.close()
        await server.wait_closed()
    assert answers_dropped == 1
    assert requests.get(envd.url + "/envs", headers={"X-Access-Token": "old"}, timeout=10).status_code == 401
    r = requests.get(envd.url + "/envs", headers={"X-Access-Token": "new"}, timeout=10)
    assert r.status_code == 200 and r.json().get("BRING_UP") == "yes", r.text
