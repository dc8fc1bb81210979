r"""Calibrates the simulator on a live two-region demo run and reports the gap.

  .venv/bin/python experiments/demo_two_region.py --json_out=runs/demo/report.json
  .venv/bin/python experiments/calibrate_simulator.py --demo_json=runs/demo/report.json \
      --json_out=runs/demo/calibration.json

1. ``ServiceProfile.from_demo_json`` fits the prefill profiles of both routes
   (cold requests' measured ``prefill_s``), S_kv (link bytes of cold PrfaaS
   requests), the decode step (median TPOT), the link capacity and the decode
   batch size to the demo report. Whatever could not be fitted comes from a
   tiny-model placeholder (``live_view.tiny_reference_profile``); the JSON lists
   what was fitted (``calibrated``).
2. The simulator replays the *same* workload: the demo's arrival times, prompt
   and output lengths, shared prefix, the demo's base threshold t and one
   PrfaaS, one PD-P and one PD-D instance (the demo's single PD node does PD-P
   and PD-D; the simulator gives them separate instances, one known gap).
3. It reports TTFT P50/P90, TPOT and egress, sim vs live, and their gap.

Live TTFT includes what the simulator's compute-and-bandwidth model has no
term for: gRPC calls, the transfer's Begin/Commit round trips over the relay's
RTT, the first-token handoff. The fitted per-route fixed overheads
(``pdp_overhead_s``, ``prfaas_overhead_s``; see ``paas_jax.simulation.calibration``)
put that back; the JSON reports the gap with them (``gap``) and without them
(``gap_without_overhead``), side by side on the same replay.

Known differences that remain: the live decode step grows with the batch and
the prompt (the simulator's ``context_fraction`` is 0 here), and the live link
is a relay with a bandwidth trace while the simulator gets the constant base
bandwidth.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import numpy as np
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FLAGS = flags.FLAGS
flags.DEFINE_string("demo_json", "runs/demo/report.json", "Report of demo_two_region.py.")
flags.DEFINE_string("json_out", "runs/demo/calibration.json", "Where to write the result.")


def _pct(xs, q):
  xs = [x for x in xs if x is not None]
  return float(np.percentile(xs, q)) if xs else None


def live_summary(rows: list[dict], wall_s: float | None) -> dict:
  ttft = [r["ttft_s"] for r in rows]
  tpot = [r["tpot_s"] for r in rows if r["output_tokens"] > 1]
  link_bytes = sum(r.get("link_bytes", 0) for r in rows)
  return {"requests": len(rows), "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
          "tpot_mean_ms": 1e3 * float(np.mean(tpot)) if tpot else None,
          "offload_fraction": float(np.mean([r["route"] == "prfaas" for r in rows])),
          "egress_bytes": float(link_bytes),
          "egress_mean_mbps": 8e-6 * link_bytes / wall_s if wall_s else None}


def simulate_demo(report: dict, service) -> tuple[dict, object]:
  from paas_jax.scheduling import PrfaasRouter, RouterConfig  # pylint: disable=g-import-not-at-top
  from paas_jax.simulation.prefix_cache import CacheSpec  # pylint: disable=g-import-not-at-top
  from paas_jax.simulation.simulator import Deployment, SimConfig, simulate  # pylint: disable=g-import-not-at-top
  from paas_jax.simulation.workload import SimRequest  # pylint: disable=g-import-not-at-top
  rows = [r for r in report["requests"] if not r.get("error")]
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


def gap(sim: dict, live: dict) -> dict:
  out = {}
  for k in ("ttft_p50_s", "ttft_p90_s", "tpot_mean_ms", "egress_bytes", "egress_mean_mbps",
            "offload_fraction"):
    a, b = sim.get(k), live.get(k)
    if a is None or b is None:
      out[k] = None
      continue
    out[k] = {"sim": a, "live": b, "abs": a - b, "rel": (a - b) / b if b else None}
  return out


def main(argv):
  del argv
  from paas_jax.scheduling import tiny_reference_profiles  # pylint: disable=g-import-not-at-top
  from paas_jax.simulation.calibration import ServiceProfile  # pylint: disable=g-import-not-at-top
  from paas_jax.simulation.link import BandwidthTrace  # pylint: disable=g-import-not-at-top
  report = json.loads(pathlib.Path(FLAGS.demo_json).read_text())
  rows = [r for r in report["requests"] if not r.get("error")]
  bandwidth = float(report.get("link_bandwidth_bps", 1e9))
  ref = ServiceProfile.from_profiles(
      tiny_reference_profiles(int(report.get("decode_max_batch_size", 8))),
      BandwidthTrace.constant(bandwidth if bandwidth > 0 else 1e9))
  service = ServiceProfile.from_demo_json(FLAGS.demo_json, ref, min_requests_per_point=2)
  sim, _ = simulate_demo(report, service)
  bare = dataclasses.replace(service, pdp_overhead_s=0.0, prfaas_overhead_s=0.0)
  sim_bare, _ = simulate_demo(report, bare)
  live = live_summary(rows, report.get("workload_wall_s"))
  out = {
      "demo_json": FLAGS.demo_json, "calibrated": list(service.calibrated),
      "profile": {
          "prfaas_points": list(zip(service.prfaas_prefill.lengths,
                                    service.prfaas_prefill.prefill_seconds)),
          "pdp_points": list(zip(service.pdp_prefill.lengths,
                                 service.pdp_prefill.prefill_seconds)),
          "s_kv_fixed_bytes": service.prfaas_prefill.kv_fixed_bytes,
          "s_kv_bytes_per_token": service.prfaas_prefill.kv_slope_bytes_per_token,
          "decode_step_s": service.decode.step_seconds,
          "decode_max_batch_size": service.decode.max_batch_size,
          "pdp_overhead_s": service.pdp_overhead_s,
          "prfaas_overhead_s": service.prfaas_overhead_s},
      "live": live, "sim": sim, "gap": gap(sim, live),
      "sim_without_overhead": sim_bare, "gap_without_overhead": gap(sim_bare, live),
  }
  path = pathlib.Path(FLAGS.json_out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  print(f"calibrated from {FLAGS.demo_json}: {', '.join(service.calibrated) or 'nothing'}")
  print(f"fixed overheads: pdp {1e3 * service.pdp_overhead_s:.1f} ms, "
        f"prfaas {1e3 * service.prfaas_overhead_s:.1f} ms")
  print(f"{'metric':18} {'sim':>10} {'live':>10} {'rel gap':>8} {'no overhead':>12}")
  for k, v in out["gap"].items():
    if v is None:
      print(f"{k:18} {'n/a':>10}")
      continue
    rel = "n/a" if v["rel"] is None else f"{100 * v['rel']:+.0f}%"
    b = out["gap_without_overhead"][k]
    rel_b = "n/a" if b is None or b["rel"] is None else f"{100 * b['rel']:+.0f}%"
    print(f"{k:18} {v['sim']:10.4g} {v['live']:10.4g} {rel:>8} {rel_b:>12}")
  print(f"written: {path}")
  return 0


if __name__ == "__main__":
  app.run(main)
