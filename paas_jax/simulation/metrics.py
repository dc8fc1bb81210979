"""Summary statistics of a simulation run."""

from __future__ import annotations

import dataclasses

import numpy as np

from paas_jax.simulation.simulator import SimResult


@dataclasses.dataclass(frozen=True)
class SloSpec:
  """TTFT bound (s) and TPOT bound (s/token; 40 tok/s -> 0.025)."""

  ttft_s: float = 10.0
  tpot_s: float = 1.0 / 40.0

  def __post_init__(self):
    if self.ttft_s <= 0 or self.tpot_s <= 0:
      raise ValueError("SLO bounds must be > 0")


def _pct(x: np.ndarray, q: float) -> float:
  return float(np.percentile(x, q)) if x.size else float("nan")


def summarize(result: SimResult, slo: SloSpec = SloSpec()) -> dict:
  """Latency percentiles, SLO attainment, routing mix and link use of one run.

  Egress is reported as the mean over the makespan (first arrival to last finish) and as
  the peak 1-bin average, both in Gbps (1e9 bits/s).
  """
  recs = result.records
  if not recs:
    raise ValueError("no completed requests to summarize")
  ttft = np.array([r.ttft_s for r in recs])
  tpot = np.array([r.tpot_s for r in recs])
  start = min(r.arrival_s for r in recs)
  end = max(r.finish_s for r in recs)
  makespan = max(end - start, 1e-9)
  egress_bits = 8.0 * sum(r.egress_bytes for r in recs)
  bins = result.egress_bytes_per_bin
  ok_ttft = ttft <= slo.ttft_s
  ok_tpot = tpot <= slo.tpot_s * (1 + 1e-9)
  offloaded = np.array([r.route == "prfaas" for r in recs])
  return {
      "requests": len(recs),
      "unfinished": result.unfinished,
      "throughput_rps": len(recs) / makespan,
      "ttft_mean_s": float(ttft.mean()),
      "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
      "tpot_mean_ms": 1e3 * float(tpot.mean()),
      "tpot_p50_ms": 1e3 * _pct(tpot, 50), "tpot_p90_ms": 1e3 * _pct(tpot, 90),
      "tpot_p99_ms": 1e3 * _pct(tpot, 99),
      "slo_ttft_attainment": float(ok_ttft.mean()),
      "slo_tpot_attainment": float(ok_tpot.mean()),
      "slo_both_attainment": float((ok_ttft & ok_tpot).mean()),
      "offload_fraction": float(offloaded.mean()),
      "cached_token_fraction": float(sum(r.cached_tokens for r in recs) / sum(r.input_tokens for r in recs)),
      "cross_cluster_prefix_transfers": int(sum(r.prefix_source not in ("none", r.route) for r in recs)),
      "egress_gbps_mean": egress_bits / makespan / 1e9,
      "egress_gbps_peak_bin": float(8.0 * bins.max() / result.egress_bin_s / 1e9) if bins.size else 0.0,
      "makespan_s": makespan,
      "events": result.events,
  }
