"""OpenAI-compatible HTTP server: the starlette app (`app.py`), its routes (`routes.py`), request
shapes and errors (`protocol.py`), SSE (`sse.py`), logprobs (`logprobs.py`), the engine loop thread
(`async_engine.py`) and Prometheus metrics (`metrics.py`)."""

from .app import build_app
from .async_engine import AsyncEngine

__all__ = ["build_app", "AsyncEngine"]
