"""Shared helpers for the API tests: an HTTP client that checks every answer against openapi.yaml.

Calls go through `requests` in a worker thread (`asyncio.to_thread`) so the tests work whether the
server under test runs in another process or on this test session's event loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

import pytest
import requests
from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse

import agentenv.api

SPEC_PATH = Path(agentenv.api.__file__).with_name("openapi.yaml")
_DEFAULT = object()


class SpecClient:
    """`requests` against one server; each response is validated against the OpenAPI document.

    Pass `validate=False` only for requests the spec cannot describe (unknown routes/methods);
    their bodies are still checked to be the JSON error shape.
    """

    def __init__(self, base_url: str, api_key: str, spec: OpenAPI):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.spec = spec
        self.session = requests.Session()

    def request_sync(self, method: str, path: str, *, key: Any = _DEFAULT, validate: bool = True,
                     headers: dict[str, str] | None = None, **kw: Any) -> requests.Response:
        hdrs = dict(headers or {})
        key = self.api_key if key is _DEFAULT else key
        if key is not None:
            hdrs["X-API-KEY"] = key
        kw.setdefault("timeout", 120)
        resp = self.session.request(method, self.base_url + path, headers=hdrs, **kw)
        if validate:
            sent = resp.request
            if not isinstance(sent.body, (str, bytes, type(None))):  # streamed (chunked) body: not re-readable
                sent = sent.copy()
                sent.body = None
            self.spec.validate_response(RequestsOpenAPIRequest(sent), RequestsOpenAPIResponse(resp))
        if resp.status_code >= 400:
            assert resp.headers.get("Content-Type", "").startswith("application/json"), resp.headers
            body = resp.json()
            assert body["code"] == resp.status_code, body
            assert isinstance(body["message"], str) and body["message"], body
        return resp

    async def request(self, method: str, path: str, **kw: Any) -> requests.Response:
        return await asyncio.to_thread(self.request_sync, method, path, **kw)

    async def get(self, path: str, **kw: Any) -> requests.Response:
        return await self.request("GET", path, **kw)

    async def post(self, path: str, **kw: Any) -> requests.Response:
        return await self.request("POST", path, **kw)

    async def delete(self, path: str, **kw: Any) -> requests.Response:
        return await self.request("DELETE", path, **kw)

    def close(self) -> None:
        self.session.close()


@pytest.fixture(scope="session")
def openapi_spec() -> OpenAPI:
    return OpenAPI.from_file_path(str(SPEC_PATH))


@pytest.fixture(scope="session")
def make_spec_client(openapi_spec: OpenAPI):
    clients: list[SpecClient] = []

    def make(base_url: str, api_key: str) -> SpecClient:
        c = SpecClient(base_url, api_key, openapi_spec)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def error_message(resp: requests.Response) -> str:
    return resp.json()["message"]


@pytest.fixture(scope="session")
def message_of() -> Callable[[requests.Response], str]:
    return error_message
