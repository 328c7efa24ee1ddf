"""The package's version and its CUDA engine's build: `openinfer-serve --version`, GET /version and the
start-up log."""
from __future__ import annotations

import importlib

from .config import EngineUnavailable

__version__ = "0.1.0"

NOT_BUILT = "not built"


def _engine_or_why():
    """(openinfer._engine, None), or (None, why it is not there: NOT_BUILT or the import error)."""
    name = __package__ + "._engine"
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return None, NOT_BUILT
    except ImportError as e:  # built, but it does not load here
        return None, f"does not load: {e}"


def engine_module():
    """The compiled engine; EngineUnavailable, naming the ways out, when it is not there."""
    eng, why = _engine_or_why()
    if eng is None:
        cause = "was installed without its CUDA engine (OPENINFER_CUDA=0, or run from the sources)" \
            if why == NOT_BUILT else f"has a CUDA engine that {why}"
        raise EngineUnavailable(f"openinfer {cause}; build it with nvcc on PATH (`pip install .`), "
                                "or use {device=cpu} for the NumPy reference backend")
    return eng


def build_info() -> dict:
    """{"version", "engine"}: the engine's {"cuda_archs": [...], "git_commit"}, or None and
    "engine_missing" saying why."""
    eng, why = _engine_or_why()
    if eng is None:
        return {"version": __version__, "engine": None, "engine_missing": why}
    b = eng.build_info()
    return {"version": __version__, "engine": {"cuda_archs": b["cuda_archs"].split(";"), "git_commit": b["git_commit"]}}


def version_line() -> str:
    """One line: the version and what the engine was built from."""
    info = build_info()
    e = info["engine"]
    if e is None:
        return f"openinfer {__version__} (CUDA engine {info['engine_missing']}: --device cpu only)"
    return f"openinfer {__version__} (CUDA engine for {', '.join('sm_' + a for a in e['cuda_archs'])}, " \
           f"commit {e['git_commit']})"
