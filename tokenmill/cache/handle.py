"""KVHandle: one sequence's hold on the KV cache, owned and written only by the CacheManager.

The engine's sequence keeps a handle and reads it; the cache never sees the engine's types.
``handle_id`` is unique for the life of the process, so the steady-state decode guard
(``CacheManager.bind_decode``) tells sequences apart even when one reuses another's row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tokenmill.cache.radix import RadixNode

_handle_ids = itertools.count()


@dataclass(eq=False)
class KVHandle:
    """Positions ``0 .. n_kv-1`` of the sequence have slots recorded in request-to-token ``row``."""

    handle_id: int = field(default_factory=lambda: next(_handle_ids))
    row: int | None = None  # None while the sequence holds no KV (waiting, preempted, finished)
    n_kv: int = 0
    prefix_node: RadixNode | None = None  # radix node locked on behalf of the sequence
    n_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    prompt_cached: bool = False  # the prompt's full pages are in the radix cache
    epoch: int = -1  # the prefix-cache epoch its KV was computed in (see CacheManager.epoch)
