"""The emulated inter-region link: bandwidth (optionally over time), RTT, jitter.

A ``Link`` has two directions (A->B and B->A), each a FIFO serializer shared
by every connection that crosses the link in that direction: a chunk of
``n`` bytes occupies the wire for ``n * 8 / rate`` seconds starting when the
wire is free, and is delivered one-way delay (RTT/2 plus jitter) after its
last bit left. The rate follows a ``BandwidthTrace`` (piecewise constant,
optionally looping); a rate of 0 models an outage.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import math
import random
import re
import threading
import time

_UNITS = {"": 1.0, "bit": 1.0, "bps": 1.0, "k": 1e3, "kbit": 1e3, "kbps": 1e3, "m": 1e6,
          "mbit": 1e6, "mbps": 1e6, "g": 1e9, "gbit": 1e9, "gbps": 1e9}


def parse_rate(text: str | float) -> float:
  """'100mbit', '1.5gbps', '250k', 2e6 -> bits per second."""
  if isinstance(text, (int, float)):
    return float(text)
  m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
  if not m or m.group(2).lower() not in _UNITS:
    raise ValueError(f"bad rate {text!r}; use e.g. 100mbit, 1gbit, 500kbit")
  value = float(m.group(1)) * _UNITS[m.group(2).lower()]
  if value < 0 or not math.isfinite(value):
    raise ValueError(f"rate must be finite and >= 0, got {text!r}")
  return value


@dataclasses.dataclass(frozen=True)
class BandwidthTrace:
  """Piecewise-constant bandwidth: ``points[i] = (t_i seconds, bits/s)``, t_0 = 0.

  With ``loop`` the trace repeats every ``period`` seconds: ``period_s`` if
  given, else the last point's time plus the length of the first segment.
  """

  points: tuple[tuple[float, float], ...]
  loop: bool = True
  period_s: float | None = None

  def __post_init__(self):
    if not self.points or self.points[0][0] != 0:
      raise ValueError("a bandwidth trace starts at t=0")
    times = [t for t, _ in self.points]
    if times != sorted(times) or len(set(times)) != len(times):
      raise ValueError("trace times must increase")
    if any(r < 0 for _, r in self.points):
      raise ValueError("trace rates must be >= 0")
    if self.loop and self.period <= self.points[-1][0]:
      raise ValueError("period_s must exceed the last trace time")

  @property
  def period(self) -> float:
    if self.period_s is not None:
      return self.period_s
    if len(self.points) == 1:
      return 1.0
    return self.points[-1][0] + (self.points[1][0] - self.points[0][0])

  @classmethod
  def constant(cls, bps: float) -> "BandwidthTrace":
    return cls(((0.0, float(bps)),), loop=False)

  @classmethod
  def parse(cls, text: str, loop: bool = True) -> "BandwidthTrace":
    """'0:100mbit,5:20mbit,8:100mbit[,period=12]' or a JSON file path
    (``{"points": [[0, 1e8], [5, 2e7]], "loop": true, "period_s": 12}``)."""
    text = text.strip()
    if text.endswith(".json"):
      with open(text) as f:
        d = json.load(f)
      return cls(tuple((float(t), parse_rate(r)) for t, r in d["points"]),
                 loop=bool(d.get("loop", True)), period_s=d.get("period_s"))
    points, period = [], None
    for part in text.split(","):
      key, _, value = part.partition(":") if "=" not in part else part.partition("=")
      if key.strip() == "period":
        period = float(value)
        continue
      points.append((float(key), parse_rate(value)))
    return cls(tuple(points), loop=loop, period_s=period)

  def segments(self, t: float):
    """Yields (start, end, rate) from the segment holding ``t`` onwards."""
    base = 0.0
    if self.loop:
      base = math.floor(t / self.period) * self.period
    times = [p[0] for p in self.points]
    i = max(0, bisect.bisect_right(times, t - base) - 1)
    while True:
      start = base + self.points[i][0]
      if i + 1 < len(self.points):
        end = base + self.points[i + 1][0]
      elif self.loop:
        end = base + self.period
      else:
        end = math.inf
      yield start, end, self.points[i][1]
      if end == math.inf:
        return
      i += 1
      if i == len(self.points):
        i, base = 0, base + self.period

  def rate_at(self, t: float) -> float:
    return next(self.segments(t))[2]

  def finish_time(self, start: float, bits: float) -> float:
    """When ``bits`` sent from ``start`` at the trace's rate have left the wire."""
    if bits <= 0:
      return start
    t = start
    for seg_start, seg_end, rate in self.segments(start):
      t = max(t, seg_start)
      if rate > 0:
        need = bits / rate
        if t + need <= seg_end:
          return t + need
        bits -= (seg_end - t) * rate
      t = seg_end
      if t == math.inf:
        break
    return math.inf


@dataclasses.dataclass(frozen=True)
class LinkSpec:
  """An emulated link. ``bandwidth_bps`` 0 or inf: unlimited (no serialization).

  ``shape_bandwidth=False`` keeps the bandwidth for accounting (utilization)
  but does not serialize: used when the kernel (tbf in a network namespace)
  does the shaping and the relay only adds delay.
  """

  bandwidth_bps: float = 100e6
  rtt_s: float = 0.02
  jitter_s: float = 0.0
  trace: BandwidthTrace | None = None
  seed: int = 0
  shape_bandwidth: bool = True

  def __post_init__(self):
    if self.rtt_s < 0 or self.jitter_s < 0:
      raise ValueError("rtt and jitter must be >= 0")
    if self.bandwidth_bps < 0:
      raise ValueError("bandwidth must be >= 0")

  @property
  def effective_trace(self) -> BandwidthTrace | None:
    if self.trace is not None:
      return self.trace
    if self.bandwidth_bps <= 0 or math.isinf(self.bandwidth_bps):
      return None
    return BandwidthTrace.constant(self.bandwidth_bps)

  def to_dict(self) -> dict:
    return {"bandwidth_bps": self.bandwidth_bps, "rtt_s": self.rtt_s,
            "jitter_s": self.jitter_s, "seed": self.seed,
            "shape_bandwidth": self.shape_bandwidth,
            "trace": None if self.trace is None else {
                "points": [list(p) for p in self.trace.points], "loop": self.trace.loop,
                "period_s": self.trace.period}}


class Direction:
  """One direction of the link: a FIFO wire shared by all its connections."""

  def __init__(self, name: str, spec: LinkSpec, epoch: float, rng: random.Random,
               bucket_s: float = 0.1):
    self.name = name
    self.spec = spec
    self.trace = spec.effective_trace
    self.epoch = epoch
    self.rng = rng
    self.bucket_s = bucket_s
    self._lock = threading.Lock()
    self._free_at = 0.0  # relative to epoch
    self.bytes = 0
    self.chunks = 0
    self.busy_s = 0.0
    self.first_s: float | None = None
    self.last_s: float | None = None
    self.timeline: collections.Counter = collections.Counter()  # bucket -> bytes

  def schedule(self, nbytes: int, now: float | None = None) -> tuple[float, float]:
    """Reserves the wire for ``nbytes``; returns (departure end, delivery) as
    ``time.monotonic()`` values."""
    now = time.monotonic() if now is None else now
    rel = now - self.epoch
    with self._lock:
      start = max(rel, self._free_at)
      if self.trace is None or not self.spec.shape_bandwidth:
        end = start
      else:
        end = self.trace.finish_time(start, nbytes * 8.0)
      self._free_at = end
      self.bytes += nbytes
      self.chunks += 1
      self.busy_s += end - start
      if self.first_s is None:
        self.first_s = start
      self.last_s = end
      # Attribute the bytes to the buckets they crossed the wire in.
      if math.isfinite(end) and end > start:
        b0, b1 = int(start / self.bucket_s), int(end / self.bucket_s)
        if b0 == b1:
          self.timeline[b0] += nbytes
        else:
          span = end - start
          for b in range(b0, b1 + 1):
            lo, hi = max(start, b * self.bucket_s), min(end, (b + 1) * self.bucket_s)
            if hi > lo:
              self.timeline[b] += int(round(nbytes * (hi - lo) / span))
      else:
        self.timeline[int(start / self.bucket_s)] += nbytes
      delay = self.spec.rtt_s / 2
      if self.spec.jitter_s > 0:
        delay = max(0.0, delay + self.rng.gauss(0.0, self.spec.jitter_s))
    return self.epoch + end, self.epoch + end + delay

  def capacity_bytes(self, t0: float, t1: float) -> float:
    """Bytes the wire could carry in [t0, t1] (relative seconds)."""
    if self.trace is None or t1 <= t0:
      return math.inf
    total = 0.0
    for seg_start, seg_end, rate in self.trace.segments(t0):
      lo, hi = max(seg_start, t0), min(seg_end, t1)
      if hi > lo:
        total += (hi - lo) * rate / 8.0
      if seg_end >= t1:
        break
    return total

  def stats(self) -> dict:
    with self._lock:
      first, last = self.first_s, self.last_s
      out = {"bytes": self.bytes, "chunks": self.chunks, "busy_s": self.busy_s,
             "first_s": first, "last_s": last,
             "timeline_bucket_s": self.bucket_s,
             "timeline_bytes": {str(k): v for k, v in sorted(self.timeline.items())}}
    if first is not None and last is not None and last > first and math.isfinite(last):
      cap = self.capacity_bytes(first, last)
      out["active_span_s"] = last - first
      out["utilization"] = (self.bytes / cap) if math.isfinite(cap) and cap > 0 else None
      out["mean_rate_bps"] = 8.0 * self.bytes / (last - first)
    return out


class Link:
  """Both directions of one emulated link."""

  A_TO_B = "a_to_b"
  B_TO_A = "b_to_a"

  def __init__(self, spec: LinkSpec, epoch: float | None = None):
    self.spec = spec
    self.epoch = time.monotonic() if epoch is None else epoch
    rng = random.Random(spec.seed)
    self.directions = {name: Direction(name, spec, self.epoch, random.Random(rng.random()))
                       for name in (self.A_TO_B, self.B_TO_A)}

  def direction(self, name: str) -> Direction:
    return self.directions[name]

  def stats(self) -> dict:
    return {"spec": self.spec.to_dict(), "elapsed_s": time.monotonic() - self.epoch,
            **{name: d.stats() for name, d in self.directions.items()}}


def reverse(direction: str) -> str:
  return Link.B_TO_A if direction == Link.A_TO_B else Link.A_TO_B


def describe(spec: LinkSpec) -> str:
  bw = "unlimited" if spec.effective_trace is None else (
      f"{spec.bandwidth_bps / 1e6:g} Mbit/s" if spec.trace is None else
      "trace " + ", ".join(f"{t:g}s:{r / 1e6:g}Mbit" for t, r in spec.trace.points))
  return f"{bw}, RTT {spec.rtt_s * 1e3:g} ms, jitter {spec.jitter_s * 1e3:g} ms"
