"""Replays a live demo run in the simulator and measures the gap, in and out of sample.

``calibrate_and_evaluate(fit_report, eval_reports)`` fits a ``ServiceProfile`` to one
demo report (``ServiceProfile.from_demo_records``) and replays, with that one profile,
the fit run itself (in sample) and each other run (out of sample: another seed and
load, never read by the fit). Each replay takes the run's own workload (arrival times,
prompt and output lengths, shared prefix, threshold t) and one PrfaaS, one PD-P and one
PD-D instance, and compares TTFT P50/P90, mean TPOT, offload fraction and egress with
what the run measured (``gap``: sim - live, absolute and relative).

Reports follow ``experiments/demo_two_region.py``'s JSON (see ``calibration``).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from paas_jax.scheduling import tiny_reference_profiles
from paas_jax.scheduling.router import PrfaasRouter, RouterConfig
from paas_jax.simulation.calibration import ServiceProfile
from paas_jax.simulation.link import BandwidthTrace
from paas_jax.simulation.prefix_cache import CacheSpec
from paas_jax.simulation.simulator import Deployment, SimConfig, simulate
from paas_jax.simulation.workload import SimRequest

GAP_METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_mean_ms", "egress_bytes", "egress_mean_mbps",
               "offload_fraction")


def tiny_reference(report: Mapping) -> ServiceProfile:
  """The placeholder for what a fit to ``report`` cannot measure (tiny models on CPU)."""
  bandwidth = float(report.get("link_bandwidth_bps", 1e9))
  return ServiceProfile.from_profiles(
      tiny_reference_profiles(int(report.get("decode_max_batch_size", 8))),
      BandwidthTrace.constant(bandwidth if bandwidth > 0 else 1e9))


def _pct(xs, q):
  xs = [x for x in xs if x is not None]
  return float(np.percentile(xs, q)) if xs else None


def ok_rows(report: Mapping) -> list[dict]:
  return [r for r in report["requests"] if not r.get("error")]


def offered_rate(report: Mapping) -> float | None:
  """Arrivals per second over the run's arrival span (the load it was offered)."""
  t = sorted(float(r.get("arrival_s", 0.0)) for r in report["requests"])
  return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None


def live_summary(report: Mapping) -> dict:
  """What the run measured, over its requests without an error."""
  rows = ok_rows(report)
  wall_s = report.get("workload_wall_s")
  ttft = [r["ttft_s"] for r in rows]
  tpot = [r["tpot_s"] for r in rows if r["output_tokens"] > 1]
  link_bytes = sum(r.get("link_bytes", 0) for r in rows)
  return {"requests": len(rows), "offered_rps": offered_rate(report), "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
          "tpot_mean_ms": 1e3 * float(np.mean(tpot)) if tpot else None,
          "offload_fraction": float(np.mean([r["route"] == "prfaas" for r in rows])),
          "egress_bytes": float(link_bytes),
          "egress_mean_mbps": 8e-6 * link_bytes / wall_s if wall_s else None}


def simulate_demo(report: Mapping, service: ServiceProfile) -> tuple[dict, object]:
  """The simulator's account of ``report``'s workload with ``service``; (summary, SimResult)."""
  rows = ok_rows(report)
  shared = int(report.get("prefix_cache", {}).get("shared_prefix_tokens", 0) or 0)
  block = int(report.get("prefix_cache", {}).get("block_tokens", 0) or 0)
  reqs = []
  for i, r in enumerate(sorted(rows, key=lambda r: r.get("arrival_s", 0.0))):
    n_in = int(r["input_tokens"])
    reqs.append(SimRequest(request_id=i, arrival_s=float(r.get("arrival_s", 0.0)),
                           input_tokens=n_in, output_tokens=max(int(r["output_tokens"]), 2),
                           prefix_id=0 if shared else -1,
                           shared_tokens=min(shared, n_in - 1) if shared else 0))
  t = float(report["threshold_tokens"])
  lengths = np.array([q.input_tokens for q in reqs], float)
  long_, short = lengths[lengths > t], lengths[lengths <= t]
  cfg = RouterConfig(
      threshold_tokens=t,
      prfaas_service_s=max(float(service.prfaas_prefill.t_prefill(
          long_.mean() if long_.size else lengths.mean())), 1e-4),
      pdp_service_s=max(float(service.pdp_prefill.t_prefill(
          short.mean() if short.size else lengths.mean())), 1e-4))
  cache = (CacheSpec(block_tokens=block, checkpoint_interval_tokens=block,
                     capacity_bytes=256 * 2**20) if block else CacheSpec(capacity_bytes=0))
  sim = SimConfig(service=service, deployment=Deployment(n_prfaas=1, n_pdp=1, n_decode=1),
                  router=PrfaasRouter(cfg), cache=cache, utilization_window_s=2.0)
  result = simulate(sim, reqs)
  recs = result.records
  start = min(r.arrival_s for r in recs)
  end = max(r.finish_s for r in recs)
  egress = float(sum(r.egress_bytes for r in recs))
  return {"requests": len(recs), "unfinished": result.unfinished,
          "ttft_p50_s": _pct([r.ttft_s for r in recs], 50),
          "ttft_p90_s": _pct([r.ttft_s for r in recs], 90),
          "tpot_mean_ms": 1e3 * float(np.mean([r.tpot_s for r in recs])),
          "offload_fraction": float(np.mean([r.route == "prfaas" for r in recs])),
          "cached_tokens": int(sum(r.cached_tokens for r in recs)),
          "egress_bytes": egress,
          "egress_mean_mbps": 8e-6 * egress / max(end - start, 1e-9),
          "router": {"threshold_tokens": t, "prfaas_service_s": cfg.prfaas_service_s,
                     "pdp_service_s": cfg.pdp_service_s}}, result


def gap(sim: Mapping, live: Mapping) -> dict:
  """Per metric: sim, live, sim - live and (sim - live) / live."""
  out = {}
  for k in GAP_METRICS:
    a, b = sim.get(k), live.get(k)
    if a is None or b is None:
      out[k] = None
      continue
    out[k] = {"sim": a, "live": b, "abs": a - b, "rel": (a - b) / b if b else None}
  return out


def evaluate(report: Mapping, service: ServiceProfile) -> dict:
  """One run replayed with ``service``, with and without the fitted fixed overheads."""
  live = live_summary(report)
  sim, _ = simulate_demo(report, service)
  bare = dataclasses.replace(service, pdp_overhead_s=0.0, prfaas_overhead_s=0.0)
  sim_bare, _ = simulate_demo(report, bare)
  return {"live": live, "sim": sim, "gap": gap(sim, live), "sim_without_overhead": sim_bare,
          "gap_without_overhead": gap(sim_bare, live)}


def calibrate_and_evaluate(fit_report: Mapping, eval_reports: Mapping[str, Mapping],
                           reference: ServiceProfile, **fit_kwargs) -> dict:
  """Fits on ``fit_report`` only; replays it (in sample) and each of ``eval_reports``
  (out of sample) with the same profile. ``out_vs_in``: per metric, the relative gap
  out of sample beside the in-sample one."""
  service = ServiceProfile.from_demo_records(fit_report, reference, **fit_kwargs)
  result = {"calibrated": list(service.calibrated), "service": service,
            "in_sample": evaluate(fit_report, service),
            "out_of_sample": {name: evaluate(r, service) for name, r in eval_reports.items()}}
  rows = {}
  for k in GAP_METRICS:
    ins = result["in_sample"]["gap"][k]
    rows[k] = {"in_sample_rel": None if ins is None else ins["rel"],
               **{f"{name}_rel": (None if ev["gap"][k] is None else ev["gap"][k]["rel"])
                  for name, ev in result["out_of_sample"].items()}}
  result["out_vs_in"] = rows
  return result
