"""Hardware-class profiles: prefill latency T_prefill(l), state size S_kv(l), decode step.

Units: lengths in tokens, times in seconds, sizes in bytes, bandwidth in bits/s
(1 Gbps = 1e9 bits/s; 1 MiB = 2**20 bytes).

Interpolation (the brief asks us to say which):
- ``S_kv(l) = c + k*l`` by ordinary least squares over the profiled points. For a hybrid
  model the recurrent (KDA) state is a fixed-size term ``c`` and the full-attention (MLA)
  KV cache grows linearly with ``k`` bytes/token, so affine is the exact functional form.
- ``T_prefill(l)``: ``"quadratic"`` (default) is the least-squares fit
  ``a + b*l + c*l**2``: linear layers, MoE and linear attention cost O(l), full attention
  costs O(l^2), plus a fixed launch/communication overhead ``a``. With 4 points and 3
  coefficients it smooths profiling noise instead of chasing it.
  ``"monotone_quadratic"`` is the same form fitted with ``a, b, c >= 0`` (non-negative
  least squares): it never falls with length nor goes below 0 anywhere in l >= 0, which
  an unconstrained fit to a few noisy measured points can (calibration.py fits
  measured requests this way). ``"piecewise_linear"`` goes exactly through the points
  and extends the end segments linearly outside them. Every form is clamped at 0:
  a prefill takes no negative time.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from scipy import optimize

MIB = 2**20  # bytes
GBPS = 1e9  # bits/s

INTERPOLATIONS = ("quadratic", "monotone_quadratic", "piecewise_linear")
_QUADRATIC = ("quadratic", "monotone_quadratic")


@dataclasses.dataclass(frozen=True)
class PrefillProfile:
  """Profile of one prefill instance of a hardware class (e.g. 8xH200).

  Attributes:
    name: human label, e.g. "8xH200".
    lengths: profiled input lengths (tokens), strictly increasing, >= 2 points.
    prefill_seconds: T_prefill at each length (s) for a cold (uncached) request.
    kv_bytes: S_kv at each length (bytes): everything shipped to decode (KV + recurrent).
    gpus_per_instance: GPUs in one instance (bookkeeping only).
    interpolation: "quadratic", "monotone_quadratic" or "piecewise_linear" for T_prefill.
  """

  name: str
  lengths: tuple[float, ...]
  prefill_seconds: tuple[float, ...]
  kv_bytes: tuple[float, ...]
  gpus_per_instance: int = 8
  interpolation: str = "quadratic"

  def __post_init__(self):
    n = len(self.lengths)
    if n < 2 or len(self.prefill_seconds) != n or len(self.kv_bytes) != n:
      raise ValueError(
          f"{self.name}: need >= 2 profiled points with matching lengths/prefill_seconds/kv_bytes,"
          f" got {len(self.lengths)}/{len(self.prefill_seconds)}/{len(self.kv_bytes)}")
    ls = np.asarray(self.lengths, dtype=np.float64)
    if np.any(ls <= 0) or np.any(np.diff(ls) <= 0):
      raise ValueError(f"{self.name}: lengths must be positive and strictly increasing: {self.lengths}")
    if any(not (math.isfinite(t) and t > 0) for t in self.prefill_seconds):
      raise ValueError(f"{self.name}: prefill_seconds must be finite and > 0: {self.prefill_seconds}")
    if any(not (math.isfinite(s) and s > 0) for s in self.kv_bytes):
      raise ValueError(f"{self.name}: kv_bytes must be finite and > 0: {self.kv_bytes}")
    if self.interpolation not in INTERPOLATIONS:
      raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")
    if self.interpolation in _QUADRATIC and n < 3:
      raise ValueError(f"{self.name}: a quadratic T_prefill fit needs >= 3 profiled points")
    if self.gpus_per_instance < 1:
      raise ValueError("gpus_per_instance must be >= 1")
    if self.kv_slope_bytes_per_token < 0 or self.kv_fixed_bytes < 0:
      raise ValueError(f"{self.name}: fitted S_kv = c + k*l has c < 0 or k < 0; the profile is inconsistent")

  @classmethod
  def from_mib(cls, name: str, lengths, prefill_seconds, kv_mib, **kwargs) -> "PrefillProfile":
    """Builds a profile from S_kv given in MiB (2**20 bytes), as the paper reports it."""
    return cls(name=name, lengths=tuple(float(x) for x in lengths),
               prefill_seconds=tuple(float(x) for x in prefill_seconds),
               kv_bytes=tuple(float(x) * MIB for x in kv_mib), **kwargs)

  # --- S_kv -----------------------------------------------------------------
  @functools.cached_property
  def _kv_fit(self) -> tuple[float, float]:
    k, c = np.polyfit(np.asarray(self.lengths), np.asarray(self.kv_bytes), 1)
    # Exactly proportional data fits c = -1e-8 or so: that is round-off, not a size.
    if -1e-9 * max(self.kv_bytes) <= c < 0:
      c = 0.0
    return float(c), float(k)

  @property
  def kv_fixed_bytes(self) -> float:
    """c in S_kv = c + k*l: the length-independent part (recurrent state), bytes."""
    return self._kv_fit[0]

  @property
  def kv_slope_bytes_per_token(self) -> float:
    """k in S_kv = c + k*l: full-attention KV bytes per token."""
    return self._kv_fit[1]

  def s_kv(self, l) -> np.ndarray:
    """S_kv(l) in bytes, elementwise over l (tokens)."""
    return self.kv_fixed_bytes + self.kv_slope_bytes_per_token * np.asarray(l, dtype=np.float64)

  # --- T_prefill ------------------------------------------------------------
  @functools.cached_property
  def _quad(self) -> np.ndarray:
    # Fit in units of 1K tokens so the normal equations are well conditioned.
    x, t = np.asarray(self.lengths) / 1e3, np.asarray(self.prefill_seconds)
    if self.interpolation == "monotone_quadratic":
      (a, b, c), _ = optimize.nnls(np.stack([np.ones_like(x), x, x * x], axis=1), t)
      return np.array([c, b, a])
    return np.polyfit(x, t, 2)

  def t_prefill(self, l) -> np.ndarray:
    """T_prefill(l) in seconds for a cold request of l tokens, elementwise."""
    l = np.asarray(l, dtype=np.float64)
    if self.interpolation in _QUADRATIC:
      return np.maximum(np.polyval(self._quad, l / 1e3), 0.0)
    xs = np.asarray(self.lengths)
    ys = np.asarray(self.prefill_seconds)
    inner = np.interp(l, xs, ys)
    left = ys[0] + (l - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
    right = ys[-1] + (l - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return np.maximum(np.where(l < xs[0], left, np.where(l > xs[-1], right, inner)), 0.0)

  @property
  def fixed_overhead_seconds(self) -> float:
    """T_prefill extrapolated to l = 0: the per-request cost that prefix caching cannot save."""
    return max(float(self.t_prefill(0.0)), 0.0)

  def prefill_time(self, l_total, l_cached=0.0) -> np.ndarray:
    """Latency (s) to prefill l_total tokens when the first l_cached are already cached.

    T(l_total) - T(l_cached) is the cumulative compute of tokens l_cached..l_total (each
    new token still attends over the cached prefix); the fixed overhead is paid again.
    """
    l_total = np.asarray(l_total, dtype=np.float64)
    l_cached = np.clip(np.asarray(l_cached, dtype=np.float64), 0.0, l_total)
    delta = self.t_prefill(l_total) - self.t_prefill(l_cached)
    return self.fixed_overhead_seconds + np.maximum(delta, 0.0)

  def phi_kv_bps(self, l) -> np.ndarray:
    """Eq. 1: Phi_kv(l) = S_kv(l) / T_prefill(l), the KV egress rate of one busy instance, bits/s."""
    return 8.0 * self.s_kv(l) / self.t_prefill(l)

  def with_time_map(self, name: str, scale: float, offset_seconds: float = 0.0) -> "PrefillProfile":
    """Another hardware class whose prefill time is scale*T(l) + offset at the profiled points.

    S_kv is a property of the model, not the GPU, so it is kept. Because both fits are
    linear in the time values, the new fitted curve is exactly scale*T + offset.
    """
    times = tuple(scale * t + offset_seconds for t in self.prefill_seconds)
    if any(t <= 0 for t in times):
      raise ValueError(f"time map scale={scale}, offset={offset_seconds} makes a prefill time <= 0")
    return dataclasses.replace(self, name=name, prefill_seconds=times)

  def validate_monotone(self, lo: float, hi: float, points: int = 512) -> None:
    """Raises ValueError unless T_prefill is positive and non-decreasing on [lo, hi]."""
    x = np.linspace(lo, hi, points)
    y = self.t_prefill(x)
    if np.any(y <= 0) or np.any(np.diff(y) < -1e-12):
      raise ValueError(f"{self.name}: T_prefill is not positive and non-decreasing on [{lo}, {hi}]")


def fit_time_map(reference_seconds, target_seconds) -> tuple[float, float]:
  """Least-squares (scale, offset) with T_target ~= scale * T_ref + offset.

  Derives an unprofiled hardware class from a few latencies published or measured for it,
  paired with the reference class's latency for the same workload (a single length, or a
  mean over a length distribution: the map is affine, so it commutes with expectations).
  Two pairs solve it exactly.
  """
  x = np.asarray(reference_seconds, dtype=np.float64).ravel()
  y = np.asarray(target_seconds, dtype=np.float64).ravel()
  if x.size != y.size or x.size < 2:
    raise ValueError("fit_time_map needs >= 2 paired (reference, target) latencies")
  if np.ptp(x) <= 0:
    raise ValueError("reference latencies must not all be equal")
  scale, offset = np.polyfit(x, y, 1)
  if scale <= 0:
    raise ValueError(f"fitted time-map scale {scale:.3g} <= 0: targets contradict the reference")
  return float(scale), float(offset)


@dataclasses.dataclass(frozen=True)
class DecodeProfile:
  """One decode instance.

  Eq. 7 uses only ``max_batch_size`` and ``step_seconds`` (the step time of a full batch,
  which the TPOT SLO bounds: 40 tok/s -> 25 ms). The simulator additionally lets the step
  time depend on how much context the batch holds (memory-bound attention reads):

    step(ctx) = step_seconds * ((1 - context_fraction)
                                + context_fraction * ctx / (max_batch_size * reference_context_tokens))

  so a full batch of average-length requests takes exactly ``step_seconds``.
  """

  max_batch_size: int
  step_seconds: float
  context_fraction: float = 0.0
  reference_context_tokens: float = 1.0

  def __post_init__(self):
    if self.max_batch_size < 1:
      raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
    if not (math.isfinite(self.step_seconds) and self.step_seconds > 0):
      raise ValueError(f"step_seconds must be finite and > 0, got {self.step_seconds}")
    if not 0.0 <= self.context_fraction <= 1.0:
      raise ValueError(f"context_fraction must lie in [0, 1], got {self.context_fraction}")
    if self.reference_context_tokens <= 0:
      raise ValueError("reference_context_tokens must be > 0")

  def step_time(self, batch_context_tokens: float) -> float:
    """Seconds per decode step for a batch holding ``batch_context_tokens`` of context."""
    rel = batch_context_tokens / (self.max_batch_size * self.reference_context_tokens)
    return self.step_seconds * ((1.0 - self.context_fraction) + self.context_fraction * rel)

  def requests_per_second(self, output_tokens: float) -> float:
    """Eq. 7 per instance: BS_max / (T_decode * L_out)."""
    if output_tokens <= 0:
      raise ValueError(f"output_tokens must be > 0, got {output_tokens}")
    return self.max_batch_size / (self.step_seconds * output_tokens)
