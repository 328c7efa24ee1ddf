"""openinfer: a Qwen3 inference server (CUDA engine under a thin Python layer)."""
import importlib

from .version import __version__

# Imported on first use, so that `openinfer-serve --version` and the checks of its options answer
# without loading NumPy and the engine first.
_EXPORTS = {"Engine": "engine", "LLMEngine": "engine", "RequestOutput": "engine", "EngineConfig": "config",
            "ModelConfig": "config", "SamplingParams": "sampling_params", "InvalidRequest": "sampling_params",
            "RequestUpdate": "scheduler", "RequestRejected": "scheduler", "QueueFull": "scheduler"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
