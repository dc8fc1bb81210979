"""The pure parts of experiments/bench_serve.py: the workload and the summary."""

from __future__ import annotations

import numpy as np

from experiments import serve_load as bs


def _workload(**kw):
  args = dict(vocab=512, context=1024, output_len=32, output_dist="fixed", arrival="poisson",
              burst_cv=3.0, mu=9.9, sigma=1.0, seed=3)
  args.update(kw)
  return bs.make_workload(2.0, 200, **args)


def test_workload_is_deterministic_and_bounded():
  a, b = _workload(), _workload()
  assert a == b and a != _workload(seed=4)
  assert all(1 <= len(r.prompt) <= 1024 - 32 and r.output_len == 32 for r in a)
  assert all(16 <= t < 512 for r in a for t in r.prompt)
  arrivals = np.array([r.arrival_s for r in a])
  assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
  # Mean rate ~2/s for both processes; bursty gaps vary far more.
  gaps_p = np.diff(arrivals)
  gaps_b = np.diff([r.arrival_s for r in _workload(arrival="bursty")])
  assert 0.3 < gaps_p.mean() < 0.7 and 0.2 < gaps_b.mean() < 0.9
  assert gaps_b.std() / gaps_b.mean() > 1.5 * gaps_p.std() / gaps_p.mean()
  outs = [r.output_len for r in _workload(output_dist="uniform")]
  assert min(outs) >= 16 and max(outs) <= 32 and len(set(outs)) > 1


def test_summary_goodput_counts_only_requests_within_slo():
  fast = bs.Result(ok=True, prompt_len=10, output_len=11, ttft_s=0.1, e2e_s=0.2,
                   itl_s=[0.01] * 10, route="pdp")
  slow_ttft = bs.Result(ok=True, prompt_len=500, output_len=11, ttft_s=3.0, e2e_s=3.1,
                        itl_s=[0.01] * 10, route="prfaas")
  slow_tpot = bs.Result(ok=True, prompt_len=10, output_len=11, ttft_s=0.1, e2e_s=5.1,
                        itl_s=[0.5] * 10, route="pdp")
  failed = bs.Result(ok=False, prompt_len=10, error="HTTP 503")
  s = bs.summarize([fast, slow_ttft, slow_tpot, failed], 2.0, ttft_slo_s=1.0, tpot_slo_s=0.1)
  assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
  assert s["goodput"] == 0.5 and s["slo_attainment"] == 0.25
  assert s["output_throughput"] == 33 / 2.0
  assert abs(s["tpot_ms"]["p50"] - 10.0) < 1e-9
  assert set(s["per_route"]) == {"pdp", "prfaas"}
  assert s["per_route"]["prfaas"]["ttft_ms"]["p50"] == 3000.0
