"""Socket I/O of one data-plane connection, safe for one writer thread and one
reader thread at a time.

Plain TCP: ``sendmsg`` and ``recv_into`` straight on the socket (the kernel
serialises them; a sender may write and read one connection concurrently).
The socket is blocking and its timeout is the kernel's (``SO_SNDTIMEO`` /
``SO_RCVTIMEO``), not Python's. A Python timeout makes the socket
non-blocking and polls before every call, so a large write became many
partial ``sendmsg`` calls, each behind a ``poll`` and a pass through the
interpreter; now the kernel sleeps inside one call until all of it is
written, or the timeout ends the call with a partial count.

TLS: one OpenSSL connection must not be used by two threads at once. A
concurrent ``SSL_write`` (frames) and ``SSL_read`` (replies) on one
``ssl.SSLSocket`` corrupted replies ("malformed reply from the receiver")
and the process heap. So the socket is non-blocking, every SSL call runs
under one lock, and a thread the connection cannot serve yet (want-read /
want-write) waits in ``poll`` outside the lock: a reader waiting for replies
never holds up the writer, and neither ever blocks inside OpenSSL.

Shutdown and close, for both:
  * ``shutdown`` is the kernel's. ``SSLSocket.shutdown`` also drops the TLS
    state, and a thread still reading then took raw ciphertext for replies.
  * ``close`` must only run once no other thread can be inside a call: the
    SSL object and a blocked syscall keep the descriptor's number, and a
    closed number is reused by the next socket or file the process opens
    (stale lane threads read and wrote other connections and files).
    ``Lane`` closes its socket when the last of its two threads has ended.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time


def shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
  """Kernel shutdown of ``sock`` (TLS state kept; errors ignored). Wakes a
  thread blocked on it; safe from any thread, unlike close."""
  try:
    socket.socket.shutdown(sock, how)  # not SSLSocket.shutdown: see the module docstring
  except OSError:
    pass


def _timeval(seconds: float) -> bytes:
  """``struct timeval`` for ``SO_SNDTIMEO``/``SO_RCVTIMEO`` (0 would mean "never")."""
  micros = max(int(seconds * 1e6), 1000)
  return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)


class LaneSocket:
  """``sock`` with thread-safe ``send``/``recv_into`` as described above.

  Args:
    sock: a connected ``socket.socket`` or ``ssl.SSLSocket`` (handshake done).
    timeout_s: how long one ``send``/``recv_into`` waits before returning
      "nothing yet" (so the caller can check aborts, deadlines and stalls).
  """

  def __init__(self, sock: socket.socket, timeout_s: float):
    self.sock = sock
    self.tls = isinstance(sock, ssl.SSLSocket)
    self._timeout_s = timeout_s
    self._fd = sock.fileno()
    self._lock = threading.Lock()
    self._closed = False
    if self.tls:
      sock.setblocking(False)
    else:
      sock.settimeout(None)
      timeval = _timeval(timeout_s)
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)

  def send(self, views: list[memoryview]) -> int:
    """Writes from ``views`` (plain: all of them with one ``sendmsg``; TLS: the
    first); returns the bytes written, 0 when the socket took nothing within
    the timeout. A TLS write that returned 0 must be retried with the same
    bytes (OpenSSL resumes a record it had started).

    Raises:
      OSError: the connection failed or was closed.
    """
    if not self.tls:
      try:
        return self.sock.sendmsg(views)
      except BlockingIOError:  # SO_SNDTIMEO ended the call before any byte went
        return 0
    head = views[0]
    return self._tls_call(lambda: self.sock.send(head)) or 0

  def recv_into(self, view: memoryview) -> int | None:
    """Reads into ``view``: the byte count, 0 at EOF, None when nothing arrived
    within the timeout.

    Raises:
      OSError: the connection failed or was closed.
    """
    if not self.tls:
      try:
        return self.sock.recv_into(view)
      except BlockingIOError:  # SO_RCVTIMEO ended the call with nothing read
        return None
    return self._tls_call(lambda: self.sock.recv_into(view))

  def shutdown(self, how: int = socket.SHUT_RDWR) -> None:
    shutdown(self.sock, how)

  def close(self) -> None:
    """Closes the socket; call once no other thread uses this object any more."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      try:
        self.sock.close()
      except OSError:
        pass

  def _tls_call(self, call):
    end = time.monotonic() + self._timeout_s
    while True:
      with self._lock:
        if self._closed:
          raise OSError("data-plane connection closed")
        try:
          return call()
        except ssl.SSLWantReadError:
          events = select.POLLIN
        except ssl.SSLWantWriteError:
          events = select.POLLOUT
      left = end - time.monotonic()
      if left <= 0:
        return None
      poller = select.poll()
      poller.register(self._fd, events)
      poller.poll(max(1, int(left * 1000)))
