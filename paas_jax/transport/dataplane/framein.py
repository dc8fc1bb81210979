"""Buffered reading of one data-plane connection on the receiving side.

Why: a state of many small objects (a tiny transfer: ~50 objects of 0.3-4 KiB
plus one descriptor per layer) used to cost four syscalls per frame (header,
id and key, payload, and a ``poll`` to see whether the input had run dry),
each a GIL release and re-acquire; on a shared 2-core machine that was the
largest part of the receiver's per-frame time. ``FrameInput`` reads whatever
the socket already holds into one read-ahead buffer (one ``recv_into`` for
many small frames) and parses headers, ids, keys and small payloads out of
it. Large payloads keep the zero-copy path: the part already buffered is
copied, the rest is ``recv_into``'d straight into the object's own buffer
(``buffers.recv_payload``), with the crc32c extended piece by piece as before.

The read-ahead is bounded (``READ_AHEAD_BYTES``) so a large payload that
follows small frames is copied through it for at most that many bytes.
"""

from __future__ import annotations

import socket
import ssl

from paas_jax.codec.store import crc32c
from paas_jax.transport.dataplane import buffers, frames

READ_AHEAD_BYTES = 64 << 10
# Payloads up to this size are parsed out of the read-ahead buffer (one copy
# into their own buffer); larger ones are read straight into theirs.
SMALL_PAYLOAD_BYTES = 32 << 10


class FrameInput:
  """The byte stream of one connection, read ahead.

  Args:
    sock: connected socket (plain or TLS, blocking).
    waitall: plain sockets take MSG_WAITALL for the direct reads.
    size: read-ahead buffer size (tests use small ones to split frames).
  """

  def __init__(self, sock: socket.socket, waitall: bool, size: int = READ_AHEAD_BYTES):
    self.sock = sock
    self.waitall = waitall
    self._tls = isinstance(sock, ssl.SSLSocket)
    self._buf = bytearray(size)
    self._view = memoryview(self._buf)
    self._start = 0
    self._end = 0
    self.recv_calls = 0  # tests: reads are shared between frames

  @property
  def buffered(self) -> int:
    return self._end - self._start

  def waiting(self, poller) -> bool:
    """Whether more of the sender's bytes are already here (buffered,
    decrypted by OpenSSL, or in the kernel)."""
    if self._end > self._start:
      return True
    if self._tls and self.sock.pending():
      return True
    return bool(poller.poll(0))

  def _fill(self, need: int) -> None:
    """At least ``need`` (<= the buffer size) bytes buffered; each read takes
    whatever the socket holds, up to the free space."""
    have = self._end - self._start
    if have >= need:
      return
    if self._start + need > len(self._buf):
      # Move the unread tail to the front so that ``need`` bytes fit.
      self._view[:have] = self._view[self._start:self._end]
      self._start, self._end = 0, have
    while self._end - self._start < need:
      got = self.sock.recv_into(self._view[self._end:])
      self.recv_calls += 1
      if not got:
        raise frames.PeerClosed(f"connection closed after {self._end - self._start} of "
                                f"{need} bytes")
      self._end += got

  def take(self, n: int) -> memoryview:
    """The next ``n`` (<= buffer size) bytes, as a view that stays valid only
    until the next call."""
    self._fill(n)
    start = self._start
    self._start += n
    out = self._view[start:self._start]
    if self._start == self._end:
      self._start = self._end = 0
    return out

  def _copy_buffered(self, dest: memoryview) -> int:
    n = min(len(dest), self._end - self._start)
    if n:
      dest[:n] = self._view[self._start:self._start + n]
      self._start += n
      if self._start == self._end:
        self._start = self._end = 0
    return n

  def read_into(self, dest: memoryview) -> None:
    """Fills ``dest`` (any size): buffered bytes first, the rest straight
    from the socket.

    Raises:
      PeerClosed: EOF first.
    """
    if len(dest) <= SMALL_PAYLOAD_BYTES:
      dest[:] = self.take(len(dest))
      return
    n = self._copy_buffered(dest)
    if n < len(dest):
      frames.recv_exact(self.sock, dest[n:], self.waitall)

  def read_payload(self, dest: memoryview) -> int:
    """``read_into`` that returns the crc32c of what arrived (computed while
    each piece is in cache, as ``buffers.recv_payload``)."""
    if len(dest) <= SMALL_PAYLOAD_BYTES:
      dest[:] = self.take(len(dest))
      return crc32c(dest)
    n = self._copy_buffered(dest)
    crc = crc32c(dest[:n]) if n else 0
    if n < len(dest):
      crc = buffers.recv_payload(self.sock, dest[n:], self.waitall, crc=crc)
    return crc

  def skip(self, n: int) -> None:
    """Reads and drops ``n`` bytes (a refused frame's payload)."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n:
      k = min(n, len(scratch))
      self.read_into(scratch[:k])
      n -= k


__all__ = ["FrameInput", "READ_AHEAD_BYTES", "SMALL_PAYLOAD_BYTES"]
