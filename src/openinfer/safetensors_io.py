"""Minimal safetensors reader (memory-mapped) and writer, with bf16 <-> fp32 helpers.

NumPy has no bfloat16: BF16 tensors are read and written as uint16 arrays holding the raw bits.
Why not the `safetensors` package: its NumPy API cannot return BF16 (`get_tensor` raises
TypeError, safetensors 0.8) and returns other dtypes as copies, while the loader passes each weight
to `_engine.Engine.load_tensor` as a uint16 view of the memory-mapped file, with no copy on the host.
So the runtime does not depend on it; tests/test_checkpoint.py uses it to cross-check this module.

Format: 8-byte little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the data.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

# safetensors dtype -> numpy dtype of the returned array (BF16 as raw uint16 bits)
DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
          "I32": np.int32, "I64": np.int64, "U8": np.uint8, "I8": np.int8, "BOOL": np.bool_}
_ITEMSIZE = {k: np.dtype(v).itemsize for k, v in DTYPES.items()}


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_to_f32(u: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> fp32, exact."""
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class SafetensorsFile:
    """One .safetensors file, memory-mapped; `get` returns zero-copy views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = self.path.stat().st_size
            if n > size - 8:
                raise ValueError(f"{self.path}: corrupt safetensors header (length {n}, file {size} bytes)")
            header = json.loads(f.read(n))
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self.header: dict = header
        self.data_start = 8 + n
        for name, info in header.items():
            b, e = info["data_offsets"]
            want = int(np.prod(info["shape"], dtype=np.int64)) * _ITEMSIZE.get(info["dtype"], 0)
            if info["dtype"] in DTYPES and (e - b != want or self.data_start + e > size):
                raise ValueError(f"{self.path}: tensor '{name}' has inconsistent offsets {b}..{e}")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self.data_start else None

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def offset(self, name: str) -> int:
        return self.header[name]["data_offsets"][0]

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        b, e = info["data_offsets"]
        if b == e:
            return np.zeros(info["shape"], dtype=DTYPES[info["dtype"]])
        buf = self._mm[self.data_start + b:self.data_start + e]
        return buf.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def _dtype_name(a: np.ndarray) -> str:
    if a.dtype == np.uint16:
        return "BF16"  # by convention: uint16 arrays are bf16 bits
    for k, v in DTYPES.items():
        if a.dtype == v and k != "BF16":
            return k
    raise ValueError(f"cannot write numpy dtype {a.dtype} to safetensors")


class SafetensorsWriter:
    """Streaming writer: the header is fixed up front from (name, dtype, shape) specs, then each
    tensor's bytes are appended in spec order, possibly in several pieces, so no tensor need be
    held whole in memory."""

    def __init__(self, path: str | os.PathLike, specs: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._order, off = [], 0
        for name, dt, shape in specs:
            n = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dt]
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
            self._order.append((name, n))
            off += n
        self.data_size = off
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the library writes it
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(blob)) + blob)
        self._idx, self._left = -1, 0
        self._advance()

    def _advance(self) -> None:
        while self._left == 0 and self._idx < len(self._order):  # skips empty tensors too
            self._idx += 1
            self._left = self._order[self._idx][1] if self._idx < len(self._order) else -1

    def write(self, name: str, piece: np.ndarray) -> None:
        """Appends bytes of tensor `name` (the current one in spec order)."""
        if self._idx >= len(self._order) or self._order[self._idx][0] != name:
            raise ValueError(f"tensor '{name}' written out of order")
        data = np.ascontiguousarray(piece).tobytes()
        if len(data) > self._left:
            raise ValueError(f"tensor '{name}': more bytes than its shape holds")
        self._f.write(data)
        self._left -= len(data)
        self._advance()

    def close(self) -> None:
        if self._idx < len(self._order):
            self._f.close()
            raise ValueError(f"tensor '{self._order[self._idx][0]}' was not fully written")
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def save_file(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes whole tensors; uint16 arrays are stored as BF16."""
    with SafetensorsWriter(path, [(k, _dtype_name(v), v.shape) for k, v in tensors.items()], metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)
