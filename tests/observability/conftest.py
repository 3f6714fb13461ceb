"""Fixtures for the observability tests: a spec-validating API client and a Prometheus scraper.

All tests use the session server of tests/conftest.py; the metric checks compare values before
and after each step (other modules' sandboxes may exist in the same session).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse

import agentenv.api

SPEC_PATH = Path(agentenv.api.__file__).with_name("openapi.yaml")


class Scrape:
    """One parsed /metrics scrape: value(name, **labels) sums the matching samples."""

    def __init__(self, text: str):
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]
        self.names = {s.name for s in self.samples}

    def value(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def has(self, name: str) -> bool:
        return name in self.names or name in self.families


@pytest.fixture(scope="session")
def scrape(server):
    session = requests.Session()

    def do() -> Scrape:
        r = session.get(f"{server.api_url}/metrics", timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"].startswith("text/plain"), r.headers
        return Scrape(r.text)

    yield do
    session.close()


class Api:
    """requests against the server with the API key; every answer is validated against openapi.yaml."""

    def __init__(self, base: str, key: str):
        self.base, self.key = base, key
        self.spec = OpenAPI.from_file_path(str(SPEC_PATH))
        self.session = requests.Session()

    def get(self, path: str, *, validate: bool = True, **kw) -> requests.Response:
        headers = {"X-API-KEY": self.key, **kw.pop("headers", {})}
        kw.setdefault("timeout", 60)
        r = self.session.get(self.base + path, headers=headers, **kw)
        if validate:
            self.spec.validate_response(RequestsOpenAPIRequest(r.request), RequestsOpenAPIResponse(r))
        return r

    def json(self, path: str, **kw):
        r = self.get(path, **kw)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()


@pytest.fixture(scope="session")
def api(server):
    c = Api(server.api_url, server.api_key)
    yield c
    c.session.close()
