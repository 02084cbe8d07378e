"""Products with quantized weights against unquantized ones, kernel by kernel, in one run.

Thirty random weights of one shape (default SmolLM2-135M's MLP up projection, N=3072 x K=576, so
a run reads more than the caches hold), multiplied by x of each row count in ``--dtype`` (bf16 by
default; float32 on CPUs without bf16 hardware): tokenmill's ``Linear`` in that dtype (oneDNN
blocked / skinny), and int4 (default groups) and int8 (per channel) in each layout: panels (int8
activations, ``quant_int8_dot.cpp``; needs AVX512-VNNI; AMX-INT8 tiles from 6 rows where the CPU
has them) and rows (fp32 streaming up to ``STREAM_MAX_ROWS`` rows, 6 or with AVX2 alone 128;
dequantized + torch's BLAS beyond). Median ms for all thirty of ``--repeats`` runs after a warm-up;
nothing else should run on the machine meanwhile.

    python benchmarks/quantized_kernels.py --json [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from results import save  # this script's folder is on sys.path

from tokenmill.kernels.linear import Linear
from tokenmill.kernels.quant_format import QuantScheme, quantize, to_panels
from tokenmill.kernels.quant_linear import int8_dot_products, quantized_linear

SCHEMES = {"int4": QuantScheme(4, None, symmetric=False), "int8": QuantScheme(8)}


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=(3072, 576), metavar=("N", "K"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    n, k = args.shape
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    layers = [Linear(k, n, bias=False).to(dtype) for _ in range(30)]
    weights = {}
    for name, scheme in SCHEMES.items():
        rows_layout = [quantize(layer.weight, scheme) for layer in layers]
        weights[f"{name} rows"] = rows_layout
        if int8_dot_products():
            weights[f"{name} panels"] = [to_panels(w) for w in rows_layout]
    results = {}
    with torch.no_grad():
        for m in args.rows:
            x = torch.randn(m, k).to(dtype)
            row = {args.dtype: median_ms(lambda x=x: [layer(x) for layer in layers], args.repeats)}
            for name, quantized in weights.items():
                row[name] = median_ms(lambda x=x, q=quantized: [quantized_linear(x, w) for w in q], args.repeats)
            results[m] = row
    summary = {"shape": [n, k], "dtype": args.dtype, "ms_for_30_products": results}
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    save("quantized_kernels", summary)


if __name__ == "__main__":
    main()
