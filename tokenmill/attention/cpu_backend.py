"""CpuBackend: the torch-native backend with its hot paths replaced by C++ kernels (fp32 or bf16 CPU).

Decode rows (a decode step, or the one-token rows of a mixed step) are attended by
``paged_decode_attention``, which reads each request's keys and values in place through the
request-to-token table, an int8 cache's with their scales, an fp8 one's widened as they are read (the
torch path gathers them into padded batches for SDPA). The other rows of a prefill step go to
``paged_prefill_attention_``, every request in one call, reading keys and values in place too, when
the cache has the queries' dtype and head_dim is a multiple of 16 up to 256; otherwise (int8/fp8 or
converted caches, soft-capping, other head sizes) each request's rows, from ``MIN_KERNEL_QUERY_ROWS``
on, are two matmuls around the fused ``causal_softmax_`` kernel.
All apply a layer's sliding window by reading only the keys inside it (decode: each request's last
``sliding_window``; prefill: those of some query row of the tile or block) and masking the rest.
With attention soft-capping (``softcap``) decode rows take the torch path (the decode kernel has
none) and prefill scores are capped in torch before the fused softmax (then scaled by 1).
In fp32 outputs equal the torch backend's to fp32 rounding; in bf16 the kernels compute in fp32
from the bf16 values (decode) or round as transformers' eager bf16 attention does (prefill).
Strict like every explicit backend: fp32 or bf16 CPU tensors only, and the kernels must build.
"""

from __future__ import annotations

import torch

from tokenmill.attention.capabilities import BackendCapabilities
from tokenmill.attention.torch_native import TorchNativeBackend
from tokenmill.cache.kv_fp8 import FP8_DTYPES
from tokenmill.cache.kv_quant import LayerKV
from tokenmill.cache.views import KVView, PrefillKVCache
from tokenmill.kernels.cpu import load_cpu_kernels

SCORE_BUFFER_FLOATS = 4 * 1024 * 1024
"""Cap on one prefill score block (16 MB): long contexts are processed in more query blocks."""
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
"""The model and KV dtypes this backend runs (decode attention converts bf16 keys/values to fp32 as
it reads them; its output is rounded back to the model's dtype)."""
MIN_KERNEL_QUERY_ROWS = 32
"""Below this many query rows the torch path is faster (it needs fewer op calls)."""
PREFILL_KERNEL_MAX_HEAD_DIM = 256
"""The prefill kernel takes head_dim a multiple of 16 up to this (its per-key scratch row)."""
KV_DTYPES = (*SUPPORTED_DTYPES, torch.int8, *FP8_DTYPES)
"""The KV cache dtypes its kernels read."""


class CpuBackend(TorchNativeBackend):
    """fp32 or bf16 on CPU; needs a C++ compiler and ninja the first time (see ``tokenmill.kernels.cpu``)."""

    name = "cpu"
    capabilities = BackendCapabilities(
        devices=("cpu",),
        dtypes=SUPPORTED_DTYPES,
        converts_kv_dtype=True,
        kv_int8=True,
        kv_fp8=True,
        sliding_window=True,
        softcap=True,
        cuda_graphs=False,
        cpu_decode_forward=True,
    )

    def __init__(
        self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float | None = None, softcap: float | None = None
    ) -> None:
        super().__init__(n_heads, n_kv_heads, head_dim, scale, softcap)
        kernels = load_cpu_kernels()
        if kernels is None:
            raise RuntimeError(
                "attention_backend='cpu' needs its C++ kernels, which failed to build (see the log: a C++ "
                "compiler and `pip install ninja` are required); use attention_backend='torch'"
            )
        self._kernels = kernels
        self._decode_kernel = kernels.paged_decode_attention
        self._prefill_kernel = kernels.paged_prefill_attention_
        self._causal_softmax = kernels.causal_softmax_

    def _layer_kv(self, view: KVView, layer: int) -> LayerKV:
        """An int8 or fp8 cache stored and read by the C++ ops (``kv_int8.cpp``, ``kv_fp8.cpp``; the torch
        path's results)."""
        return LayerKV.of(view, layer, self._kernels)

    def _decode(
        self,
        q: torch.Tensor,
        cache: LayerKV,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        req_to_token: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        kv_dtype = cache.k.dtype
        if q.device.type != "cpu" or q.dtype not in SUPPORTED_DTYPES or kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"the cpu attention backend supports fp32/bf16 CPU tensors and int8/fp8 KV, got {q.dtype} q and "
                f"{kv_dtype} KV on {q.device}"
            )
        if self.softcap is not None:  # the decode kernel does not soft-cap
            return super()._decode(q, cache, req_pool_indices, seq_lens, max_len, req_to_token, window)
        return self._decode_kernel(
            q,
            cache.k,
            cache.v,
            req_to_token,
            req_pool_indices.contiguous(),
            seq_lens.contiguous(),
            self.scale,
            window or 0,
            cache.k_scale,
            cache.v_scale,
        )

    def _prefill_requests(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKV,
        view: PrefillKVCache,
        window: int | None,
        requests: list[int],
        out: torch.Tensor,
    ) -> None:
        """Every request in one ``paged_prefill_attention_`` call, reading its keys and values in place
        from a cache in the queries' dtype; the per-request matmul path otherwise (int8/fp8 or
        converted caches, soft-capping, head_dim not a multiple of 16 or above 256)."""
        plain_cache = not cache.quantized and cache.k.dtype == q.dtype
        kernel_head = self.head_dim % 16 == 0 and self.head_dim <= PREFILL_KERNEL_MAX_HEAD_DIM
        if not requests or not plain_cache or self.softcap is not None or not kernel_head:
            return super()._prefill_requests(q, k, v, cache, view, window, requests, out)
        rows, starts, prefix, extend = view.req_pool_indices, view.qo_indptr[:-1], view.prefix_lens, view.extend_lens
        if len(requests) < len(view.extend_lens_cpu):
            idx = torch.tensor(requests)
            rows, starts, prefix, extend = rows[idx], starts[idx], prefix[idx], extend[idx]
        self._prefill_kernel(
            out,
            q,
            cache.k,
            cache.v,
            view.req_to_token,
            rows.contiguous(),
            starts.contiguous(),
            prefix.contiguous(),
            extend.contiguous(),
            self.scale,
            window or 0,
        )

    def _attend_causal(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, window: int | None
    ) -> torch.Tensor:
        """Prefill rows of one request as two matmuls batched over the KV heads around a fused
        scale + causal (and sliding-window) mask + softmax, over query blocks small enough to bound
        the score buffer; a block reads the keys from the first one in its first row's window.
        Short query blocks keep the torch path, which needs fewer op calls. In bf16 the matmuls run
        in bf16 (AMX where the CPU has it) and the softmax in fp32 on the bf16 scores, its
        probabilities rounded to bf16 in place, as transformers' eager attention does."""
        n, group, dim = q.shape[0], self.n_heads // self.n_kv_heads, self.head_dim
        if n < MIN_KERNEL_QUERY_ROWS:
            return super()._attend_causal(q, keys, values, prefix, window)
        queries = q.view(n, self.n_kv_heads, group, dim).permute(1, 2, 0, 3).contiguous()  # [Hkv, G, n, D]
        keys, values = keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous()  # [Hkv, S, D]
        out = torch.empty_like(queries)
        block = max(1, SCORE_BUFFER_FLOATS // (self.n_heads * keys.shape[1]))
        for start in range(0, n, block):
            stop = min(n, start + block)
            rows, visible = stop - start, prefix + stop  # the block's last row sees keys before `visible`
            first = 0 if window is None else max(0, prefix + start - window + 1)  # its first row's first key
            block_queries = queries[:, :, start:stop].reshape(self.n_kv_heads, group * rows, dim)
            scores = torch.matmul(block_queries, keys[:, first:visible].transpose(1, 2))
            scale = self.scale
            if self.softcap is not None:  # transformers' order: scale, / cap, tanh, * cap; then no scale
                scores = torch.tanh(scores.float().mul_(scale).div_(self.softcap)).mul_(self.softcap)
                scale = 1.0
            self._causal_softmax(
                scores.view(self.n_heads, rows, visible - first), prefix + start - first, scale, window or 0
            )
            probs = scores.to(q.dtype)  # bf16 scores hold bf16 probabilities already (the kernel rounds once)
            out[:, :, start:stop] = torch.matmul(probs, values[:, first:visible]).view(
                self.n_kv_heads, group, rows, dim
            )
        return out.permute(2, 0, 1, 3).reshape(n, self.n_heads, dim)
