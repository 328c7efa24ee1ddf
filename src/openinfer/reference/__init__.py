"""NumPy fp32 reference backend: the oracle for the CUDA kernels and the CPU backend."""
from .model import ReferenceBackend, dense_forward

__all__ = ["ReferenceBackend", "dense_forward"]
