"""The E2B-compatible control API: routes, auth (API keys) and the OpenAPI document."""

from agentenv.api.app import create_api_app, setup_api
from agentenv.api.auth import ApiKeyAuth, generate_api_key, hash_key

__all__ = ["ApiKeyAuth", "create_api_app", "generate_api_key", "hash_key", "setup_api"]
