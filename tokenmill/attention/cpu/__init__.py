"""CPU attention backend: torch-native prefill, C++ paged decode kernel (built on first use)."""

from tokenmill.attention.cpu.backend import CpuBackend
from tokenmill.attention.cpu.extension import load_cpu_kernels

__all__ = ["CpuBackend", "load_cpu_kernels"]
