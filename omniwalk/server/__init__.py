"""FastAPI server: native /generate, OpenAI-compatible routes, /health, /metrics."""

from omniwalk.server.app import build_app, serve

__all__ = ["build_app", "serve"]
