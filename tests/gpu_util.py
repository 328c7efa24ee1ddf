"""Shared pieces of the GPU suite: the skip rule, bf16 helpers, and the error measure."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

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


_CHUNK = 1 << 22  # elements: a tensor up to this size is drawn in one call, larger ones chunk by chunk in threads
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    _pool = _pool or ThreadPoolExecutor(os.cpu_count() or 1)
    return _pool


def rand_bf16(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    """Random bf16 bits (uint16), N(0, scale^2): an exact zero about once in 10^7 values, so no output row that a
    zero input could hide (an unwritten one reads as zeros) goes unseen. A tensor at a large model's shape
    (a 32B projection, a vocabulary's embedding) is drawn in chunks on every core, each chunk from a seed the
    caller's generator gives (the same bits on any machine): one call on one core took up to 17 s of a test."""
    n = int(np.prod(shape))
    if n <= _CHUNK:
        return f32_to_bf16((rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)))
    out = np.empty(n, np.uint16)
    seeds = rng.integers(0, 1 << 63, size=-(-n // _CHUNK))

    def fill(i: int) -> None:  # NumPy's fill and the conversion release the GIL
        lo, hi = i * _CHUNK, min(n, (i + 1) * _CHUNK)
        x = np.random.default_rng(int(seeds[i])).standard_normal(hi - lo, dtype=np.float32)
        x *= np.float32(scale)
        out[lo:hi] = f32_to_bf16(x)

    list(_threads().map(fill, range(len(seeds))))
    return out.reshape(shape)


def f32(u16: np.ndarray) -> np.ndarray:
    u16 = np.asarray(u16, dtype=np.uint16)
    if u16.size <= _CHUNK:
        return bf16_to_f32(u16)
    flat, out = u16.reshape(-1), np.empty(u16.size, np.float32)

    def conv(lo: int) -> None:
        out[lo:lo + _CHUNK] = bf16_to_f32(flat[lo:lo + _CHUNK])

    list(_threads().map(conv, range(0, u16.size, _CHUNK)))
    return out.reshape(u16.shape)


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
