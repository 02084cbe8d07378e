"""KV cache layers 1 and 2.

Layer 1, :class:`KVStorage`: one slot holds the keys and values of one token for every layer.
It knows nothing about requests.

Layer 2, :class:`ReqToTokenPool`: ``table[row, pos]`` is the slot of token ``pos`` of the request
that owns ``row``. Rows are handed out and returned; a returned row is cleared so its old contents
can never leak into the next request that gets it.
"""

from __future__ import annotations

import threading

import torch

RESERVED_SLOT = 0
"""Never handed to a request: padded or masked entries may read it or write their k/v there."""
_EMPTY = torch.empty(0, dtype=torch.int64)
NO_WRITES = (_EMPTY, _EMPTY, _EMPTY)
"""A journal with no entries (shared: never written to)."""


class KVStorage:
    """``k_buffer`` / ``v_buffer`` of shape ``[n_layers, n_slots, n_kv_heads, head_dim]``; with dtype
    int8 also ``k_scale`` / ``v_scale`` ``[n_layers, n_slots, n_kv_heads]`` fp32 (a slot's values
    are ``buffer * scale``, see ``cache/kv_quant.py``; None otherwise: an fp8 cache's scale is a fixed
    1, ``cache/kv_fp8.py``).

    Buffers are allocated uninitialized (untouched memory costs nothing until used): every slot
    is written before it is read, except ``RESERVED_SLOT``, which padded or masked reads may touch and
    which is zeroed so it can never inject NaN into a masked attention.
    """

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(n_layers, n_slots, n_kv_heads, head_dim) < 1:
            raise ValueError("KVStorage dimensions must all be >= 1")
        shape = (n_layers, n_slots, n_kv_heads, head_dim)
        self.k_buffer = torch.empty(shape, dtype=dtype, device=device)
        self.v_buffer = torch.empty(shape, dtype=dtype, device=device)
        self.k_buffer[:, RESERVED_SLOT].zero_()
        self.v_buffer[:, RESERVED_SLOT].zero_()
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if dtype == torch.int8:
            self.k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)

    @property
    def n_slots(self) -> int:
        return self.k_buffer.shape[1]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys and values of slots ``src`` into slots ``dst``, in every layer."""
        src, dst = src.to(self.k_buffer.device), dst.to(self.k_buffer.device)
        for buffer in self._buffers():  # an int8 cache's scales too
            buffer[:, dst] = buffer[:, src]

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies (on the CPU) of the keys and values of ``slots`` (``[n_layers, len(slots), n_kv_heads,
        head_dim]``), and of an int8 cache's key and value scales (``[n_layers, len(slots), n_kv_heads]``)."""
        slots = slots.to(self.k_buffer.device)
        return tuple(buffer[:, slots].cpu() for buffer in self._buffers())

    def write_slots(self, slots: torch.Tensor, *parts: torch.Tensor) -> None:
        """Store ``parts`` (as ``read_slots`` returns them) as the contents of ``slots``."""
        slots = slots.to(self.k_buffer.device)
        for buffer, part in zip(self._buffers(), parts, strict=True):
            buffer[:, slots] = part.to(buffer.device)

    def _buffers(self) -> list[torch.Tensor]:
        scales = [self.k_scale, self.v_scale] if self.k_scale is not None and self.v_scale is not None else []
        return [self.k_buffer, self.v_buffer, *scales]

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes that one token's keys and values take over all layers (an int8 cache's scales included;
        fp8: one byte a value, nothing more)."""
        scales = 4 if dtype == torch.int8 else 0
        return 2 * n_layers * n_kv_heads * (head_dim * torch.empty((), dtype=dtype).element_size() + scales)


class ReqToTokenPool:
    """int32 table ``[max_rows, max_context_len]`` mapping (request row, position) -> slot.

    ``alloc``/``free`` are thread-safe. Only the row's owner writes into its row, through
    :meth:`write` or :meth:`write_positions`. A freed row is zeroed, so a new owner never sees the
    previous owner's slots. With ``journal`` every write is also recorded until
    :meth:`take_journal`, so a replica of the table elsewhere (another tensor-parallel rank) can
    apply the same writes; a replica's freed rows are not cleared, and nothing reads a position of a
    row its owner has not written.
    """

    def __init__(self, max_rows: int, max_context_len: int, device: torch.device | str, journal: bool = False) -> None:
        if max_rows < 1 or max_context_len < 1:
            raise ValueError("ReqToTokenPool needs max_rows >= 1 and max_context_len >= 1")
        self.table = torch.zeros((max_rows, max_context_len), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._lock = threading.Lock()
        self._journal: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = [] if journal else None

    @property
    def max_rows(self) -> int:
        return self.table.shape[0]

    @property
    def max_context_len(self) -> int:
        return self.table.shape[1]

    @property
    def n_free(self) -> int:
        with self._lock:
            return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when all rows are taken."""
        with self._lock:
            return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        """Clear ``row`` and return it. Freeing a row twice raises."""
        if not 0 <= row < self.max_rows:
            raise ValueError(f"row {row} out of range [0, {self.max_rows})")
        self.table[row].zero_()
        with self._lock:
            if row in self._free_rows:
                raise RuntimeError(f"request row {row} freed twice")
            self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record ``slots`` as the slots of positions ``start ..`` of ``row``."""
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(f"position {end} beyond max_context_len {self.max_context_len}")
        self.table[row, start:end] = slots.to(self.table.device, torch.int32)
        if self._journal is not None:
            positions = torch.arange(start, end)
            self._journal.append((torch.full_like(positions, row), positions, slots.to("cpu", torch.int64)))

    def write_positions(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Record ``slots[j]`` as the slot of position ``positions[j]`` of row ``rows[j]`` (int64 CPU tensors)."""
        self.table[rows, positions] = slots.to(self.table.device, torch.int32)
        if self._journal is not None:
            self._journal.append((rows, positions, slots.to(torch.int64)))

    def take_journal(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, positions, slots)``: the entries written since the last call (each position's last
        write; empty without a journal), and a fresh journal."""
        entries = self._journal or []
        if self._journal is not None:
            self._journal = []
        if not entries:
            return NO_WRITES
        rows, positions, slots = (torch.cat(parts) for parts in zip(*entries))
        keys, which = torch.unique(rows * self.max_context_len + positions, return_inverse=True)
        order = torch.arange(which.numel())
        last = torch.zeros(keys.numel(), dtype=torch.int64).scatter_reduce_(0, which, order, "amax")
        return rows[last], positions[last], slots[last]  # one entry per position: the last written
