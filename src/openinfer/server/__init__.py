"""OpenAI-compatible HTTP server: starlette app (`app.py`), request validation (`protocol.py`),
the engine loop thread (`async_engine.py`) and Prometheus metrics (`metrics.py`)."""

from .app import build_app
from .async_engine import AsyncEngine

__all__ = ["build_app", "AsyncEngine"]
