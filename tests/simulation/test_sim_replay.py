"""Simulator calibration in and out of sample (issue 12): fit on one demo run, replay
another (other seed and load) with the same profile.

Negative controls: the eval run is never read by the fit (scrambling its measurements
moves only the out-of-sample gap), and the out-of-sample replay is of the eval run's own
workload, not the fitted run's.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from paas_jax.simulation import replay

T = 150  # threshold, tokens
REFERENCE = replay.tiny_reference({"link_bandwidth_bps": 50e6, "decode_max_batch_size": 8})


def _run(seed: int, rate: float, n: int = 24) -> dict:
  """A demo-shaped report from 'true' service times: prefill 0.02 + 2e-4*l s, 60 B/token
  of state over a 50 Mbit/s link, 30 ms of fixed overhead, decode 10 ms/token."""
  rng = np.random.default_rng(seed)
  arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
  rows = []
  for i, (a, l) in enumerate(zip(arrivals, rng.integers(40, 300, n))):
    l = int(l)
    route = "prfaas" if l > T else "pdp"
    prefill = 0.02 + 2e-4 * l
    nbytes = 2000 + 60 * l if route == "prfaas" else 0
    wire = 8 * nbytes / 50e6
    rows.append({"request": i, "route": route, "input_tokens": l, "output_tokens": 16,
                 "arrival_s": float(a), "cached_tokens": 0, "prefill_s": prefill,
                 "prefill_queue_s": 0.0, "ttft_s": prefill + wire + 0.03, "tpot_s": 0.01,
                 "link_bytes": nbytes, "error": ""})
  return {"seed": seed, "threshold_tokens": T, "link_bandwidth_bps": 50e6,
          "decode_max_batch_size": 8, "workload_wall_s": float(arrivals[-1]) + 1.0,
          "requests": rows}


def _evaluate(fit, evals):
  return replay.calibrate_and_evaluate(fit, evals, REFERENCE, min_requests_per_point=2)


def test_fit_on_one_run_replays_another():
  fit, other = _run(0, 4.0), _run(1, 12.0)
  r = _evaluate(fit, {"eval": other})
  assert {"prfaas_prefill", "pdp_prefill", "s_kv", "prfaas_overhead"} <= set(r["calibrated"])
  ins, oos = r["in_sample"], r["out_of_sample"]["eval"]
  # Each replay is of its own run's workload (another seed and load).
  assert ins["sim"]["requests"] == ins["live"]["requests"] == 24
  assert oos["live"]["offered_rps"] > 2 * ins["live"]["offered_rps"]
  assert oos["sim"]["egress_bytes"] != ins["sim"]["egress_bytes"]
  assert oos["live"]["egress_bytes"] == sum(x["link_bytes"] for x in other["requests"])
  # The service model is right here, so both gaps are small; they are still two numbers.
  for ev in (ins, oos):
    assert abs(ev["gap"]["ttft_p50_s"]["rel"]) < 0.25
  assert r["out_vs_in"]["ttft_p50_s"]["in_sample_rel"] != r["out_vs_in"]["ttft_p50_s"]["eval_rel"]


def test_eval_run_is_never_read_by_the_fit():
  fit, other = _run(0, 4.0), _run(1, 12.0)
  scrambled = copy.deepcopy(other)
  for row in scrambled["requests"]:
    row["prefill_s"] *= 10
    row["ttft_s"] *= 10
  a, b = _evaluate(fit, {"eval": other}), _evaluate(fit, {"eval": scrambled})
  assert a["service"] == b["service"]
  assert a["in_sample"]["gap"] == b["in_sample"]["gap"]
  # ... while the out-of-sample gap sees the scrambled measurements: sim ~ 10x too fast.
  assert a["out_of_sample"]["eval"]["sim"] == b["out_of_sample"]["eval"]["sim"]
  assert b["out_of_sample"]["eval"]["gap"]["ttft_p50_s"]["rel"] < -0.7
  # Control: fitting on the scrambled run does change the profile.
  c = _evaluate(scrambled, {"eval": fit})
  assert c["service"] != a["service"]


def test_a_run_evaluated_on_itself_has_the_in_sample_gap():
  fit = _run(0, 4.0)
  r = _evaluate(fit, {"same": copy.deepcopy(fit)})
  assert r["out_of_sample"]["same"]["gap"] == r["in_sample"]["gap"]
  assert replay.offered_rate({"requests": [{"arrival_s": 0.0}]}) is None
  with pytest.raises(ValueError):
    replay.calibrate_and_evaluate({"requests": []}, {}, REFERENCE)
