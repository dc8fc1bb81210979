"""The PrfaaS steady-state throughput model (paper Eqs. 1-8) and its grid search.

Requests longer than the offload threshold t (tokens) are prefilled in the remote PrfaaS
cluster and their KV/recurrent state crosses the inter-datacenter link; the rest are
prefilled by the local PD-P instances. All requests decode on PD-D.

  p            = P(L > t)                                         offload fraction
  l_long       = E[L | L > t],   l_short = E[L | L <= t]
  Phi_kv(l)    = S_kv(l) / T_prefill(l)                           (Eq. 1, bits/s)
  Theta_prfaas = min(N_prfaas / T_prfaas(l_long), B_out / S_kv(l_long))    req/s
  Theta_pdp    = N_p / T_pdp(l_short)                             req/s, PD-P hardware
  Theta_pdd    = N_d * BS_max / (T_decode * L_out)                req/s
  Lambda_max   = min(Theta_prfaas / p, Theta_pdp / (1 - p), Theta_pdd)
  egress       = Lambda_max * p * E[S_kv(L) | L > t] * 8          bits/s (= ... S_kv(l_long), affine)

The threshold convention: a request is offloaded iff L > t, so t = 0 offloads everything
(naive heterogeneous) and t >= hi offloads nothing (homogeneous PD).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from paas_jax.scheduling.distributions import LengthDistribution
from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile

PREFILL_TIME_MODES = ("at_conditional_mean", "expected")

# Relative tolerance inside which two Lambda_max values count as a tie in the searches.
_TIE_RTOL = 1e-9


@dataclasses.dataclass(frozen=True)
class SystemModel:
  """Everything Eqs. 1-8 need besides the instance counts and the threshold.

  Attributes:
    prfaas_profile: prefill profile of a PrfaaS instance (e.g. 8xH200).
    pdp_profile: prefill profile of a local PD-P instance (e.g. 8xH20).
    decode_profile: one PD-D instance.
    lengths: input-length distribution (tokens).
    output_tokens: L_out, generated tokens per request.
    egress_bandwidth_bps: B_out, PrfaaS -> PD link capacity available to KV (bits/s).
    prefill_time_mode: "at_conditional_mean" is the paper's Eqs. 4-5, T(E[L | class]);
      "expected" uses E[T(L) | class], the true mean service time. T is convex, so the
      paper's form over-states capacity by the Jensen gap (~5% for the homogeneous
      baseline, whose class spans the whole distribution).
  """

  prfaas_profile: PrefillProfile
  pdp_profile: PrefillProfile
  decode_profile: DecodeProfile
  lengths: LengthDistribution
  output_tokens: float
  egress_bandwidth_bps: float
  prefill_time_mode: str = "at_conditional_mean"

  def __post_init__(self):
    if self.prefill_time_mode not in PREFILL_TIME_MODES:
      raise ValueError(f"prefill_time_mode must be one of {PREFILL_TIME_MODES}, got {self.prefill_time_mode!r}")
    if not (self.output_tokens > 0 and math.isfinite(self.output_tokens)):
      raise ValueError(f"output_tokens must be finite and > 0, got {self.output_tokens}")
    if not (self.egress_bandwidth_bps >= 0 and math.isfinite(self.egress_bandwidth_bps)):
      raise ValueError(f"egress_bandwidth_bps must be finite and >= 0, got {self.egress_bandwidth_bps}")


@dataclasses.dataclass(frozen=True)
class ThroughputBreakdown:
  """Eqs. 1-8 evaluated at one (t, N_prfaas, N_p, N_d). Rates in req/s, egress in bits/s."""

  threshold_tokens: float
  n_prfaas: int
  n_p: int
  n_d: int
  offload_fraction: float  # p
  l_long: float  # E[L | L > t]; nan when p == 0
  l_short: float  # E[L | L <= t]; nan when p == 1
  theta_prfaas_compute: float  # N_prfaas / T_prfaas(l_long)
  theta_prfaas_link: float  # B_out / S_kv(l_long)
  theta_prfaas: float
  theta_pdp: float
  theta_pdd: float
  lambda_max: float
  bottleneck: str  # "prfaas" | "pdp" | "pdd"
  egress_bps: float  # mean PrfaaS egress at Lambda_max

  @property
  def prefill_capacity(self) -> float:
    """min(Theta_prfaas/p, Theta_pdp/(1-p)): the request rate the prefill side alone sustains."""
    return min(_safe_div(self.theta_prfaas, self.offload_fraction),
               _safe_div(self.theta_pdp, 1.0 - self.offload_fraction))

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["prefill_capacity"] = self.prefill_capacity
    return d


def _safe_div(num: float, den: float) -> float:
  # A stage that receives no traffic never limits throughput.
  return math.inf if den <= 0 else num / den


def theta_pdd(decode: DecodeProfile, n_d: int, output_tokens: float) -> float:
  """Eq. 7: N_d * BS_max / (T_decode * L_out), req/s."""
  if n_d < 0:
    raise ValueError(f"n_d must be >= 0, got {n_d}")
  return n_d * decode.requests_per_second(output_tokens)


def _evaluate_grid(system: SystemModel, n_prfaas: int, n_p: int, n_d: int,
                   thresholds: np.ndarray) -> dict[str, np.ndarray]:
  """Vectorised Eqs. 1-8 over an array of thresholds (tokens) for one instance split."""
  if min(n_prfaas, n_p, n_d) < 0:
    raise ValueError(f"instance counts must be >= 0, got {n_prfaas}/{n_p}/{n_d}")
  t = np.asarray(thresholds, dtype=np.float64)
  if t.ndim != 1 or t.size == 0 or np.any(~np.isfinite(t)) or np.any(t < 0):
    raise ValueError("thresholds must be a non-empty 1-D array of finite values >= 0")
  dist = system.lengths
  p = np.clip(dist.prob_greater(t), 0.0, 1.0)
  l_long = np.where(p > 0, dist.mean_between(t, math.inf), np.nan)
  l_short = np.where(p < 1, dist.mean_between(0.0, t), np.nan)
  if system.prefill_time_mode == "expected":
    _, t_long = _conditional_expectations(dist, system.prfaas_profile.t_prefill, t)
    t_short, _ = _conditional_expectations(dist, system.pdp_profile.t_prefill, t)
  else:
    t_long = system.prfaas_profile.t_prefill(l_long)
    t_short = system.pdp_profile.t_prefill(l_short)
  with np.errstate(invalid="ignore", divide="ignore"):
    s_long_bits = 8.0 * system.prfaas_profile.s_kv(l_long)
    th_comp = np.where(p > 0, n_prfaas / t_long, np.nan)
    th_link = np.where(p > 0, system.egress_bandwidth_bps / s_long_bits, np.nan)
    th_prfaas = np.minimum(th_comp, th_link)
    th_pdp = np.where(p < 1, n_p / t_short, np.nan)
    lim_prfaas = np.where(p > 0, th_prfaas / np.where(p > 0, p, 1.0), np.inf)
    lim_pdp = np.where(p < 1, th_pdp / np.where(p < 1, 1.0 - p, 1.0), np.inf)
  th_pdd = np.full(t.shape, theta_pdd(system.decode_profile, n_d, system.output_tokens))
  lam = np.minimum(np.minimum(lim_prfaas, lim_pdp), th_pdd)
  # E[S_kv(L) | L > t] = S_kv(l_long) because S_kv is affine in l.
  egress = np.where(p > 0, lam * p * np.nan_to_num(s_long_bits), 0.0)
  return dict(t=t, p=p, l_long=l_long, l_short=l_short, th_comp=th_comp, th_link=th_link,
              th_prfaas=th_prfaas, th_pdp=th_pdp, th_pdd=th_pdd, lim_prfaas=lim_prfaas,
              lim_pdp=lim_pdp, lam=lam, egress=egress)


def _conditional_expectations(dist: LengthDistribution, f, t: np.ndarray,
                              cells: int = 20000) -> tuple[np.ndarray, np.ndarray]:
  """(E[f(L) | L <= t], E[f(L) | L > t]) for every t, on a fine log-spaced grid of L.

  One cumulative sum serves all thresholds; each cell spans 1/cells of the log-range
  (6e-4 in ln L for [128, 128K]), far below the resolution of the threshold grid.
  """
  edges = np.geomspace(dist.lo, dist.hi, cells + 1)
  mass = np.diff(1.0 - dist.prob_greater(edges))
  mass[0] += 1.0 - dist.prob_greater(edges[0])  # an atom at lo (empirical distributions)
  vals = np.asarray(f(np.sqrt(edges[1:] * edges[:-1])), dtype=np.float64)
  cum_m = np.concatenate([[0.0], np.cumsum(mass)])
  cum_v = np.concatenate([[0.0], np.cumsum(mass * vals)])
  k = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, cells)
  below_m, below_v = cum_m[k], cum_v[k]
  above_m, above_v = cum_m[-1] - below_m, cum_v[-1] - below_v
  with np.errstate(invalid="ignore", divide="ignore"):
    return (np.where(below_m > 0, below_v / np.where(below_m > 0, below_m, 1.0), np.nan),
            np.where(above_m > 0, above_v / np.where(above_m > 0, above_m, 1.0), np.nan))


def _breakdown(g: dict[str, np.ndarray], i: int, n_prfaas: int, n_p: int, n_d: int) -> ThroughputBreakdown:
  limits = {"prfaas": g["lim_prfaas"][i], "pdp": g["lim_pdp"][i], "pdd": g["th_pdd"][i]}
  return ThroughputBreakdown(
      threshold_tokens=float(g["t"][i]), n_prfaas=n_prfaas, n_p=n_p, n_d=n_d,
      offload_fraction=float(g["p"][i]), l_long=float(g["l_long"][i]), l_short=float(g["l_short"][i]),
      theta_prfaas_compute=float(g["th_comp"][i]), theta_prfaas_link=float(g["th_link"][i]),
      theta_prfaas=float(g["th_prfaas"][i]), theta_pdp=float(g["th_pdp"][i]),
      theta_pdd=float(g["th_pdd"][i]), lambda_max=float(g["lam"][i]),
      bottleneck=min(limits, key=lambda k: limits[k]), egress_bps=float(g["egress"][i]))


def evaluate(system: SystemModel, threshold_tokens: float, n_prfaas: int, n_p: int,
             n_d: int) -> ThroughputBreakdown:
  """Eqs. 1-8 at one operating point."""
  g = _evaluate_grid(system, n_prfaas, n_p, n_d, np.asarray([threshold_tokens], dtype=np.float64))
  return _breakdown(g, 0, n_prfaas, n_p, n_d)


def default_thresholds(system: SystemModel, step_tokens: float = 100.0) -> np.ndarray:
  """Candidate thresholds: 0 (offload all), every ``step_tokens`` across [lo, hi], and hi (none)."""
  if step_tokens <= 0:
    raise ValueError(f"step_tokens must be > 0, got {step_tokens}")
  lo, hi = float(system.lengths.lo), float(system.lengths.hi)
  grid = np.arange(math.ceil(lo / step_tokens) * step_tokens, hi, step_tokens)
  return np.unique(np.concatenate([[0.0], grid, [hi]]))


def _argbest(g: dict[str, np.ndarray]) -> int:
  """Index of the best threshold: max Lambda_max; ties -> max prefill headroom, then least egress.

  Ties happen when decode binds (a plateau of t all reaching Theta_pdd). Among them we
  prefer the most balanced prefill split (most slack for bursts), then the lowest egress.
  """
  lam = g["lam"]
  best = np.max(lam)
  tied = lam >= best * (1.0 - _TIE_RTOL)
  headroom = np.minimum(g["lim_prfaas"], g["lim_pdp"])
  cand = np.flatnonzero(tied)
  hr = headroom[cand]
  cand = cand[hr >= np.max(hr) * (1.0 - _TIE_RTOL)]
  return int(cand[np.argmin(g["egress"][cand])])


def select_offload_threshold(system: SystemModel, n_prfaas: int, n_p: int, n_d: int,
                             thresholds: Sequence[float] | np.ndarray | None = None) -> ThroughputBreakdown:
  """Grid search of t maximising Lambda_max for a fixed instance split (Eq. 8 argmax)."""
  t = default_thresholds(system) if thresholds is None else np.asarray(thresholds, dtype=np.float64)
  g = _evaluate_grid(system, n_prfaas, n_p, n_d, t)
  return _breakdown(g, _argbest(g), n_prfaas, n_p, n_d)


@dataclasses.dataclass(frozen=True)
class DeploymentPlan:
  """Result of ``solve_deployment``: the best operating point and the per-split optima."""

  best: ThroughputBreakdown
  candidates: tuple[ThroughputBreakdown, ...]  # best threshold for every feasible N_p


def solve_deployment(system: SystemModel, n_prfaas: int, n_local: int, *,
                     n_p_choices: Sequence[int] | None = None,
                     thresholds: Sequence[float] | np.ndarray | None = None) -> DeploymentPlan:
  """Joint grid search over the N_p/N_d split of the local cluster and the threshold t.

  Args:
    system: the throughput model inputs.
    n_prfaas: PrfaaS prefill instances (0 = homogeneous PD: nothing can be offloaded).
    n_local: local instances to split into N_p prefill + N_d decode (N_d >= 1).
    n_p_choices: restrict N_p (e.g. ``(0,)`` for naive heterogeneous, which has no PD-P).
    thresholds: candidate t values; default ``default_thresholds(system)``.

  Returns:
    The plan maximising Lambda_max, tie-broken as in ``select_offload_threshold``.
  """
  if n_prfaas < 0 or n_local < 1:
    raise ValueError(f"need n_prfaas >= 0 and n_local >= 1, got {n_prfaas}, {n_local}")
  choices = range(0, n_local) if n_p_choices is None else tuple(n_p_choices)
  t = default_thresholds(system) if thresholds is None else np.asarray(thresholds, dtype=np.float64)
  if n_prfaas == 0:
    # Nothing can be offloaded: only t >= hi (p = 0) is feasible.
    t = np.asarray([float(system.lengths.hi)])
  cands = []
  for n_p in choices:
    n_d = n_local - n_p
    if not (0 <= n_p < n_local):
      raise ValueError(f"N_p={n_p} leaves no decode instance out of n_local={n_local}")
    g = _evaluate_grid(system, n_prfaas, n_p, n_d, t)
    cands.append(_breakdown(g, _argbest(g), n_prfaas, n_p, n_d))
  if not cands:
    raise ValueError("no feasible N_p choice")
  top = max(c.lambda_max for c in cands)
  tied = [c for c in cands if c.lambda_max >= top * (1.0 - _TIE_RTOL)]
  best = max(tied, key=lambda c: (min(c.prefill_capacity, c.theta_pdd), -c.egress_bps))
  return DeploymentPlan(best=best, candidates=tuple(cands))


def ttft_no_queue(system: SystemModel, threshold_tokens: float, *,
                  include_transfer: bool = False, quantiles: Sequence[float] = (0.5, 0.9, 0.99),
                  grid_points: int = 20001) -> dict[str, float]:
  """TTFT when nobody queues: T_pdp(L) if L <= t else T_prfaas(L) (+ S_kv(L)/B_out).

  This is what Table 6's TTFT columns are consistent with (e.g. naive P90 = T_H200(P90 of L)).
  Mean by quadrature; quantiles from the TTFT CDF on a fine log-spaced grid of L.

  Returns:
    {"mean": s, "p50": s, "p90": s, ...} for the given quantile levels.
  """
  dist = system.lengths
  bw = system.egress_bandwidth_bps

  def ttft(l):
    l = np.asarray(l, dtype=np.float64)
    remote = system.prfaas_profile.t_prefill(l)
    if include_transfer:
      remote = remote + (8.0 * system.prfaas_profile.s_kv(l) / bw if bw > 0 else np.inf)
    return np.where(l > threshold_tokens, remote, system.pdp_profile.t_prefill(l))

  t = float(threshold_tokens)
  p = float(dist.prob_greater(t))
  mean = 0.0
  if p < 1.0:
    mean += (1.0 - p) * dist.expect(ttft, 0.0, t)
  if p > 0.0:
    mean += p * dist.expect(ttft, t, math.inf)
  edges = np.geomspace(dist.lo, dist.hi, grid_points)
  mid = np.sqrt(edges[1:] * edges[:-1])
  w = np.diff(1.0 - dist.prob_greater(edges))
  vals = ttft(mid)
  order = np.argsort(vals)
  cdf = np.cumsum(w[order]) / np.sum(w)
  out = {"mean": mean}
  for q in quantiles:
    out[f"p{round(q * 100):d}"] = float(vals[order][min(np.searchsorted(cdf, q), len(cdf) - 1)])
  return out
