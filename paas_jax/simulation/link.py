"""A one-directional inter-datacenter link with a bandwidth-over-time trace.

Active transfers share the current capacity equally (processor sharing, the fluid limit of
fair TCP flows): with n transfers on a link of B bits/s each progresses at B/(8n) bytes/s.
The link is work-conserving, so it is "busy" exactly while some transfer is active; the
utilization the router sees is the busy fraction of a trailing window.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from typing import Callable

import numpy as np

from paas_jax.simulation.events import EventLoop

# A transfer counts as finished when fewer bytes than this remain (float round-off).
_DONE_BYTES = 1e-3
_DONE_SECONDS = 1e-9


@dataclasses.dataclass(frozen=True)
class BandwidthTrace:
  """Piecewise-constant capacity: ``bps[i]`` holds on [times[i], times[i+1]) (s, bits/s)."""

  times: tuple[float, ...]
  bps: tuple[float, ...]

  def __post_init__(self):
    if not self.times or len(self.times) != len(self.bps):
      raise ValueError("times and bps must be non-empty and of equal length")
    if self.times[0] != 0.0 or any(b <= a for a, b in zip(self.times, self.times[1:])):
      raise ValueError(f"times must start at 0 and strictly increase: {self.times}")
    if any(not (math.isfinite(b) and b >= 0) for b in self.bps):
      raise ValueError(f"bandwidths must be finite and >= 0: {self.bps}")

  @classmethod
  def constant(cls, bps: float) -> "BandwidthTrace":
    return cls((0.0,), (float(bps),))

  @classmethod
  def with_drop(cls, bps: float, start_s: float, duration_s: float, factor: float) -> "BandwidthTrace":
    """``bps`` except ``factor*bps`` during [start_s, start_s + duration_s)."""
    if start_s <= 0 or duration_s <= 0 or not 0 <= factor:
      raise ValueError("need start_s > 0, duration_s > 0, factor >= 0")
    return cls((0.0, float(start_s), float(start_s + duration_s)), (bps, bps * factor, bps))

  def at(self, t: float) -> float:
    return self.bps[bisect.bisect_right(self.times, t) - 1]

  def next_change(self, t: float) -> float:
    i = bisect.bisect_right(self.times, t)
    return self.times[i] if i < len(self.times) else math.inf

  def capacity_bits(self, t0: float, t1: float) -> float:
    """Integral of bps over [t0, t1]."""
    total, t = 0.0, t0
    while t < t1:
      nxt = min(self.next_change(t), t1)
      total += self.at(t) * (nxt - t)
      t = nxt
    return total


@dataclasses.dataclass
class _Transfer:
  tid: int
  size_bytes: float
  remaining: float
  start_s: float
  on_done: Callable[[float], None]


class Link:
  """Fair-shared link. ``start`` returns immediately; ``on_done(now)`` fires at completion."""

  def __init__(self, loop: EventLoop, trace: BandwidthTrace, name: str = "link",
               bin_seconds: float = 1.0):
    if bin_seconds <= 0:
      raise ValueError("bin_seconds must be > 0")
    self.loop, self.trace, self.name, self.bin_seconds = loop, trace, name, bin_seconds
    self._active: dict[int, _Transfer] = {}
    self._next_tid = 0
    self._last = 0.0
    self._version = 0
    self._busy_since: float | None = None
    self._busy_periods: collections.deque[tuple[float, float]] = collections.deque()
    self._bins: dict[int, float] = collections.defaultdict(float)
    self.bytes_requested = 0.0
    self.bytes_delivered = 0.0
    self.transfers_completed = 0

  # --- public state -----------------------------------------------------------
  @property
  def active_transfers(self) -> int:
    return len(self._active)

  def backlog_bytes(self, now: float) -> float:
    self._advance(now)
    return sum(t.remaining for t in self._active.values())

  def capacity_bps(self, now: float) -> float:
    return self.trace.at(now)

  def utilization(self, now: float, window_s: float) -> float:
    """Fraction of [now - window_s, now] during which the link had work."""
    if window_s <= 0:
      raise ValueError("window_s must be > 0")
    lo = now - window_s
    while self._busy_periods and self._busy_periods[0][1] <= lo:
      self._busy_periods.popleft()
    busy = sum(min(e, now) - max(s, lo) for s, e in self._busy_periods if e > lo)
    if self._busy_since is not None:
      busy += now - max(self._busy_since, lo)
    return min(max(busy / window_s, 0.0), 1.0)

  def delivered_series(self) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times s, bytes delivered in each bin), contiguous from 0."""
    if not self._bins:
      return np.zeros(0), np.zeros(0)
    n = max(self._bins) + 1
    vals = np.zeros(n)
    for k, v in self._bins.items():
      vals[k] = v
    return np.arange(n) * self.bin_seconds, vals

  # --- operations -----------------------------------------------------------------
  def start(self, nbytes: float, on_done: Callable[[float], None]) -> int:
    if not (math.isfinite(nbytes) and nbytes >= 0):
      raise ValueError(f"transfer size must be finite and >= 0, got {nbytes}")
    now = self.loop.now
    self._advance(now)
    tid = self._next_tid
    self._next_tid += 1
    self.bytes_requested += nbytes
    if nbytes <= _DONE_BYTES:
      self.bytes_delivered += nbytes
      self._account(now, now, nbytes)
      self.transfers_completed += 1
      self.loop.schedule(now, on_done, now)
      return tid
    if not self._active:
      self._busy_since = now
    self._active[tid] = _Transfer(tid, nbytes, nbytes, now, on_done)
    self._reschedule(now)
    return tid

  # --- internals --------------------------------------------------------------
  def _account(self, t0: float, t1: float, nbytes: float) -> None:
    """Spreads ``nbytes`` delivered uniformly over [t0, t1] into the time bins."""
    if t1 <= t0:
      self._bins[int(t0 // self.bin_seconds)] += nbytes
      return
    rate = nbytes / (t1 - t0)
    t = t0
    while t < t1:
      k = int(t // self.bin_seconds)
      nxt = min((k + 1) * self.bin_seconds, t1)
      self._bins[k] += rate * (nxt - t)
      t = nxt

  def _advance(self, now: float) -> None:
    """Progresses every active transfer from ``self._last`` to ``now``."""
    t = self._last
    while t < now and self._active:
      seg_end = min(self.trace.next_change(t), now)
      rate = self.trace.at(t) / 8.0  # bytes/s for the whole link
      n = len(self._active)
      # Never deliver more than the smallest remaining transfer can absorb: completions
      # are scheduled events, so this only trims float round-off.
      share = min(rate * (seg_end - t) / n, min(x.remaining for x in self._active.values()))
      if share > 0:
        for x in self._active.values():
          x.remaining -= share
        self.bytes_delivered += share * n
        self._account(t, seg_end, share * n)
      t = seg_end
    self._last = max(self._last, now)

  def _reschedule(self, now: float) -> None:
    self._version += 1
    if not self._active:
      return
    rate = self.trace.at(now) / 8.0
    n = len(self._active)
    nxt = self.trace.next_change(now)
    if rate > 0:
      nxt = min(nxt, now + min(x.remaining for x in self._active.values()) * n / rate)
    if math.isfinite(nxt):
      self.loop.schedule(nxt, self._on_event, self._version)
    # else: link down forever with work pending; transfers never finish (reported as stuck).

  def _on_event(self, version: int) -> None:
    if version != self._version:
      return  # superseded by a later start/finish
    now = self.loop.now
    self._advance(now)
    # Also finish transfers whose remaining time is below the clock's resolution, or the
    # next event would land on the same float timestamp forever.
    per_transfer = self.trace.at(now) / 8.0 / len(self._active) if self._active else 0.0
    tol = max(_DONE_BYTES, per_transfer * _DONE_SECONDS)
    done = [x for x in self._active.values() if x.remaining <= tol]
    for x in done:
      del self._active[x.tid]
      # Credit the round-off residue so delivered bytes equal requested bytes exactly.
      self.bytes_delivered += x.remaining
      self._account(now, now, x.remaining)
      self.transfers_completed += 1
    if not self._active and self._busy_since is not None:
      self._busy_periods.append((self._busy_since, now))
      self._busy_since = None
    self._reschedule(now)
    for x in done:
      x.on_done(now)
