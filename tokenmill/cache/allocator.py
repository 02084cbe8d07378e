"""Reference-counted allocator of fixed-size KV-cache pages."""

from __future__ import annotations

import torch

from tokenmill.cache.storage import RESERVED_SLOT

RESERVED_PAGE = RESERVED_SLOT
"""The page holding ``RESERVED_SLOT`` (page 0 for every page size): never handed out."""

MAX_PAGE_SIZE = 256


class PageAllocator:
    """Hands out KV-cache pages and tracks how many holders each one has.

    Slots are grouped in pages of ``page_size`` slots; page ``p`` covers slots
    ``[p * page_size, (p + 1) * page_size)``. Page 0 is reserved as a dummy
    write target and is never allocated, freed or ref-counted.

    Invariants (for every page ``p >= 1``):

    * ``p`` is on the free stack exactly once iff ``refcount(p) == 0``;
    * ``n_free + n_used == capacity == n_pages - 1``.

    ``alloc``, ``incref`` and ``decref`` cost O(k) in the number of pages
    involved, never O(n_pages). Page tensors are 1-D int64 CPU tensors.

    Not thread-safe: the single engine thread owns the allocator.
    """

    def __init__(self, n_pages: int, page_size: int) -> None:
        """Create an allocator for ``n_pages`` pages (page 0 included) of ``page_size`` slots.

        Raises ValueError unless ``n_pages >= 2`` and ``page_size`` is a power
        of two in ``[1, 256]``.
        """
        if isinstance(n_pages, bool) or not isinstance(n_pages, int) or n_pages < 2:
            raise ValueError(f"n_pages must be an int >= 2 (page 0 is reserved), got {n_pages!r}")
        if (
            isinstance(page_size, bool)
            or not isinstance(page_size, int)
            or not 1 <= page_size <= MAX_PAGE_SIZE
            or page_size & (page_size - 1)
        ):
            raise ValueError(f"page_size must be a power of two in [1, {MAX_PAGE_SIZE}], got {page_size!r}")
        self._n_pages = n_pages
        self._page_size = page_size
        self._refcount = torch.zeros(n_pages, dtype=torch.int32)
        # Free pages live in _free[:_top]; the top of the stack is _free[_top - 1].
        self._free = torch.empty(n_pages - 1, dtype=torch.int64)
        self._top = 0
        self._slot_offsets = torch.arange(page_size, dtype=torch.int64)
        self.reset()

    def reset(self) -> None:
        """Return every page to the free list and zero all refcounts."""
        self._refcount.zero_()
        # Stored descending so that a fresh allocator hands out pages 1, 2, 3, ...
        torch.arange(self._n_pages - 1, 0, -1, dtype=torch.int64, out=self._free)
        self._top = self._n_pages - 1

    @property
    def page_size(self) -> int:
        """Slots per page."""
        return self._page_size

    @property
    def n_pages(self) -> int:
        """Total number of pages, including the reserved page 0."""
        return self._n_pages

    @property
    def capacity(self) -> int:
        """Number of allocatable pages (``n_pages - 1``)."""
        return self._n_pages - 1

    @property
    def n_free(self) -> int:
        """Number of pages currently on the free list."""
        return self._top

    @property
    def n_used(self) -> int:
        """Number of pages with refcount > 0."""
        return self.capacity - self._top

    @property
    def usage(self) -> float:
        """Fraction of ``capacity`` in use, in ``[0, 1]``."""
        return self.n_used / self.capacity

    def alloc(self, n: int) -> torch.Tensor | None:
        """Allocate ``n`` pages, each with refcount 1.

        All-or-nothing: returns None and changes nothing if fewer than ``n``
        pages are free. ``n == 0`` returns an empty tensor.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._top:
            return None
        pages = self._free[self._top - n : self._top].flip(0)
        self._top -= n
        self._refcount[pages] = 1
        return pages

    def incref(self, pages: torch.Tensor) -> None:
        """Add one holder to each of ``pages``.

        Every page must currently be allocated (RuntimeError otherwise, and
        nothing changes). Each page may appear at most once per call.
        """
        pages = self._check_pages(pages, allow_reserved=False)
        counts = self._refcount[pages]
        if bool((counts <= 0).any()):
            bad = pages[counts <= 0].tolist()
            raise RuntimeError(f"incref of unallocated pages {bad}")
        self._refcount[pages] = counts + 1

    def decref(self, pages: torch.Tensor) -> int:
        """Drop one holder from each of ``pages``; return how many pages became free.

        Pages reaching refcount 0 go back on the free list. Decref of a free
        page is a double free and raises RuntimeError (nothing changes). Each
        page may appear at most once per call.
        """
        pages = self._check_pages(pages, allow_reserved=False)
        counts = self._refcount[pages]
        if bool((counts <= 0).any()):
            bad = pages[counts <= 0].tolist()
            raise RuntimeError(f"double free: decref of free pages {bad}")
        counts -= 1
        self._refcount[pages] = counts
        freed = pages[counts == 0]
        n_freed = freed.numel()
        self._free[self._top : self._top + n_freed] = freed
        self._top += n_freed
        return n_freed

    def refcount(self, pages: torch.Tensor) -> torch.Tensor:
        """Refcounts (int32) of ``pages``, as a copy."""
        return self._refcount[self._check_pages(pages, allow_reserved=True)]

    def is_free(self, page: int) -> bool:
        """Whether ``page`` can be handed out by ``alloc`` (always False for page 0)."""
        if not 0 <= page < self._n_pages:
            raise IndexError(f"page {page} out of range [0, {self._n_pages})")
        return page != RESERVED_PAGE and int(self._refcount[page]) == 0

    def free_pages(self) -> torch.Tensor:
        """Copy of the free list, in stack order (O(n_free); for checks and debugging)."""
        return self._free[: self._top].clone()

    def slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        """int64 slot indices covered by ``pages``, page by page, in page order."""
        pages = self._check_pages(pages, allow_reserved=True)
        return (pages[:, None] * self._page_size + self._slot_offsets).reshape(-1)

    def _check_pages(self, pages: torch.Tensor, *, allow_reserved: bool) -> torch.Tensor:
        """Validate a 1-D integer page tensor and return it as int64."""
        if not isinstance(pages, torch.Tensor):
            raise TypeError(f"pages must be a torch.Tensor, got {type(pages).__name__}")
        if pages.dim() != 1 or pages.dtype == torch.bool or pages.dtype.is_floating_point or pages.dtype.is_complex:
            raise ValueError(f"pages must be a 1-D integer tensor, got shape {tuple(pages.shape)} dtype {pages.dtype}")
        pages = pages.to(device="cpu", dtype=torch.int64)
        if pages.numel():
            low = RESERVED_PAGE if allow_reserved else RESERVED_PAGE + 1
            lo, hi = (int(x) for x in torch.aminmax(pages))
            if lo < low or hi >= self._n_pages:
                raise ValueError(f"page ids must lie in [{low}, {self._n_pages}), got range [{lo}, {hi}]")
        return pages
