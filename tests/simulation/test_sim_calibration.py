"""ServiceProfile calibration from demo measurements."""

import dataclasses
import json

import numpy as np
import pytest

from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile
from paas_jax.scheduling.router import PrfaasRouter, RouterConfig
from paas_jax.simulation.calibration import ServiceProfile
from paas_jax.simulation.link import BandwidthTrace
from paas_jax.simulation.simulator import Deployment, SimConfig, simulate
from paas_jax.simulation.workload import SimRequest

LS = (1000.0, 8000.0, 32000.0, 128000.0)


def _reference():
  prof = PrefillProfile(name="ref", lengths=LS, prefill_seconds=(0.4, 0.7, 1.8, 7.4),
                        kv_bytes=tuple(2e8 + 1.7e4 * l for l in LS))
  return ServiceProfile(prfaas_prefill=prof, pdp_prefill=prof.with_time_map("slow", 3.0),
                        decode=DecodeProfile(max_batch_size=20, step_seconds=0.025),
                        link=BandwidthTrace.constant(100e9))


def _demo_records():
  """What a demo on 'true' hardware would log: PrfaaS 2x the reference, PD-P 5x, bigger KV."""
  true_rf = lambda l: 2.0 * (0.3 + 4e-5 * l + 1e-10 * l * l)
  true_pd = lambda l: 5.0 * (0.3 + 4e-5 * l + 1e-10 * l * l)
  rows = []
  for i, l in enumerate(np.geomspace(2000, 100_000, 60)):
    l = int(l)
    route = "prfaas" if i % 2 else "pdp"
    t = true_rf(l) if route == "prfaas" else true_pd(l)
    rows.append({"route": route, "input_tokens": l, "cached_tokens": 0, "output_tokens": 64,
                 "prefill_s": t, "ttft_s": t + 0.1, "tpot_s": 0.02 + 0.001 * (i % 3),
                 "link_bytes": (3e8 + 2e4 * l) if route == "prfaas" else None})
  rows.append({"route": "pdp", "input_tokens": 5000, "cached_tokens": 4000, "output_tokens": 64,
               "prefill_s": 99.0})  # warm request: must not bend the cold-prefill fit
  return {"link_bandwidth_bps": 40e9, "decode_max_batch_size": 16, "requests": rows}, true_rf, true_pd


def test_fit_recovers_measured_service_times(tmp_path):
  data, true_rf, true_pd = _demo_records()
  path = tmp_path / "demo.json"
  path.write_text(json.dumps(data))
  svc = ServiceProfile.from_demo_json(path, _reference())
  assert set(svc.calibrated) >= {"s_kv", "prfaas_prefill", "pdp_prefill", "decode_step_seconds",
                                 "decode_max_batch_size", "link"}
  for l in (5_000.0, 20_000.0, 60_000.0):
    assert float(svc.prfaas_prefill.t_prefill(l)) == pytest.approx(true_rf(l), rel=0.04)
    assert float(svc.pdp_prefill.t_prefill(l)) == pytest.approx(true_pd(l), rel=0.04)
  assert svc.prfaas_prefill.kv_slope_bytes_per_token == pytest.approx(2e4, rel=1e-9)
  assert svc.pdp_prefill.kv_fixed_bytes == pytest.approx(3e8, rel=1e-6)
  assert svc.decode.step_seconds == pytest.approx(0.021)
  assert svc.decode.max_batch_size == 16
  assert svc.link.at(0.0) == 40e9
  # The calibrated profile drives the simulator directly.
  cfg = SimConfig(service=svc, deployment=Deployment(1, 1, 1),
                  router=PrfaasRouter(RouterConfig(threshold_tokens=10_000)))
  res = simulate(cfg, [SimRequest(0, 0.0, 50_000, 32), SimRequest(1, 0.0, 3_000, 32)])
  assert res.records[0].route == "prfaas" and res.records[1].route == "pdp"
  assert res.records[0].prefill_end_s == pytest.approx(float(svc.prfaas_prefill.t_prefill(50_000)), rel=0.05)


def test_ttft_fallback_is_recorded_and_missing_routes_keep_reference():
  data, _, _ = _demo_records()
  only_pd = [dict(r, prefill_s=None) for r in data["requests"]
             if r["route"] == "pdp" and r["cached_tokens"] == 0]
  svc = ServiceProfile.from_demo_records({"requests": only_pd}, _reference())
  assert "pdp_prefill(from ttft_s)" in svc.calibrated
  assert "prfaas_prefill" not in svc.calibrated and "s_kv" not in svc.calibrated
  assert svc.prfaas_prefill == _reference().prfaas_prefill


@pytest.mark.parametrize("bad", [
    {},
    {"requests": []},
    {"requests": [{"route": "elsewhere", "input_tokens": 10, "output_tokens": 2, "ttft_s": 1.0}]},
    {"requests": [{"route": "pdp", "input_tokens": 10, "output_tokens": 2}]},
    {"requests": [{"route": "pdp", "input_tokens": 10, "output_tokens": 2, "ttft_s": -1.0}]},
    {"requests": [{"route": "pdp", "input_tokens": 10, "cached_tokens": 11, "output_tokens": 2, "ttft_s": 1.0}]},
])
def test_bad_demo_data_raises(bad):
  with pytest.raises(ValueError):
    ServiceProfile.from_demo_records(bad, _reference())


def test_fixed_overheads_are_fitted_and_delay_ttft_by_exactly_that():
  """TTFT = prefill wait + compute + bytes at link speed + a fixed per-route overhead."""
  bw = 8e6  # 1 MB/s, so the wire time is a visible part of TTFT
  rows = []
  for i in range(9):
    l = 200 + 50 * i
    nbytes = 20_000 + 256 * l
    queue, compute = 0.01 * (i % 3), 0.05 + 1e-4 * l
    rows.append({"route": "prfaas", "input_tokens": l, "output_tokens": 8, "prefill_s": compute,
                 "prefill_queue_s": queue, "link_bytes": nbytes,
                 "ttft_s": queue + compute + 8 * nbytes / bw + 0.145})
    rows.append({"route": "pdp", "input_tokens": l // 2, "output_tokens": 8, "prefill_s": compute,
                 "prefill_queue_s": queue, "ttft_s": queue + compute + 0.073})
  svc = ServiceProfile.from_demo_records({"link_bandwidth_bps": bw, "requests": rows},
                                         _reference())
  assert {"pdp_overhead", "prfaas_overhead"} <= set(svc.calibrated)
  assert svc.prfaas_overhead_s == pytest.approx(0.145, abs=1e-9)
  assert svc.pdp_overhead_s == pytest.approx(0.073, abs=1e-9)
  # Without the link bandwidth the PrfaaS overhead cannot be separated from the wire.
  no_bw = ServiceProfile.from_demo_records({"requests": rows}, _reference())
  assert "prfaas_overhead" not in no_bw.calibrated and no_bw.prfaas_overhead_s == 0.0

  def ttfts(service):
    cfg = SimConfig(service=service, deployment=Deployment(1, 1, 1),
                    router=PrfaasRouter(RouterConfig(threshold_tokens=300)))
    res = simulate(cfg, [SimRequest(0, 0.0, 500, 8), SimRequest(1, 100.0, 100, 8)])
    return {r.route: r.ttft_s for r in res.records}

  bare = ttfts(dataclasses.replace(svc, pdp_overhead_s=0.0, prfaas_overhead_s=0.0))
  fitted = ttfts(svc)
  assert fitted["prfaas"] - bare["prfaas"] == pytest.approx(0.145, abs=1e-9)
  assert fitted["pdp"] - bare["pdp"] == pytest.approx(0.073, abs=1e-9)
  with pytest.raises(ValueError, match="pdp_overhead_s"):
    dataclasses.replace(svc, pdp_overhead_s=-1.0)
