"""The OpenAPI document is valid, covers every route the E2B SDKs call, and matches the app's routes."""

from __future__ import annotations

import pytest
import yaml
from aiohttp import web
from openapi_spec_validator import validate

from agentenv.api import create_api_app
from agentenv.api.app import openapi_text
from agentenv.config import Settings

EXPECTED = {
    ("post", "/sandboxes"): {"201"},
    ("post", "/v2/sandboxes"): {"201"},
    ("get", "/sandboxes"): {"200"},
    ("get", "/v2/sandboxes"): {"200"},
    ("get", "/sandboxes/{sandboxID}"): {"200"},
    ("delete", "/sandboxes/{sandboxID}"): {"204"},
    ("post", "/sandboxes/{sandboxID}/timeout"): {"204"},
    ("post", "/sandboxes/{sandboxID}/refreshes"): {"204"},
    ("put", "/sandboxes/{sandboxID}/network"): {"204"},
    ("post", "/sandboxes/{sandboxID}/connect"): {"200", "201"},
    ("post", "/v2/sandboxes/{sandboxID}/connect"): {"200", "201"},
    ("post", "/sandboxes/{sandboxID}/resume"): {"201"},
    ("post", "/sandboxes/{sandboxID}/pause"): {"204"},
    ("post", "/sandboxes/{sandboxID}/fork"): {"201"},
    ("post", "/sandboxes/{sandboxID}/snapshots"): {"201"},
    ("post", "/sandboxes/{sandboxID}/checkpoints"): {"201"},
    ("get", "/sandboxes/{sandboxID}/checkpoints"): {"200"},
    ("post", "/sandboxes/{sandboxID}/rollback"): {"200"},
    ("get", "/checkpoints/{checkpointID}/tree"): {"200"},
    ("get", "/snapshots"): {"200"},
    ("get", "/snapshots/{snapshotID}"): {"200"},
    ("delete", "/snapshots/{snapshotID}"): {"204"},
    ("delete", "/templates/{templateID}"): {"204"},
    ("get", "/templates"): {"200"},
    ("get", "/health"): {"200"},
    ("get", "/openapi.yaml"): {"200"},
    ("get", "/teams"): {"200"},
    ("get", "/api-keys"): {"200"},
    ("post", "/api-keys"): {"201"},
    ("delete", "/api-keys/{apiKeyID}"): {"204"},
    # observability (agentenv/observability/api.py)
    ("get", "/sandboxes/metrics"): {"200"},
    ("get", "/sandboxes/{sandboxID}/metrics"): {"200"},
    ("get", "/sandboxes/{sandboxID}/logs"): {"200"},
    ("get", "/v2/sandboxes/{sandboxID}/logs"): {"200"},
    ("get", "/events"): {"200"},
    ("get", "/observability/nodes"): {"200"},
    ("get", "/observability/lineage"): {"200"},
    ("get", "/templates/{templateID}"): {"200"},
    ("post", "/v3/templates"): {"202"},
    ("get", "/templates/{templateID}/files/{hash}"): {"201"},
    ("put", "/template-files/{hash}"): {"200"},
    ("post", "/v2/templates/{templateID}/builds/{buildID}"): {"202"},
    ("get", "/templates/{templateID}/builds/{buildID}/status"): {"200"},
    ("get", "/templates/aliases/{alias}"): {"200"},
    ("post", "/templates/tags"): {"201"},
    ("delete", "/templates/tags"): {"204"},
    ("get", "/templates/{templateID}/tags"): {"200"},
    ("patch", "/templates/{templateID}"): {"200"},
    ("patch", "/v2/templates/{templateID}"): {"200"},
}
# E2B routes beyond the core (agentenv/api/compat.py): volumes and secrets exist only as honest
# answers (empty lists, 404, 501 on create), so some declare no success status.
EXPECTED.update({
    ("get", "/v2/templates"): {"200"},
    ("get", "/default-templates"): {"200"},
    ("get", "/templates/{templateID}/builds/{buildID}/logs"): {"200"},
    ("get", "/templates/{templateID}/tags/count"): {"200"},
    ("get", "/templates/{templateID}/tags/exists"): {"200"},
    ("get", "/volumes"): {"200"},
    ("post", "/volumes"): set(),
    ("get", "/volumes/{volumeID}"): set(),
    ("delete", "/volumes/{volumeID}"): set(),
    ("get", "/secrets"): {"200"},
    ("post", "/secrets"): set(),
    ("get", "/secrets/{secretID}"): set(),
    ("post", "/secrets/{secretID}"): set(),
    ("delete", "/secrets/{secretID}"): set(),
})
PUBLIC = {("get", "/health"), ("get", "/openapi.yaml"), ("put", "/template-files/{hash}")}
METHODS = {"get", "post", "put", "delete", "patch"}


@pytest.fixture(scope="module")
def doc() -> dict:
    return yaml.safe_load(openapi_text())


def operations(doc: dict):
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                yield method, path, op


def resolve(doc: dict, obj: dict) -> dict:
    while "$ref" in obj:
        node = doc
        for part in obj["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        obj = node
    return obj


def test_document_is_valid_openapi(doc):
    validate(doc)


def test_routes_and_success_statuses(doc):
    ops = {(m, p): {s for s in op["responses"] if s.startswith("2")} for m, p, op in operations(doc)}
    assert ops == EXPECTED


def test_every_error_response_is_the_error_schema(doc):
    for method, path, op in operations(doc):
        responses = op["responses"]
        assert "default" in responses, (method, path)
        for status, resp in responses.items():
            if status.startswith("2"):
                continue
            schema = resp and resolve(doc, resolve(doc, resp)["content"]["application/json"]["schema"])
            assert schema is doc["components"]["schemas"]["Error"], (method, path, status)
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["code", "message"] and "error_code" in error["properties"]


def test_security_is_api_key_except_public(doc):
    scheme = doc["components"]["securitySchemes"]["ApiKeyAuth"]
    assert scheme == {"type": "apiKey", "in": "header", "name": "X-API-KEY"}
    assert doc["security"] == [{"ApiKeyAuth": []}]
    for method, path, op in operations(doc):
        assert (op.get("security") == []) == ((method, path) in PUBLIC), (method, path)


def test_list_paging_contract(doc):
    op = doc["paths"]["/v2/sandboxes"]["get"]
    params = {resolve(doc, p)["name"]: resolve(doc, p) for p in op["parameters"]}
    assert set(params) == {"metadata", "state", "order", "startedAfter", "template", "limit", "nextToken"}
    assert params["limit"]["schema"]["minimum"] == 1 and params["limit"]["schema"]["maximum"] == 100
    assert params["state"]["explode"] is False
    assert "X-Next-Token" in op["responses"]["200"]["headers"]


def test_snapshot_list_paging_contract(doc):
    op = doc["paths"]["/snapshots"]["get"]
    params = {resolve(doc, p)["name"]: resolve(doc, p) for p in op["parameters"]}
    assert set(params) == {"sandboxID", "name", "limit", "nextToken"}
    assert params["limit"]["schema"]["minimum"] == 1 and params["limit"]["schema"]["maximum"] == 100
    assert "X-Next-Token" in op["responses"]["200"]["headers"]


def test_snapshot_and_fork_schemas(doc):
    schemas = doc["components"]["schemas"]
    assert schemas["SnapshotInfo"]["required"] == ["snapshotID", "names"]
    assert set(schemas["SandboxForkResult"]["properties"]) == {"sandbox", "error"}
    assert set(schemas["SandboxForkRequest"]["properties"]) == {"timeout", "count"}
    assert set(schemas["SandboxSnapshotRequest"]["properties"]) == {"name", "memory"}
    assert set(schemas["SandboxPauseRequest"]["properties"]) == {"memory", "requireHealthyGuest"}
    fork = doc["paths"]["/sandboxes/{sandboxID}/fork"]["post"]["responses"]["201"]
    assert fork["content"]["application/json"]["schema"]["type"] == "array"


def test_wire_field_names(doc):
    schemas = doc["components"]["schemas"]
    assert "allow_internet_access" in schemas["NewSandboxV2"]["properties"]
    assert {"templateID", "sandboxID", "clientID", "envdVersion"} <= set(schemas["Sandbox"]["required"])
    for name in ("SandboxDetail", "ListedSandbox"):
        assert {"startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB", "state"} <= set(schemas[name]["required"])


def test_app_routes_match_the_document(doc, tmp_path):
    app = create_api_app(orchestrator=None, auth=None, settings=Settings(data_dir=tmp_path))  # type: ignore[arg-type]
    served = {
        (r.method.lower(), r.resource.canonical)
        for r in app.router.routes()
        if isinstance(r.resource, web.AbstractResource) and r.method not in ("HEAD",)
    }
    assert served == set(EXPECTED)
