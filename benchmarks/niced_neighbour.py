"""Batch-1 decode beside a niced neighbour: does the thread governor keep its threads?

One engine on the default model (adaptive threads unless ``--cpu-threads``), greedy, 128 tokens a
request, 4 requests per phase; phases: quiet, beside one busy process at ``nice`` +10, quiet again,
niced again, and beside one busy process at the engine's own priority. Prints each phase's ms per
token (median of 4), the engine's thread count at its end and the governor's changes so far.

    python benchmarks/niced_neighbour.py [--cpu-threads 0]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from results import save  # this script's folder is on sys.path

TOKENS = 128


def spinner(niceness: int) -> list[str]:
    return [sys.executable, "-c", f"import os\nos.nice({niceness})\nwhile True: pass"]


def main() -> None:
    from tokenmill import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-threads", type=int, default=0)
    args = parser.parse_args()
    llm = LLM(cpu_threads=args.cpu_threads)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)

    def ms_per_token() -> float:
        start = time.perf_counter()
        llm.generate(["Tell me a story about a cat."], params, use_tqdm=False)
        return (time.perf_counter() - start) / TOKENS * 1000

    ms_per_token()  # warm-up
    phases = [("quiet", None), ("nice +10", 10), ("quiet", None), ("nice +10", 10), ("busy, nice 0", 0)]
    result = []
    for label, niceness in phases:
        neighbour = subprocess.Popen(spinner(niceness)) if niceness is not None else None
        time.sleep(0.5)
        times = [ms_per_token() for _ in range(4)]
        stats = llm.engine.stats()
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
        print(
            f"{label:14s} median {statistics.median(times):5.1f} ms/token {[round(t, 1) for t in times]} "
            f"threads {stats['cpu_threads']} changes {stats['cpu_thread_changes']}",
            flush=True,
        )
        result.append(
            {
                "phase": label,
                "median_ms_per_token": statistics.median(times),
                "ms_per_token": times,
                "cpu_threads": stats["cpu_threads"],
                "cpu_thread_changes": stats["cpu_thread_changes"],
            }
        )
    llm.shutdown()
    save("niced_neighbour", {"phases": result})


if __name__ == "__main__":
    main()
