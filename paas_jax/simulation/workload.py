"""Synthetic workloads: arrival processes, lengths, shared-prefix hotspots.

Everything draws from one explicit ``np.random.Generator`` so a workload is a pure function
of its spec and seed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from paas_jax.scheduling.distributions import TruncatedLogNormal


@dataclasses.dataclass(frozen=True)
class PoissonArrivals:
  """Exponential inter-arrival times at ``rate`` req/s."""

  rate: float

  def __post_init__(self):
    if not self.rate > 0:
      raise ValueError(f"rate must be > 0, got {self.rate}")

  @property
  def mean_rate(self) -> float:
    return self.rate

  def times(self, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    return _renewal(lambda k: rng.exponential(1.0 / self.rate, k), self.rate, duration_s)


@dataclasses.dataclass(frozen=True)
class GammaArrivals:
  """Gamma inter-arrival times: mean 1/rate, coefficient of variation ``cv`` (cv > 1: bursty)."""

  rate: float
  cv: float

  def __post_init__(self):
    if not (self.rate > 0 and self.cv > 0):
      raise ValueError(f"rate and cv must be > 0, got {self.rate}, {self.cv}")

  @property
  def mean_rate(self) -> float:
    return self.rate

  def times(self, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    shape = 1.0 / self.cv**2
    scale = 1.0 / (self.rate * shape)
    return _renewal(lambda k: rng.gamma(shape, scale, k), self.rate, duration_s)


@dataclasses.dataclass(frozen=True)
class OnOffArrivals:
  """Poisson at ``rate_on`` for ``on_s`` seconds, then ``rate_off`` for ``off_s``, repeating."""

  rate_on: float
  rate_off: float
  on_s: float
  off_s: float

  def __post_init__(self):
    if self.rate_on <= 0 or self.rate_off < 0 or self.on_s <= 0 or self.off_s <= 0:
      raise ValueError("need rate_on > 0, rate_off >= 0, on_s > 0, off_s > 0")

  @property
  def mean_rate(self) -> float:
    return (self.rate_on * self.on_s + self.rate_off * self.off_s) / (self.on_s + self.off_s)

  def times(self, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    out, t0, on = [], 0.0, True
    while t0 < duration_s:
      span = min(self.on_s if on else self.off_s, duration_s - t0)
      rate = self.rate_on if on else self.rate_off
      if rate > 0:
        # Poisson on a window: count, then uniform order statistics.
        k = rng.poisson(rate * span)
        out.append(t0 + np.sort(rng.uniform(0.0, span, k)))
      t0 += span
      on = not on
    return np.concatenate(out) if out else np.zeros(0)


def _renewal(draw, rate: float, duration_s: float) -> np.ndarray:
  if duration_s <= 0:
    raise ValueError(f"duration_s must be > 0, got {duration_s}")
  chunks, total, last = [], 0, 0.0
  while last < duration_s:
    k = int(rate * duration_s * 1.2) + 16
    t = last + np.cumsum(draw(k))
    chunks.append(t)
    total += k
    last = float(t[-1])
  times = np.concatenate(chunks)
  return times[times < duration_s]


ArrivalProcess = PoissonArrivals | GammaArrivals | OnOffArrivals


@dataclasses.dataclass(frozen=True)
class PrefixHotspots:
  """Shared prefixes (system prompts, documents) chosen by a Zipf law.

  A request uses a shared prefix with probability ``share_prob``; prefix k (0-based) is
  chosen with probability proportional to (k+1)^-zipf_s; prefix k has a fixed length drawn
  once, uniformly in [min_tokens, max_tokens]. The shared part is capped at 90% of the
  request so every request still has unique tokens (its question).
  """

  num_prefixes: int = 32
  zipf_s: float = 1.2
  share_prob: float = 0.7
  min_tokens: int = 4096
  max_tokens: int = 32768

  def __post_init__(self):
    if self.num_prefixes < 1 or self.zipf_s < 0 or not 0 <= self.share_prob <= 1:
      raise ValueError("need num_prefixes >= 1, zipf_s >= 0, share_prob in [0, 1]")
    if not 1 <= self.min_tokens <= self.max_tokens:
      raise ValueError("need 1 <= min_tokens <= max_tokens")


@dataclasses.dataclass(frozen=True)
class SimRequest:
  """One request. Times in s, lengths in tokens."""

  request_id: int
  arrival_s: float
  input_tokens: int
  output_tokens: int
  prefix_id: int = -1
  shared_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
  """Arrivals over [0, duration_s), lengths, output length, optional prefix hotspots.

  ``lengths_after``/``shift_at_s``: requests arriving at or after ``shift_at_s`` draw their
  input length from ``lengths_after`` instead (a mid-run shift of the length distribution).
  """

  arrivals: ArrivalProcess
  lengths: TruncatedLogNormal
  output_tokens: int
  duration_s: float
  hotspots: PrefixHotspots | None = None
  lengths_after: TruncatedLogNormal | None = None
  shift_at_s: float = math.inf

  def __post_init__(self):
    if self.lengths_after is not None and not 0 <= self.shift_at_s < math.inf:
      raise ValueError("lengths_after needs a finite shift_at_s >= 0")
    if self.output_tokens < 2:
      raise ValueError("output_tokens must be >= 2 (TPOT needs a second token)")
    if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
      raise ValueError("duration_s must be finite and > 0")


def generate_requests(spec: WorkloadSpec, rng: np.random.Generator) -> tuple[SimRequest, ...]:
  """Draws the whole request trace up front (so every system sees the identical trace)."""
  times = spec.arrivals.times(spec.duration_s, rng)
  raw = spec.lengths.sample(rng, times.size)
  if spec.lengths_after is not None:
    # Drawn only in this mode, so traces without a shift keep their random stream.
    raw = np.where(times >= spec.shift_at_s, spec.lengths_after.sample(rng, times.size), raw)
  lengths = np.maximum(1, np.round(raw)).astype(np.int64)
  prefix_ids = np.full(times.size, -1, dtype=np.int64)
  shared = np.zeros(times.size, dtype=np.int64)
  hs = spec.hotspots
  if hs is not None and times.size:
    prefix_len = rng.integers(hs.min_tokens, hs.max_tokens + 1, hs.num_prefixes)
    weights = 1.0 / np.arange(1, hs.num_prefixes + 1) ** hs.zipf_s
    uses = rng.random(times.size) < hs.share_prob
    chosen = rng.choice(hs.num_prefixes, size=times.size, p=weights / weights.sum())
    prefix_ids = np.where(uses, chosen, -1)
    shared = np.where(uses, np.minimum(prefix_len[chosen], (0.9 * lengths).astype(np.int64)), 0)
    prefix_ids = np.where(shared > 0, prefix_ids, -1)
  return tuple(
      SimRequest(request_id=i, arrival_s=float(times[i]), input_tokens=int(lengths[i]),
                 output_tokens=spec.output_tokens, prefix_id=int(prefix_ids[i]),
                 shared_tokens=int(shared[i]))
      for i in range(times.size))
