"""Fitting service-time profiles to measured requests (typed records in, profiles out).

The live broker (its rebalancer step) and the simulator's ``ServiceProfile`` both
fit prefill, decode and overhead numbers to finished requests; the fit lives here,
in ``scheduling/``, so that ``serving/`` never imports ``simulation/``.

A ``FinishedRequest`` is one measured request: its route (``"pdp"`` or
``"prfaas"``), prompt / cached / output token counts and, where measured,
``prefill_s`` (pure prefill compute), ``prefill_queue_s`` (wait for a prefill
slot), ``ttft_s``, ``tpot_s`` and ``link_bytes`` (bytes the request put on the
inter-region link).

Fitting, per route, uses cold requests only (``cached_tokens == 0``, whose latency is a
clean T_prefill sample): lengths are split into up to ``max_points`` equal-count bins and
each bin contributes (median length, median prefill_s) as a profile point, so stragglers
do not bend the curve. The points' times are then made non-decreasing in length
(isotonic regression, bins weighted by their requests) and a quadratic fit is
``monotone_quadratic`` (profiles.py): a compile stall or a queue in one bin must not
give a profile whose prefill gets cheaper, or negative, with length, which the
throughput model would take at its word (it proposed t = 0 from such a fit).
``prefill_s`` falls back to ``ttft_s`` (an upper bound that also holds queueing and
transfer) and the profile records that it did. S_kv comes from
(input_tokens, link_bytes) of cold PrfaaS requests (the link carries exactly S_kv there)
and is shared by both routes, because it is a property of the model. The decode step time
is the median TPOT.

The per-route fixed overhead (``pdp_overhead_s``, ``prfaas_overhead_s``) is what a
request's TTFT holds beyond its prefill wait, its prefill compute and its bytes at link
speed: RPCs, the transfer's Begin/Commit round trips and the relay RTT, the first-token
handoff and the first decode step. It is fitted as the median of
``ttft_s - prefill_queue_s - prefill_s - 8*link_bytes/bandwidth`` over the requests that
carry ``prefill_s`` (clamped at 0), and needs the link bandwidth for the PrfaaS route.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from scipy import optimize

from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile

ROUTES = ("pdp", "prfaas")
_OPTIONAL_NUMBERS = ("prefill_s", "prefill_queue_s", "ttft_s", "tpot_s", "link_bytes")


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
  """One measured request (see the module docstring); checked by ``fit_profiles``."""

  route: str
  input_tokens: float
  output_tokens: float
  cached_tokens: float = 0
  prefill_s: float | None = None
  prefill_queue_s: float | None = None
  ttft_s: float | None = None
  tpot_s: float | None = None
  link_bytes: float | None = None

  @classmethod
  def from_mapping(cls, r: Mapping[str, Any]) -> "FinishedRequest":
    """From a JSON object (a demo report row); unknown keys are ignored."""
    return cls(route=r.get("route"), input_tokens=r.get("input_tokens"),
               output_tokens=r.get("output_tokens"), cached_tokens=r.get("cached_tokens", 0),
               **{k: r.get(k) for k in _OPTIONAL_NUMBERS})


@dataclasses.dataclass(frozen=True)
class ProfileSet:
  """What the fit produces (and the reference it starts from).

  Attributes:
    prfaas_prefill: PrfaaS prefill instance profile.
    pdp_prefill: PD-P prefill instance profile.
    decode: PD-D instance profile.
    pdp_overhead_s: fixed latency a locally prefilled request's state takes to be
      ready for decode beyond its compute (RPC and handoff), seconds.
    prfaas_overhead_s: the same for an offloaded request, beyond its compute and its
      bytes at link speed (transfer round trips, RTT, first-token handoff), seconds.
    link_bandwidth_bps: the link bandwidth the fit was given (bits/s), None if none.
    calibrated: which fields were fitted from measurements (empty for pure profiles).
  """

  prfaas_prefill: PrefillProfile
  pdp_prefill: PrefillProfile
  decode: DecodeProfile
  pdp_overhead_s: float = 0.0
  prfaas_overhead_s: float = 0.0
  link_bandwidth_bps: float | None = None
  calibrated: tuple[str, ...] = ()


def check_request(i: int, r: FinishedRequest) -> None:
  """Raises ``ValueError`` naming ``requests[i]`` if the record cannot be fitted."""
  if r.route not in ROUTES:
    raise ValueError(f"requests[{i}].route must be 'pdp' or 'prfaas', got {r.route!r}")
  for key in ("input_tokens", "output_tokens"):
    v = getattr(r, key)
    if not isinstance(v, (int, float)) or v < 1:
      raise ValueError(f"requests[{i}].{key} must be a number >= 1")
  if not 0 <= r.cached_tokens <= r.input_tokens:
    raise ValueError(f"requests[{i}].cached_tokens must lie in [0, input_tokens]")
  if r.prefill_s is None and r.ttft_s is None:
    raise ValueError(f"requests[{i}] needs prefill_s or ttft_s")
  for key in _OPTIONAL_NUMBERS:
    v = getattr(r, key)
    if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
      raise ValueError(f"requests[{i}].{key} must be a finite number >= 0")


def fit_profiles(requests: Sequence[FinishedRequest], reference: ProfileSet, *,
                 link_bandwidth_bps: float | None = None,
                 decode_max_batch_size: int | None = None, max_points: int = 6,
                 min_requests_per_point: int = 3) -> ProfileSet:
  """Fits profiles to measured requests; unmeasured parts come from ``reference``.

  Raises ``ValueError`` for a record that cannot be fitted or an unphysical S_kv.
  """
  for i, r in enumerate(requests):
    check_request(i, r)
  rows = list(requests)
  calibrated: list[str] = []

  prfaas_cold = [r for r in rows if r.route == "prfaas" and r.cached_tokens == 0]
  kv = reference.prfaas_prefill
  kv_fixed, kv_slope = kv.kv_fixed_bytes, kv.kv_slope_bytes_per_token
  with_bytes = [r for r in prfaas_cold if r.link_bytes is not None]
  if len({r.input_tokens for r in with_bytes}) >= 2:
    x = np.array([r.input_tokens for r in with_bytes], dtype=np.float64)
    y = np.array([r.link_bytes for r in with_bytes], dtype=np.float64)
    kv_slope, kv_fixed = (float(v) for v in np.polyfit(x, y, 1))
    if kv_slope < 0 or kv_fixed < 0:
      raise ValueError(f"fitted S_kv = {kv_fixed:.3g} + {kv_slope:.3g}*l is not physical")
    calibrated.append("s_kv")

  def fit_route(route: str, ref: PrefillProfile) -> PrefillProfile:
    cold = [r for r in rows if r.route == route and r.cached_tokens == 0]
    pts = _binned_points(cold, max_points, min_requests_per_point)
    if pts is None:
      prof = ref
    else:
      ls, ts, used_ttft = pts
      prof = PrefillProfile(
          name=f"{ref.name}(demo)", lengths=tuple(ls), prefill_seconds=tuple(ts),
          kv_bytes=tuple(kv_fixed + kv_slope * l for l in ls),
          gpus_per_instance=ref.gpus_per_instance,
          interpolation=("monotone_quadratic" if ref.interpolation != "piecewise_linear"
                         and len(ls) >= 3 else "piecewise_linear"))
      calibrated.append(f"{route}_prefill" + ("(from ttft_s)" if used_ttft else ""))
    if "s_kv" in calibrated and pts is None:
      prof = dataclasses.replace(prof, kv_bytes=tuple(kv_fixed + kv_slope * l for l in prof.lengths))
    return prof

  prfaas = fit_route("prfaas", reference.prfaas_prefill)
  pdp = fit_route("pdp", reference.pdp_prefill)

  decode = reference.decode
  tpots = [r.tpot_s for r in rows if r.tpot_s is not None]
  if tpots:
    decode = dataclasses.replace(decode, step_seconds=float(np.median(tpots)))
    calibrated.append("decode_step_seconds")
  if decode_max_batch_size is not None:
    decode = dataclasses.replace(decode, max_batch_size=int(decode_max_batch_size))
    calibrated.append("decode_max_batch_size")

  bandwidth = None
  if link_bandwidth_bps is not None:
    bandwidth = float(link_bandwidth_bps)
    calibrated.append("link")

  overheads = {"pdp": reference.pdp_overhead_s, "prfaas": reference.prfaas_overhead_s}
  for route in overheads:
    resid = _overhead_samples(rows, route, bandwidth)
    if resid:
      overheads[route] = float(np.median(resid))
      calibrated.append(f"{route}_overhead")
  return ProfileSet(prfaas_prefill=prfaas, pdp_prefill=pdp, decode=decode,
                    pdp_overhead_s=overheads["pdp"], prfaas_overhead_s=overheads["prfaas"],
                    link_bandwidth_bps=bandwidth, calibrated=tuple(calibrated))


def _overhead_samples(rows: Iterable[FinishedRequest], route: str,
                      bandwidth_bps: float | None) -> list[float]:
  """TTFT left over after prefill wait, compute and link time (module docstring)."""
  out = []
  for r in rows:
    if r.route != route or r.prefill_s is None or r.ttft_s is None:
      continue
    wire = 0.0
    if route == "prfaas":
      if not bandwidth_bps or r.link_bytes is None:
        continue
      wire = 8.0 * r.link_bytes / bandwidth_bps
    resid = r.ttft_s - (r.prefill_queue_s or 0.0) - r.prefill_s - wire
    out.append(max(resid, 0.0))
  return out


def _binned_points(rows: Iterable[FinishedRequest], max_points: int,
                   min_per_point: int) -> tuple[list[float], list[float], bool] | None:
  """Equal-count bins -> (median length, median prefill time), times made
  non-decreasing in length; None if < 2 usable points."""
  rows = sorted(rows, key=lambda r: r.input_tokens)
  n_points = min(max_points, len(rows) // max(min_per_point, 1))
  if n_points < 2:
    return None
  used_ttft = any(r.prefill_s is None for r in rows)
  ls, ts, counts = [], [], []
  for chunk in np.array_split(np.arange(len(rows)), n_points):
    sel = [rows[j] for j in chunk]
    ls.append(float(np.median([r.input_tokens for r in sel])))
    ts.append(float(np.median([r.prefill_s if r.prefill_s is not None else r.ttft_s
                               for r in sel])))
    counts.append(len(sel))
  # Profile lengths must strictly increase; merge bins that share a median length.
  merged_l, merged_t, merged_n = [], [], []
  for l, t, n in zip(ls, ts, counts):
    if merged_l and l <= merged_l[-1]:
      merged_t[-1] = 0.5 * (merged_t[-1] + t)
      merged_n[-1] += n
    else:
      merged_l.append(l)
      merged_t.append(t)
      merged_n.append(n)
  if len(merged_l) < 2:
    return None
  monotone = optimize.isotonic_regression(merged_t, weights=merged_n, increasing=True).x
  return merged_l, [float(t) for t in monotone], used_ttft
