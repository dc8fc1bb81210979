"""Receive buffers of the TCP data plane, and reading a payload into one.

Where the receiver's CPU went before this module (perf, 100 MB in ~0.8 MB
objects, one connection): for every object a fresh ``bytearray`` was zeroed
by ``memset`` and then page-faulted in by the kernel's copy (together more
than the copy itself), and crc32c then read the whole object back from
memory. Now:

* objects of ``LARGE_PAYLOAD_BYTES`` or more land in uninitialised
  ``np.empty`` memory (``recv_into`` overwrites every byte; no memset), and
  ``retain_freed_memory`` asks glibc to keep freed buffers for reuse
  instead of unmapping them, so a steady stream of transfers stops
  page-faulting once the first ones have been released;
* ``recv_payload`` reads in ``CRC_PIECE_BYTES`` pieces and extends the
  crc32c over each piece while it is still in cache (~3x faster than a
  second pass over memory).

Small objects (zarr metadata, descriptors, control messages) stay
``bytearray``: their consumers parse them as text.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import socket
import threading

import numpy as np

from paas_jax.codec.store import crc32c_extend
from paas_jax.transport.dataplane.frames import PeerClosed

log = logging.getLogger(__name__)

LARGE_PAYLOAD_BYTES = 64 << 10
# Small enough to stay in a core's L2 for the crc pass; 1 MiB rather than
# 256 KiB: a ~1 MiB chunk is read by one syscall and one wakeup (measured on
# loopback, 100 MB: ~10% less receiver CPU).
CRC_PIECE_BYTES = 1 << 20

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# Objects below this come from malloc's arenas and go back to them when freed;
# glibc's ceiling for the mmap threshold is 32 MiB on 64-bit.
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30
# A thread other than the main one allocates from its own arena, made of
# heaps of up to 64 MiB; glibc unmaps a heap that has become entirely free
# unless its free space is within M_TOP_PAD (glibc 2.36 heap_trim; the trim
# threshold does not guard that path). Measured with bench_transfer --planes
# (100 MB states): with only the two settings above the receivers still
# faulted in ~86k pages per GB (raw TCP into kept buffers, and the TLS data
# plane); with this one, ~10 and ~560.
_TOP_PAD = 64 << 20

_retained_lock = threading.Lock()
_retained: bool | None = None


def payload_buffer(nbytes: int):
  """A buffer of ``nbytes`` for one frame's payload: ``bytearray`` below
  ``LARGE_PAYLOAD_BYTES``, else a uint8 memoryview of uninitialised memory."""
  if nbytes < LARGE_PAYLOAD_BYTES:
    return bytearray(nbytes)
  return memoryview(np.empty(nbytes, np.uint8))


def recv_payload(sock: socket.socket, view: memoryview, waitall: bool, crc: int = 0) -> int:
  """Fills ``view`` from ``sock`` and returns the crc32c of what arrived,
  computed piece by piece while each piece is in cache. ``crc``: that of
  bytes before ``view`` to extend (a payload whose head was read ahead).

  ``waitall``: plain sockets take MSG_WAITALL (one syscall per piece); TLS
  sockets do not support flags and loop.

  Raises:
    PeerClosed: EOF first.
  """
  n, total = 0, len(view)
  flags = socket.MSG_WAITALL if waitall else 0
  while n < total:
    end = min(total, n + CRC_PIECE_BYTES)
    start = n
    while n < end:
      piece = view[n:end]
      got = sock.recv_into(piece, len(piece), flags) if flags else sock.recv_into(piece)
      if got == 0:
        raise PeerClosed(f"connection closed after {n} of {total} bytes")
      n += got
    crc = crc32c_extend(crc, view[start:end])
  return crc


def retain_freed_memory() -> bool:
  """Asks glibc (once per process) to serve allocations below 32 MiB from its
  arenas and to keep freed memory there, so that receive buffers are reused
  instead of being unmapped and faulted in again for the next transfer.
  Process-wide, like the MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ /
  MALLOC_TOP_PAD_ environment variables it stands for; the process's resident size then
  stays at its high-water mark. Returns whether it took effect (False off
  glibc)."""
  global _retained
  with _retained_lock:
    if _retained is None:
      _retained = _mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and _mallopt(
          _M_TRIM_THRESHOLD, _TRIM_THRESHOLD) and _mallopt(_M_TOP_PAD, _TOP_PAD)
    return _retained


def _mallopt(param: int, value: int) -> bool:
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):
    log.info("mallopt not available (libc %s): receive buffers are not retained", name)
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  return bool(mallopt(param, value))
