"""Triton attention kernels and CUDA-graph decode on a GPU (exits with a message elsewhere).

1. Split-KV paged decode: GB/s of K/V read across batch sizes and context lengths, against
   ``torch.nn.functional.scaled_dot_product_attention`` on the same (dense-gathered) data and
   against the HBM peak.
2. Ragged paged prefill: TFLOP/s (causal FLOPs only) per ``q_tile``, against SDPA (``is_causal``)
   on equal-length batches and against the dense bf16 peak; plus a chunk over a cached prefix.
3. End to end: engine decode tokens/s on a random ~100M llama with and without CUDA graphs.

Peaks default to an H200 (4.8 TB/s HBM3e, 989 dense bf16 TFLOP/s); pass --peak-* for others.

    python benchmarks/attention_gpu.py                # everything, human-readable JSON
    python benchmarks/attention_gpu.py --json --skip-e2e
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from results import save  # this script's folder is on sys.path

PAGE_SIZE = 16


def bench_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` (Triton's do_bench: warm-up, L2 flushed between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


class PagedKV:
    """One layer of paged K/V for ``len(lens)`` requests: pages of ``PAGE_SIZE`` slots, shuffled."""

    def __init__(self, lens: list[int], n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        from tokenmill.cache.storage import KVStorage

        pages_per_req = [math.ceil(n / PAGE_SIZE) for n in lens]
        n_pages = sum(pages_per_req) + 1  # page 0 stays reserved
        self.storage = KVStorage(1, n_pages * PAGE_SIZE, n_kv_heads, head_dim, dtype, "cuda")
        self.storage.k_buffer.normal_()
        self.storage.v_buffer.normal_()
        pages = torch.randperm(n_pages - 1, device="cuda") + 1
        self.table = torch.zeros(len(lens), max(lens), dtype=torch.int32, device="cuda")
        start = 0
        for row, (n, p) in enumerate(zip(lens, pages_per_req)):
            slots = (pages[start : start + p, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device="cuda")).flatten()
            self.table[row, :n] = slots[:n].to(torch.int32)
            start += p
        self.lens = lens

    def dense(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``row``'s keys and values as ``[Hkv, L, D]`` (for SDPA)."""
        slots = self.table[row, : self.lens[row]].long()
        return self.storage.k_buffer[0, slots].transpose(0, 1), self.storage.v_buffer[0, slots].transpose(0, 1)


def decode_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenmill.attention.triton.decode import decode_attention
    from tokenmill.attention.triton.plan import TritonDecodePlan, split_counts
    from tokenmill.cache.view_builder import make_decode_view

    heads, kv_heads, dim, dtype = args.n_heads, args.n_kv_heads, args.head_dim, torch.bfloat16
    rows = []
    for batch in args.decode_batches:
        for ctx in args.decode_contexts:
            kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
            if 3 * kv_bytes > args.max_bytes:  # paged K/V plus the dense copies for SDPA
                continue
            kv = PagedKV([ctx] * batch, kv_heads, dim, dtype)
            partial_out = torch.empty(batch, heads, args.max_splits, dim, dtype=torch.float32, device="cuda")
            partial_lse = torch.empty(batch, heads, args.max_splits, dtype=torch.float32, device="cuda")
            loc = kv.table[:, ctx - 1].long()
            view = make_decode_view(kv.storage, kv.table, list(range(batch)), [ctx] * batch, loc)
            num_splits = split_counts(view.seq_lens, args.split_min_tokens, args.max_splits)
            plan = TritonDecodePlan(view, num_splits, partial_out, partial_lse)
            q = torch.randn(batch, heads, dim, dtype=dtype, device="cuda")
            k_cache, v_cache = kv.storage.k_buffer[0], kv.storage.v_buffer[0]
            scale = dim**-0.5
            ours = decode_attention(q, k_cache, v_cache, plan, scale)
            keys, values = zip(*(kv.dense(b) for b in range(batch)))
            keys, values = torch.stack(keys), torch.stack(values)  # [B, Hkv, L, D]
            sdpa = partial(F.scaled_dot_product_attention, q[:, :, None, :], keys, values, scale=scale, enable_gqa=True)
            err = (ours.float() - sdpa()[:, :, 0].float()).abs().max().item()
            t_ours = bench_ms(partial(decode_attention, q, k_cache, v_cache, plan, scale))
            t_sdpa = bench_ms(sdpa)
            gbps_ours, gbps_sdpa = kv_bytes / t_ours / 1e6, kv_bytes / t_sdpa / 1e6
            rows.append(
                {
                    "batch": batch,
                    "context": ctx,
                    "splits": int(num_splits[0]),
                    "triton_ms": round(t_ours, 4),
                    "triton_gbps": round(gbps_ours, 1),
                    "triton_frac_peak": round(gbps_ours / args.peak_gbps, 3),
                    "sdpa_ms": round(t_sdpa, 4),
                    "sdpa_gbps": round(gbps_sdpa, 1),
                    "speedup_vs_sdpa": round(t_sdpa / t_ours, 2),
                    "max_abs_err_vs_sdpa": err,
                }
            )
            del kv, keys, values, partial_out, partial_lse, view, plan
            torch.cuda.empty_cache()
    return rows


def causal_flops(prefix: int, extend: int, heads: int, dim: int) -> float:
    """QK^T and PV FLOPs of ``extend`` queries over a causal window after ``prefix`` cached tokens."""
    pairs = extend * prefix + extend * (extend + 1) / 2
    return 4.0 * heads * dim * pairs


def prefill_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenmill.attention.triton.plan import prefill_tiles
    from tokenmill.attention.triton.prefill import prefill_attention
    from tokenmill.cache.view_builder import make_prefill_view

    heads, kv_heads, dim, dtype = args.n_heads, args.n_kv_heads, args.head_dim, torch.bfloat16
    scale = dim**-0.5
    shapes = [(batch, 0, length) for batch, length in args.prefill_shapes] + [(1, args.chunk_prefix, args.chunk_len)]
    rows = []
    for batch, prefix, extend in shapes:
        total = prefix + extend
        kv = PagedKV([total] * batch, kv_heads, dim, dtype)
        q = torch.randn(batch * extend, heads, dim, dtype=dtype, device="cuda")
        loc = kv.table[:, prefix:total].flatten().long()
        flops = batch * causal_flops(prefix, extend, heads, dim)
        sdpa_ms = None
        if prefix == 0:
            keys, values = zip(*(kv.dense(b) for b in range(batch)))
            keys, values = torch.stack(keys), torch.stack(values)
            q4 = q.view(batch, extend, heads, dim).transpose(1, 2)
            sdpa = partial(
                F.scaled_dot_product_attention, q4, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )

            ref = sdpa().transpose(1, 2).reshape(batch * extend, heads, dim)
            sdpa_ms = bench_ms(sdpa)
        for q_tile in args.q_tiles:
            view = make_prefill_view(kv.storage, kv.table, list(range(batch)), [prefix] * batch, [extend] * batch, loc)
            plan = prefill_tiles(view, q_tile)
            k_cache, v_cache = kv.storage.k_buffer[0], kv.storage.v_buffer[0]
            out = prefill_attention(q, k_cache, v_cache, plan, scale)
            t = bench_ms(partial(prefill_attention, q, k_cache, v_cache, plan, scale))
            tflops = flops / t / 1e9
            row = {
                "batch": batch,
                "prefix": prefix,
                "extend": extend,
                "q_tile": q_tile,
                "triton_ms": round(t, 4),
                "triton_tflops": round(tflops, 1),
                "triton_frac_peak": round(tflops / args.peak_tflops, 3),
            }
            if sdpa_ms is not None:
                row |= {
                    "sdpa_ms": round(sdpa_ms, 4),
                    "sdpa_tflops": round(flops / sdpa_ms / 1e9, 1),
                    "speedup_vs_sdpa": round(sdpa_ms / t, 2),
                    "max_abs_err_vs_sdpa": (out.float() - ref.float()).abs().max().item(),
                }
            rows.append(row)
        del kv
        torch.cuda.empty_cache()
    return rows


def e2e_decode(path: Path, cuda_graphs: bool, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Decode tokens/s of ``batch`` requests prefilled in one step, then decoding in lockstep."""
    import random

    from tokenmill import LLM, SamplingParams

    prompt_len = args.e2e_prompt_len
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        attention_backend="triton",
        cuda_graphs=cuda_graphs,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        kv_cache_memory=args.e2e_kv_bytes,
        max_running_requests=max(batch, 8),
        cuda_graph_max_batch=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * prompt_len),
    )
    try:
        rng = random.Random(batch)
        prompts = [[rng.randrange(3, 32000) for _ in range(prompt_len)] for _ in range(batch)]
        params = SamplingParams(max_tokens=args.e2e_output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        graphs = getattr(llm.engine.worker, "graphs", None)
        wired = graphs is not None
        capture = dict(graphs.capture_seconds) if wired else {}
        del graphs
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    start = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return {
        "batch": batch,
        "cuda_graphs": cuda_graphs,
        "graphs_wired": wired,
        "decode_tok_s": round(tokens / (end - start), 1),
        "ms_per_step": round((end - start) * 1000 / (args.e2e_output_len - 1), 3),
        "capture_s": {str(k): round(v, 3) for k, v in capture.items()},
    }


def e2e_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenmill.bench.workload import make_random_model

    path = make_random_model()
    rows = []
    for batch in args.e2e_batches:
        off = e2e_decode(path, False, batch, args)
        on = e2e_decode(path, True, batch, args)
        on["speedup_vs_eager"] = round(on["decode_tok_s"] / off["decode_tok_s"], 2)
        rows += [off, on]
    return rows


def pairs(text: str) -> tuple[int, int]:
    batch, length = text.split("x")
    return int(batch), int(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-heads", type=int, default=32)
    parser.add_argument("--n-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--max-splits", type=int, default=16, help="max_decode_splits")
    parser.add_argument("--split-min-tokens", type=int, default=256, help="decode_split_min_tokens")
    parser.add_argument(
        "--prefill-shapes",
        type=pairs,
        nargs="+",
        default=[pairs(s) for s in ("8x512", "4x2048", "1x8192")],
        help="BATCHxLENGTH fresh prompts",
    )
    parser.add_argument("--chunk-prefix", type=int, default=4096, help="cached prefix of the chunked-prefill case")
    parser.add_argument("--chunk-len", type=int, default=512, help="extend length of the chunked-prefill case")
    parser.add_argument("--q-tiles", type=int, nargs="+", default=[16, 64, 128], help="prefill_q_tile values")
    parser.add_argument("--max-bytes", type=float, default=48e9, help="skip decode shapes needing more memory")
    parser.add_argument("--e2e-batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--e2e-prompt-len", type=int, default=64)
    parser.add_argument("--e2e-output-len", type=int, default=256)
    parser.add_argument("--e2e-kv-bytes", type=int, default=4 << 30)
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak, GB/s (H200: 4800)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak, TFLOP/s (H200: 989)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of indented JSON")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention_gpu.py needs a CUDA GPU; none is available here")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/attention_gpu.py needs the triton package")

    torch.manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "heads": {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim},
        "peaks": {"gbps": args.peak_gbps, "tflops": args.peak_tflops},
    }
    if not args.skip_decode:
        result["decode"] = decode_bench(args)
    if not args.skip_prefill:
        result["prefill"] = prefill_bench(args)
    if not args.skip_e2e:
        result["e2e_decode"] = e2e_bench(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    save("attention_gpu", result)


if __name__ == "__main__":
    main()
