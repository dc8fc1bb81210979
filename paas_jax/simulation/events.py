"""A minimal deterministic discrete-event loop (heapq)."""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable


class EventLoop:
  """Runs callbacks in (time, insertion order): equal-time events keep FIFO order, so a run
  is a pure function of its inputs and seed."""

  def __init__(self):
    self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
    self._seq = 0
    self.now = 0.0
    self.events_processed = 0

  def schedule(self, time: float, fn: Callable[..., None], *args: Any) -> None:
    if not math.isfinite(time):
      raise ValueError(f"cannot schedule an event at t={time}")
    if time < self.now - 1e-9:
      raise ValueError(f"cannot schedule in the past: t={time} < now={self.now}")
    heapq.heappush(self._heap, (max(time, self.now), self._seq, fn, args))
    self._seq += 1

  def run(self, until: float = math.inf, max_events: int | None = None) -> None:
    while self._heap and self._heap[0][0] <= until:
      time, _, fn, args = heapq.heappop(self._heap)
      self.now = time
      fn(*args)
      self.events_processed += 1
      if max_events is not None and self.events_processed >= max_events:
        raise RuntimeError(f"event budget of {max_events} exhausted at t={self.now:.3f}s")

  @property
  def pending(self) -> int:
    return len(self._heap)
