"""RuntimeOptions: how a step runs: the attention backend and its tiles, CPU threads and memory,
CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.options import at_least, option

ATTENTION_BACKENDS = ("torch", "cpu", "triton")
"""Backends ``attention_backend`` may name besides "auto", in "auto"'s order of preference; the
factory (``attention/factory.py``) builds each of them."""


@dataclass(frozen=True)
class RuntimeOptions:
    """The runtime group of :class:`~tokenmill.config.EngineConfig`."""

    cpu_threads: int = option(
        0,
        "Threads of the engine's parallel ops on CPU. 0: adapt them to the CPUs this process may use "
        "(affinity, cgroup quota) less the load beside the engine (other processes, the server's own "
        "threads), measured every half second; a number fixes them.",
        section="model",
    )
    cpu_keep_freed_memory: bool = option(
        True,
        "On CPU (Linux, glibc): keep the memory the process frees for reuse (malloc thresholds), so a "
        "step's large temporaries come back without page faults; the resident size stays at its peak. "
        "The setting is the whole process's.",
        section="model",
    )
    attention_backend: str = option(
        "auto",
        '"auto" (triton on CUDA; "cpu" for fp32 on CPU when its C++ kernels build; else torch), "torch", '
        '"cpu" or "triton"; explicit choices are strict.',
        section="Attention",
    )
    prefill_q_tile: int = option(16, "Query rows per tile of the ragged prefill kernel.", section="Attention")
    max_decode_splits: int = option(
        16,
        "Cap on the number of KV splits per request in the split-KV decode kernel.",
        section="Attention",
    )
    decode_split_min_tokens: int = option(
        256,
        "A decode split covers at least this many context tokens.",
        section="Attention",
    )
    cuda_graphs: bool = option(
        True,
        "Capture steady-state decode steps in CUDA graphs (GPU only).",
        section="CUDA graphs",
    )
    cuda_graph_max_batch: int = option(64, "Largest decode batch captured in a CUDA graph.", section="CUDA graphs")

    def __post_init__(self) -> None:
        if self.attention_backend != "auto" and self.attention_backend not in ATTENTION_BACKENDS:
            choices = ", ".join(repr(name) for name in ("auto", *ATTENTION_BACKENDS))
            raise ValueError(f"attention_backend must be one of {choices}, got {self.attention_backend!r}")
        at_least(self, 1, "prefill_q_tile", "max_decode_splits", "cuda_graph_max_batch", "decode_split_min_tokens")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0 (0: adaptive), got {self.cpu_threads}")
