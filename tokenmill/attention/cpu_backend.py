"""CpuBackend: the torch-native backend with decode attention as a compiled C++ kernel.

Decode rows (a decode step, or the one-token rows of a mixed step) are attended by
``paged_decode_attention``, which reads each request's keys and values in place through the
request-to-token table; the torch path instead gathers them into padded batches and runs SDPA
with a mask, which on a 2-core AVX2 machine costs 5-8x more per layer at 64 requests of
~400 tokens. Prefill rows keep the torch path (SDPA is efficient for long query blocks).
Strict like every explicit backend: fp32 CPU tensors only, and the kernels must build.
"""

from __future__ import annotations

import torch

from tokenmill.cpu_kernels import load_cpu_kernels
from tokenmill.attention.torch_native import TorchNativeBackend


class CpuBackend(TorchNativeBackend):
    """fp32 on CPU; needs a C++ compiler and ninja the first time (see ``extension.py``)."""

    name = "cpu"

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__(n_heads, n_kv_heads, head_dim)
        kernels = load_cpu_kernels()
        if kernels is None:
            raise RuntimeError(
                "attention_backend='cpu' needs its C++ kernels, which failed to build (see the log: a C++ "
                "compiler and `pip install ninja` are required); use attention_backend='torch'"
            )
        self._decode_kernel = kernels.paged_decode_attention

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        req_to_token: torch.Tensor,
    ) -> torch.Tensor:
        if q.device.type != "cpu" or q.dtype != torch.float32:
            raise ValueError(f"the cpu attention backend supports fp32 CPU tensors, got {q.dtype} on {q.device}")
        return self._decode_kernel(q.contiguous(), k_cache, v_cache, req_to_token, req_pool_indices.contiguous(),
                                   seq_lens.contiguous(), self.scale)
