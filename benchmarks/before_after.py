"""The reference workload on an earlier commit and on this tree, alternating, each run a fresh process:
does a change keep the speed? Prints and saves each run's output tok/s and the ratio of the medians.

    python benchmarks/before_after.py --before 361e819 [--runs 3] [-- extra flags for tokenmill bench throughput]

The earlier commit is checked out once into a git worktree (``--worktree``, default
``/tmp/tokenmill-before``), run from there with ``python -m tokenmill.cli`` so its own package is
imported; the C++ kernels' build is shared when their sources are the same. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from results import save

ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path, extra: list[str]) -> dict:
    """One ``tokenmill bench throughput --json`` in a fresh process, from ``tree``."""
    command = [sys.executable, "-m", "tokenmill.cli", "bench", "throughput", "--json", *extra]
    out = subprocess.run(command, cwd=tree, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, alternating (default 3)")
    parser.add_argument("--worktree", default="/tmp/tokenmill-before", help="where the earlier commit is checked out")
    parser.add_argument("extra", nargs="*", help="flags for tokenmill bench throughput (after --)")
    args = parser.parse_args()
    before = Path(args.worktree)
    if not before.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True)
    else:
        subprocess.run(["git", "checkout", "--detach", "--quiet", args.before], cwd=before, check=True)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.runs):
        for side, tree in (("before", before), ("after", ROOT)):
            result = run(tree, args.extra)
            runs[side].append(result)
            print(f"{side} {i + 1}: {result['output_tok_per_s']:.1f} output tok/s", file=sys.stderr, flush=True)
    medians = {side: statistics.median(r["output_tok_per_s"] for r in results) for side, results in runs.items()}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    summary = {
        "before_commit": args.before,
        "after_commit": head.stdout.strip(),
        "output_tok_per_s": {side: [r["output_tok_per_s"] for r in results] for side, results in runs.items()},
        "median": medians,
        "median_ratio_after_over_before": medians["after"] / medians["before"],
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    save("before_after", summary)


if __name__ == "__main__":
    main()
