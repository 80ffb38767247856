"""Allocator settings for a process that moves tens of megabytes per request.

A 32k-token response carries about 27 MB of base64 routed experts from each
side; the merge decodes, concatenates and re-encodes them. glibc serves
allocations that large with fresh `mmap`s and unmaps them on free, so every
request pays page faults on every buffer; on a 2-core VM that was two thirds
of the merge time (benchmarks/proxy_merge.py measures both settings). Raising
glibc's mmap and trim thresholds keeps freed memory in the heap for the next
request instead. The cost is that the process keeps its peak heap mapped.

No-op (returns False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
REUSE_THRESHOLD_BYTES = 1 << 30


def reuse_freed_memory(threshold_bytes: int = REUSE_THRESHOLD_BYTES) -> bool:
    """Serve and keep allocations below `threshold_bytes` in glibc's heap."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes)
                and mallopt(M_TRIM_THRESHOLD, threshold_bytes))
