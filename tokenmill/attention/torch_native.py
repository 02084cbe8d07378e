"""Reference attention backend in plain PyTorch; runs on any device.

Every other backend is tested against this one. Decode rows (one query token) are attended in
one batched call whatever the step's phase; prefill rows are attended per request (ragged, causal
mask offset by the cached prefix). A sliding window is applied by reading only the keys that some
query of the call can see (a decode row's last ``sliding_window``) and masking the rest. GQA never
copies K/V per query head: the query heads of one KV head are folded into the query-row dimension
instead. With soft-capping (``softcap``) scores are computed explicitly, in transformers' eager order
(``q.k * scale``, ``/ softcap``, tanh, ``* softcap``, mask, fp32 softmax); without it, by SDPA.
It plans nothing: its plan is the view itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.capabilities import BackendCapabilities
from tokenmill.cache.kv_quant import LayerKV
from tokenmill.cache.views import DecodeKVCache, KVView, PrefillKVCache

DECODE_GROUP = 16  # decode requests padded together (sorted by length) in one attention call


class TorchNativeBackend(AttentionBackend[KVView]):
    name = "torch"
    capabilities = BackendCapabilities(
        devices=None,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        converts_kv_dtype=True,
        kv_int8=True,
        kv_fp8=True,
        sliding_window=True,
        softcap=True,
        cuda_graphs=False,
        cpu_decode_forward=False,
    )

    def plan(self, view: KVView) -> KVView:
        return view

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_view: KVView,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        self._check_fwd(q, k, v, layer_id, kv_view, sliding_window)
        cache = self._layer_kv(kv_view, layer_id)
        cache.store(kv_view.out_cache_loc, k, v)
        if isinstance(kv_view, DecodeKVCache):
            return self._decode(
                q,
                cache,
                kv_view.req_pool_indices,
                kv_view.seq_lens,
                kv_view.max_seq_len,
                kv_view.req_to_token,
                sliding_window,
            )
        return self._prefill(q, k, v, cache, kv_view, sliding_window)

    def _layer_kv(self, view: KVView, layer: int) -> LayerKV:
        """Layer ``layer`` of the view's cache, stored and read in plain PyTorch."""
        return LayerKV.of(view, layer)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKV,
        view: PrefillKVCache,
        window: int | None,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        extend = view.extend_lens_cpu
        single = [i for i, n in enumerate(extend) if n == 1]
        rest = range(len(extend))
        if len(single) > 1:  # decode-like rows of a mixed step: one batched call
            idx = torch.tensor(single, device=q.device)
            rows = view.qo_indptr[idx]
            max_len = max(view.prefix_lens_cpu[i] + 1 for i in single)
            out[rows] = self._decode(
                q[rows],
                cache,
                view.req_pool_indices[idx],
                view.seq_lens[idx],
                max_len,
                view.req_to_token,
                window,
            )
            rest = [i for i, n in enumerate(extend) if n != 1]
        self._prefill_requests(q, k, v, cache, view, window, list(rest), out)
        return out

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
        """Writes the outputs of the view's requests ``requests`` (by index) into their rows of ``out``,
        one request at a time."""
        starts = view.qo_indptr.tolist()
        rows = view.req_pool_indices.tolist()
        for i in requests:
            start, prefix, n = starts[i], view.prefix_lens_cpu[i], view.extend_lens_cpu[i]
            first = 0 if window is None else max(0, prefix - window + 1)  # first key any row sees
            if prefix == 0 and not cache.quantized:  # nothing cached: this step's k/v are the whole context
                keys, values = k[start : start + n], v[start : start + n]
            else:  # (an int8 or fp8 cache's rows are read back: attention sees the values it stored)
                keys, values = cache.read(view.req_to_token[rows[i], first : prefix + n].long(), q.dtype)
            out[start : start + n] = self._attend_causal(q[start : start + n], keys, values, prefix - first, window)

    def _attend_causal(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, window: int | None
    ) -> torch.Tensor:
        """Query rows at positions ``prefix ..`` over keys ``0 ..`` (positions counted from the first
        key given), each within its ``window`` when not None; q ``[E, H, D]``, k/v ``[S, Hkv, D]``."""
        n, group = q.shape[0], self.n_heads // self.n_kv_heads
        total = keys.shape[0]
        if window is not None and prefix + n <= window:
            window = None  # no row's window excludes a key
        # [E, Hkv, G, D] -> [Hkv, G*E, D]: all query heads of a KV head share its keys
        queries = (
            q.view(n, self.n_kv_heads, group, self.head_dim)
            .permute(1, 2, 0, 3)
            .reshape(self.n_kv_heads, group * n, self.head_dim)
        )
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [Hkv, S, D]
        if prefix == 0 and window is None:
            mask = None
            if group > 1:
                mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril_().repeat(group, 1)
            attn = self._sdpa(queries, keys, values, mask)
        else:
            q_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
            key_pos = torch.arange(total, device=q.device)[None, :]
            mask = key_pos <= q_pos  # [E, S]
            if window is not None:
                mask &= key_pos > q_pos - window
            attn = self._sdpa(queries, keys, values, mask.repeat(group, 1))
        return (
            attn.view(self.n_kv_heads, group, n, self.head_dim)
            .permute(2, 0, 1, 3)
            .reshape(n, self.n_heads, self.head_dim)
        )

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
        """One query token per request: q ``[B, H, D]``, each over its last ``window`` keys (all when None).

        Requests are padded to a common length for one batched call; a large batch is first
        sorted by length into groups of ``DECODE_GROUP`` so that short contexts are not padded
        (and gathered) up to the longest one.
        """
        batch = q.shape[0]
        if batch <= DECODE_GROUP:
            return self._decode_padded(q, cache, req_pool_indices, seq_lens, max_len, req_to_token, window)
        lens = seq_lens.tolist()
        order = sorted(range(batch), key=lens.__getitem__)
        out = torch.empty_like(q)
        for start in range(0, batch, DECODE_GROUP):
            members = order[start : start + DECODE_GROUP]
            idx = torch.tensor(members, device=q.device)
            out[idx] = self._decode_padded(
                q[idx], cache, req_pool_indices[idx], seq_lens[idx], lens[members[-1]], req_to_token, window
            )
        return out

    def _decode_padded(
        self,
        q: torch.Tensor,
        cache: LayerKV,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        req_to_token: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        batch = q.shape[0]
        group = self.n_heads // self.n_kv_heads
        if window is None or max_len <= window:  # every key of every request
            positions = torch.arange(max_len, device=q.device)[None, :]
            table = req_to_token[req_pool_indices, :max_len]
        else:  # each request's last `window` positions
            max_len = window
            first = torch.clamp(seq_lens - window, min=0)
            positions = first[:, None] + torch.arange(window, device=q.device)[None, :]
            table = req_to_token[req_pool_indices[:, None], positions]
        valid = positions < seq_lens[:, None]  # [B, L]
        keys, values = cache.read(torch.where(valid, table, 0).long(), q.dtype)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, L, D]
        queries = q.view(batch, self.n_kv_heads, group, self.head_dim)  # [B, Hkv, G, D]
        attn = self._sdpa(queries, keys, values, valid[:, None, None, :])
        return attn.reshape(batch, self.n_heads, self.head_dim)

    def _sdpa(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``softmax(scores) @ values`` with ``scores = queries @ keys^T * scale`` (soft-capped when
        ``softcap``) where the boolean ``mask`` allows (None: causal over square scores)."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale
            )
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril_()
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(queries.dtype), values)
