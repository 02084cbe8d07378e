"""Reference attention backend in plain PyTorch; runs on any device.

Every other backend is tested against this one. Prefill attends per request (ragged, causal mask
offset by the cached prefix); decode is batched over all requests without a per-request loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend
from tokenmill.cache.views import DecodeKVCache, KVView, PrefillKVCache


class TorchNativeBackend(AttentionBackend):
    name = "torch"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, kv_view: KVView
    ) -> torch.Tensor:
        self._check_fwd(q, k, v, layer_id, kv_view)
        k_cache = kv_view.k_buffer[layer_id]
        v_cache = kv_view.v_buffer[layer_id]
        k_cache[kv_view.out_cache_loc] = k
        v_cache[kv_view.out_cache_loc] = v
        if isinstance(kv_view, DecodeKVCache):
            return self._decode(q, k_cache, v_cache, kv_view)
        return self._prefill(q, k_cache, v_cache, kv_view)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, view: PrefillKVCache
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        group = self.n_heads // self.n_kv_heads
        rows = view.req_pool_indices.tolist()
        start = 0
        for row, prefix, extend in zip(rows, view.prefix_lens_cpu, view.extend_lens_cpu):
            total = prefix + extend
            slots = view.req_to_token[row, :total].long()
            keys = k_cache[slots].transpose(0, 1)  # [Hkv, S, D]
            values = v_cache[slots].transpose(0, 1)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=0)
                values = values.repeat_interleave(group, dim=0)
            queries = q[start : start + extend].transpose(0, 1)  # [H, E, D]
            q_pos = torch.arange(prefix, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]  # [E, S]
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
            out[start : start + extend] = attn.transpose(0, 1)
            start += extend
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, view: DecodeKVCache
    ) -> torch.Tensor:
        batch = q.shape[0]
        group = self.n_heads // self.n_kv_heads
        max_len = view.max_seq_len
        positions = torch.arange(max_len, device=q.device)
        valid = positions[None, :] < view.seq_lens[:, None]  # [B, L]
        slots = view.req_to_token[view.req_pool_indices, :max_len].long()
        slots = torch.where(valid, slots, 0)
        keys = k_cache[slots].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        values = v_cache[slots].permute(0, 2, 1, 3)
        queries = q.view(batch, self.n_kv_heads, group, self.head_dim)  # [B, Hkv, G, D]
        mask = valid[:, None, None, :]
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return attn.reshape(batch, self.n_heads, self.head_dim)
