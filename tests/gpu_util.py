"""Shared pieces of the GPU suite: the skip rule, bf16 helpers, and the error measure."""
from __future__ import annotations

import numpy as np
import pytest

from openinfer.safetensors_io import bf16_to_f32, f32_to_bf16


def _why_no_gpu() -> str | None:
    try:
        from openinfer import _engine
    except ImportError as e:
        return f"the compiled CUDA engine is not importable ({e})"
    if _engine.device_count() == 0:
        return "no CUDA GPU is visible"
    return None


NO_GPU = _why_no_gpu()
requires_gpu = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=f"GPU test: {NO_GPU}")]


def device_used_bytes() -> int:
    """Bytes in use on device 0, every process's (cudaMemGetInfo)."""
    from openinfer import _engine
    free, total = _engine.mem_get_info()
    return total - free


def rand_bf16(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    """Random bf16 bits (uint16) and never zeros: zeros hide unwritten outputs."""
    return f32_to_bf16((rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)))


def f32(u16: np.ndarray) -> np.ndarray:
    return bf16_to_f32(u16)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "non-finite output"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


# One tolerance table (relative Frobenius error vs the fp32 reference), by what the kernel rounds.
TOL = {
    "bf16_out": 6e-3,      # one or two bf16 roundings of the output
    "bf16_gemm": 8e-3,     # bf16 operands and output, fp32 accumulation
    "attention": 1e-2,     # bf16 q/k/v, fp32 softmax, bf16 output
}
