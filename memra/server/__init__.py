"""memra's OpenAI-compatible HTTP server (``memra serve``).

``protocol`` holds the request/response models and their conversion to
:class:`~memra.engine.sampling.SamplingParams`; ``app`` the FastAPI routes, auth, error
handling and SSE streaming; ``metrics`` the Prometheus registry.
"""

from .app import APIError, check_api_key, create_app, parse_size, run_server

__all__ = ["create_app", "run_server", "parse_size", "check_api_key", "APIError"]
