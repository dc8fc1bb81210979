"""Input-length distributions for the PrfaaS throughput model.

Every distribution here answers the handful of questions Eqs. 1-8 ask about the
request-length random variable L (tokens):

- ``prob_greater(t)``         P(L > t)                       -> p, the offload fraction
- ``mean_between(a, b)``      E[L | a < L <= b]               -> l_long / l_short
- ``expect(f, a, b)``         E[f(L) | a < L <= b]            -> mean TTFT, mean KV bytes
- ``quantile(q)``, ``sample(rng, n)``

``TruncatedLogNormal`` answers them in closed form (normal CDF); ``EmpiricalLengths``
answers them from measured samples so the ``Rebalancer`` can re-solve from live traffic.
All ``t``/``a``/``b`` arguments broadcast over numpy arrays (float64, tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Protocol

import numpy as np

_SQRT2 = math.sqrt(2.0)
# erfc-based so the lower tail (z << 0) keeps full relative precision, unlike 0.5*(1+erf).
_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def norm_cdf(z: np.ndarray | float) -> np.ndarray:
  """Standard normal CDF, elementwise, float64."""
  return 0.5 * _erfc(-np.asarray(z, dtype=np.float64) / _SQRT2)


class LengthDistribution(Protocol):
  """What the throughput model needs from a length distribution (tokens)."""

  @property
  def lo(self) -> float: ...

  @property
  def hi(self) -> float: ...

  def prob_greater(self, t: np.ndarray | float) -> np.ndarray: ...

  def mean_between(self, a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray: ...

  def expect(self, f: Callable[[np.ndarray], np.ndarray], a: float, b: float) -> float: ...

  def quantile(self, q: np.ndarray | float) -> np.ndarray: ...

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class TruncatedLogNormal:
  """ln L ~ Normal(mu, sigma) conditioned on lo <= L <= hi (tokens).

  The paper's workload is TruncatedLogNormal(9.90, 1.00, 128, 128K).
  """

  mu: float
  sigma: float
  lo: float
  hi: float

  def __post_init__(self):
    if not (math.isfinite(self.mu) and math.isfinite(self.sigma)):
      raise ValueError(f"mu and sigma must be finite, got mu={self.mu}, sigma={self.sigma}")
    if self.sigma <= 0:
      raise ValueError(f"sigma must be > 0, got {self.sigma}")
    if not (0 < self.lo < self.hi and math.isfinite(self.hi)):
      raise ValueError(f"need 0 < lo < hi < inf, got lo={self.lo}, hi={self.hi}")
    if self._mass <= 1e-12:
      raise ValueError("the truncation window [lo, hi] holds (numerically) no probability mass")

  def _z(self, x: np.ndarray) -> np.ndarray:
    x = np.clip(np.asarray(x, dtype=np.float64), self.lo, self.hi)
    return (np.log(x) - self.mu) / self.sigma

  @functools.cached_property
  def _cdf_lo(self) -> float:
    return float(norm_cdf((math.log(self.lo) - self.mu) / self.sigma))

  @functools.cached_property
  def _mass(self) -> float:
    return float(norm_cdf((math.log(self.hi) - self.mu) / self.sigma)) - self._cdf_lo

  def cdf(self, x: np.ndarray | float) -> np.ndarray:
    """P(L <= x)."""
    x = np.asarray(x, dtype=np.float64)
    out = (norm_cdf(self._z(x)) - self._cdf_lo) / self._mass
    return np.clip(np.where(x < self.lo, 0.0, np.where(x >= self.hi, 1.0, out)), 0.0, 1.0)

  def prob_greater(self, t: np.ndarray | float) -> np.ndarray:
    return 1.0 - self.cdf(t)

  def _partial_first_moment(self, x: np.ndarray) -> np.ndarray:
    """E[L; lo <= L <= x] * mass, i.e. the untruncated integral of l*pdf(l) over [lo, x].

    For a log-normal, int_0^x l pdf(l) dl = exp(mu + sigma^2/2) * Phi(z(x) - sigma).
    """
    scale = math.exp(self.mu + 0.5 * self.sigma**2)
    z_lo = (math.log(self.lo) - self.mu) / self.sigma
    return scale * (norm_cdf(self._z(x) - self.sigma) - norm_cdf(z_lo - self.sigma))

  def mean_between(self, a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    """E[L | a < L <= b], exact. NaN where the interval has zero mass."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    mass = (self.cdf(b) - self.cdf(a)) * self._mass
    moment = self._partial_first_moment(b) - self._partial_first_moment(a)
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(mass > 0, moment / np.where(mass > 0, mass, 1.0), np.nan)

  def mean(self) -> float:
    return float(self.mean_between(self.lo, self.hi))

  def quantile(self, q: np.ndarray | float) -> np.ndarray:
    """Inverse CDF by bisection in log space (60 halvings: far below 1 token)."""
    q = np.asarray(q, dtype=np.float64)
    if np.any((q < 0) | (q > 1)):
      raise ValueError("quantile levels must lie in [0, 1]")
    lo = np.full(q.shape, math.log(self.lo))
    hi = np.full(q.shape, math.log(self.hi))
    for _ in range(60):
      mid = 0.5 * (lo + hi)
      below = self.cdf(np.exp(mid)) < q
      lo = np.where(below, mid, lo)
      hi = np.where(below, hi, mid)
    return np.exp(0.5 * (lo + hi))

  def expect(self, f: Callable[[np.ndarray], np.ndarray], a: float | None = None,
             b: float | None = None, nodes: int = 256) -> float:
    """E[f(L) | a < L <= b] by Gauss-Legendre quadrature in z = (ln L - mu)/sigma.

    Working in z makes the integrand a smooth Gaussian-weighted function: 256 nodes give
    ~1e-10 relative error for polynomial f; a kink in f (piecewise-linear T_prefill)
    degrades that to ~1e-5, still far below profiling noise.
    """
    a = self.lo if a is None else max(float(a), self.lo)
    b = self.hi if b is None else min(float(b), self.hi)
    if b <= a:
      return float("nan")
    za = (math.log(a) - self.mu) / self.sigma
    zb = (math.log(b) - self.mu) / self.sigma
    x, w = np.polynomial.legendre.leggauss(nodes)
    z = 0.5 * (zb - za) * x + 0.5 * (zb + za)
    dens = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    weights = 0.5 * (zb - za) * w * dens
    vals = np.asarray(f(np.exp(self.mu + self.sigma * z)), dtype=np.float64)
    return float(np.sum(weights * vals) / np.sum(weights))

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    """n i.i.d. lengths (float64 tokens) by rejection; consumes only ``rng``."""
    if n < 0:
      raise ValueError(f"n must be >= 0, got {n}")
    out = np.empty(0)
    while out.size < n:
      # Oversize each draw by the rejection rate so one round almost always suffices.
      k = int((n - out.size) / max(self._mass, 1e-3) * 1.1) + 16
      x = np.exp(self.mu + self.sigma * rng.standard_normal(k))
      out = np.concatenate([out, x[(x >= self.lo) & (x <= self.hi)]])
    return out[:n]


@dataclasses.dataclass(frozen=True)
class EmpiricalLengths:
  """The empirical distribution of measured request lengths (tokens).

  Used by the long-timescale ``Rebalancer``: it has the same interface as
  ``TruncatedLogNormal`` so ``solve_deployment`` runs unchanged on live samples.
  """

  samples: tuple[float, ...]

  def __post_init__(self):
    arr = np.asarray(self.samples, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
      raise ValueError("EmpiricalLengths needs a non-empty 1-D sequence of lengths")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
      raise ValueError("lengths must be finite and > 0")

  @classmethod
  def from_array(cls, x) -> "EmpiricalLengths":
    return cls(tuple(float(v) for v in np.asarray(x, dtype=np.float64).ravel()))

  @functools.cached_property
  def _sorted(self) -> np.ndarray:
    return np.sort(np.asarray(self.samples, dtype=np.float64))

  @functools.cached_property
  def _cumsum(self) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(self._sorted)])

  @property
  def lo(self) -> float:
    return float(self._sorted[0])

  @property
  def hi(self) -> float:
    return float(self._sorted[-1])

  def _count_le(self, x) -> np.ndarray:
    return np.searchsorted(self._sorted, np.asarray(x, dtype=np.float64), side="right")

  def cdf(self, x) -> np.ndarray:
    return self._count_le(x) / self._sorted.size

  def prob_greater(self, t) -> np.ndarray:
    return 1.0 - self.cdf(t)

  def mean_between(self, a, b) -> np.ndarray:
    ia, ib = self._count_le(a), self._count_le(b)
    n = ib - ia
    total = self._cumsum[ib] - self._cumsum[ia]
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(n > 0, total / np.where(n > 0, n, 1), np.nan)

  def mean(self) -> float:
    return float(self._sorted.mean())

  def quantile(self, q) -> np.ndarray:
    q = np.asarray(q, dtype=np.float64)
    if np.any((q < 0) | (q > 1)):
      raise ValueError("quantile levels must lie in [0, 1]")
    return np.quantile(self._sorted, q)

  def expect(self, f, a: float | None = None, b: float | None = None) -> float:
    x = self._sorted
    if a is not None:
      x = x[x > a]
    if b is not None:
      x = x[x <= b]
    if x.size == 0:
      return float("nan")
    return float(np.mean(np.asarray(f(x), dtype=np.float64)))

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.choice(self._sorted, size=n, replace=True)
