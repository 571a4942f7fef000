"""A CPU rank's heap kept steady from step to step: glibc malloc told to stop handing
freed memory back to the kernel and to serve tensors up to 32 MiB from the heap.

Why: by default glibc serves large blocks (from 128 KiB, raised as blocks are freed) with a
fresh mmap and trims the heap's free top, so every step's activations and gradients can land
on pages the kernel must fault in and zero again. How much depends on the process's history:
in `scripts/bench/ddp_parity.py`, gpt_small at 2 ranks, Loom's ranks (forked from the
agent's forkserver) took about 3,000 minor page faults per rank per step against a few
hundred for a plain torchrun script, and that alone made Loom's step 1.4% slower (paired
1.014 [1.008, 1.020]). With these two settings both sides take ~20 faults per step and the
ratio reads 1.004 [0.997, 1.011] (docs/benchmarks.md, issue 36). These are the settings
glibc's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ give; a user who sets either (or
runs another allocator) keeps theirs. CPU runs only: a GPU step's tensors are not on the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("loom")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc malloc.h
MMAP_THRESHOLD = 32 * 2**20   # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**30        # freed memory at the heap's top kept up to 1 GiB
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")


def keep_heap(accelerator: str) -> bool:
    """Apply the settings on a CPU run under glibc unless the user chose their own; returns
    whether they were applied."""
    if accelerator != "cpu" or any(os.environ.get(k) for k in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug(f"glibc malloc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
              f"{'' if ok else ' (refused)'}")
    return ok
