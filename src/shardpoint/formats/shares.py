"""How a rank's items or files are split over its reading and writing threads.

Threads pay off for bytes, not for items: copying, hashing and file I/O of a large
tensor run outside the GIL, but the per-item work of a small one (its archive, its read
item, its copy) is Python, which a second thread only contends for. Measured on one rank
(2 cores, /dev/shm, 10,000 tensors of 256 fp32 values): save 0.94 s with one thread
against 1.79 s with four, load 1.97 s against 3.23 s; a 911 MB state of large tensors
saves in 0.23 s with four threads against 0.38 s with one. So a rank uses as many
threads as its large items fill, at least one and at most the configured number.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

__all__ = ["LARGE_ITEM_BYTES", "THREAD_MIN_BYTES", "balanced", "useful_threads"]

K = TypeVar("K")

#: an item at least this big moves mostly outside the GIL
LARGE_ITEM_BYTES = 1 << 20
#: bytes of large items that make one more thread worth starting
THREAD_MIN_BYTES = 32 << 20


def useful_threads(sizes: Iterable[int], limit: int) -> int:
    """Threads worth running for items of these sizes: one per :data:`THREAD_MIN_BYTES` of large items."""
    large = sum(size for size in sizes if size >= LARGE_ITEM_BYTES)
    return max(1, min(limit, large // THREAD_MIN_BYTES))


def balanced(sizes: dict[K, int], workers: int) -> list[list[K]]:
    """Names (files to read, items to write) split by their bytes into at most ``workers`` shares of similar size."""
    shares: list[list[K]] = [[] for _ in range(max(1, min(workers, len(sizes))))]
    loads = [0] * len(shares)
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        lightest = loads.index(min(loads))
        shares[lightest].append(name)
        loads[lightest] += sizes[name]
    return [share for share in shares if share]
