"""A FIFO bounded by bytes: the sender's application-level flow control.

HTTP/2 flow control stops gRPC from outrunning the receiver; this queue stops
the encoder from outrunning gRPC, so a fast prefill cannot pile encoded
layers up in host memory faster than the link drains them.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class QueueAborted(Exception):
  """The transfer was aborted while a producer or consumer was waiting."""


class ByteBoundedQueue:
  """Blocking FIFO holding at most ``max_bytes`` of payload.

  One item larger than the bound is still admitted into an empty queue, so a
  big chunk never deadlocks the producer.
  """

  def __init__(self, max_bytes: int):
    self.max_bytes = int(max_bytes)
    self._cv = threading.Condition()
    self._items: collections.deque = collections.deque()
    self._bytes = 0
    self._closed = False
    self._aborted = False
    self.peak_bytes = 0

  def put(self, item: Any, nbytes: int) -> None:
    with self._cv:
      while (not self._aborted and self._items
             and self._bytes + nbytes > self.max_bytes):
        self._cv.wait()
      if self._aborted:
        raise QueueAborted()
      if self._closed:
        raise RuntimeError("put() on a closed queue")
      self._items.append((item, nbytes))
      self._bytes += nbytes
      self.peak_bytes = max(self.peak_bytes, self._bytes)
      self._cv.notify_all()

  def get(self) -> Any | None:
    """Next item; None once the queue is closed and drained."""
    with self._cv:
      while not self._aborted and not self._items and not self._closed:
        self._cv.wait()
      if self._aborted:
        raise QueueAborted()
      if not self._items:
        return None
      item, nbytes = self._items.popleft()
      self._bytes -= nbytes
      self._cv.notify_all()
      return item

  def close(self) -> None:
    """No more puts; consumers drain what is left and then get None."""
    with self._cv:
      self._closed = True
      self._cv.notify_all()

  def abort(self) -> None:
    """Wakes every waiter with QueueAborted and drops the queued items."""
    with self._cv:
      self._aborted = True
      self._items.clear()
      self._bytes = 0
      self._cv.notify_all()

  @property
  def queued_bytes(self) -> int:
    with self._cv:
      return self._bytes
