"""The discrete-event simulator: hand timelines, exactly-once completion, determinism."""

import dataclasses

import numpy as np
import pytest

from paas_jax.scheduling import case_study as cs
from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile
from paas_jax.scheduling.rebalancer import Rebalancer
from paas_jax.scheduling.router import PrfaasRouter, RouterConfig
from paas_jax.simulation import scenarios as sc
from paas_jax.simulation.calibration import ServiceProfile
from paas_jax.simulation.link import BandwidthTrace
from paas_jax.simulation.metrics import summarize
from paas_jax.simulation.simulator import Deployment, SimConfig, Simulator, simulate
from paas_jax.simulation.workload import SimRequest, generate_requests


def _linear(name, s_per_1k):
  # T(l) = s_per_1k * l / 1000 (no fixed overhead), S_kv(l) = 1e6 * l bytes.
  return PrefillProfile(name=name, lengths=(1000.0, 3000.0), prefill_seconds=(s_per_1k, 3 * s_per_1k),
                        kv_bytes=(1e9, 3e9), interpolation="piecewise_linear")


def _service(link_bps=8e9, bs=4, step=0.01):
  return ServiceProfile(prfaas_prefill=_linear("fast", 1.0), pdp_prefill=_linear("slow", 2.0),
                        decode=DecodeProfile(max_batch_size=bs, step_seconds=step),
                        link=BandwidthTrace.constant(link_bps), rdma_bps=800e9)


def _cfg(dep, t=2500.0, **kw):
  return SimConfig(service=_service(**kw), deployment=dep, router=PrfaasRouter(RouterConfig(threshold_tokens=t)))


def test_offloaded_request_timeline_by_hand():
  # 5000 tokens on PrfaaS: prefill 5 s; 5e9 B over a 1 GB/s link: 5 s; 100 decode steps of
  # 10 ms: 1 s. Arrival at t=1 -> first token at 11, done at 12.
  res = simulate(_cfg(Deployment(1, 0, 1)), [SimRequest(0, 1.0, 5000, 101)])
  (r,) = res.records
  assert r.route == "prfaas"
  assert r.prefill_end_s == pytest.approx(6.0)
  assert r.ttft_s == pytest.approx(10.0)
  assert r.finish_s == pytest.approx(12.0)
  assert r.tpot_s == pytest.approx(0.01)
  assert r.egress_bytes == pytest.approx(5e9)
  assert res.link_bytes_delivered == pytest.approx(5e9)


def test_local_request_timeline_by_hand():
  # 5000 tokens on PD-P: prefill 10 s; 5e9 B over 800 Gb/s RDMA: 0.05 s.
  res = simulate(_cfg(Deployment(0, 1, 1), t=float("inf")), [SimRequest(0, 0.0, 5000, 101)])
  (r,) = res.records
  assert r.route == "pdp" and r.egress_bytes == 0.0
  assert r.ttft_s == pytest.approx(10.05)
  assert res.link_bytes_requested == 0.0


def test_decode_slots_queue_requests():
  # One decode slot: the second request waits for the first to finish decoding (1 s).
  reqs = [SimRequest(0, 0.0, 1000, 101), SimRequest(1, 0.0, 1000, 101)]
  res = simulate(_cfg(Deployment(0, 2, 1), t=float("inf"), bs=1), reqs)
  a, b = res.records
  assert a.decode_start_s == pytest.approx(2.0 + 8e9 / 800e9 * 1.0)
  assert b.decode_start_s == pytest.approx(a.finish_s)
  assert b.finish_s - b.decode_start_s == pytest.approx(1.0)


def test_saturated_prefill_matches_theta():
  # Constant 1 s prefill on 2 instances, ample decode: steady throughput is exactly 2 req/s.
  flat = PrefillProfile(name="flat", lengths=(1000.0, 2000.0), prefill_seconds=(1.0, 1.0),
                        kv_bytes=(1e6, 2e6), interpolation="piecewise_linear")
  svc = dataclasses.replace(_service(bs=1000, step=1e-4), pdp_prefill=flat, prfaas_prefill=flat)
  cfg = SimConfig(service=svc, deployment=Deployment(0, 2, 1),
                  router=PrfaasRouter(RouterConfig(threshold_tokens=float("inf"))))
  reqs = [SimRequest(i, i / 4.0, 1500, 11) for i in range(400)]  # offered 4 req/s
  fin = np.array([r.prefill_end_s for r in simulate(cfg, reqs).records])
  assert np.sum((fin >= 50.0) & (fin < 150.0)) == pytest.approx(200, abs=2)


@pytest.fixture(scope="module")
def case_systems():
  case = cs.build_case_study()
  planned = sc.plan_systems(case, BandwidthTrace.constant(100e9))
  return case, planned


def test_every_request_completes_exactly_once(case_systems):
  case, planned = case_systems
  spec, _ = sc.scenario("gamma_bursty", case, rate=2.5, duration_s=150.0)
  reqs = generate_requests(spec, np.random.default_rng(11))
  assert len(reqs) > 200
  moving = sc.length_shift_systems(case, planned.configs["prfaas_pd"], interval_s=30.0,
                                   min_samples=100)["prfaas_pd_moves"]
  for name in ("prfaas_pd", "homogeneous", "naive", "prfaas_pd_moves"):
    res = simulate(moving if name == "prfaas_pd_moves" else planned.configs[name], reqs)
    assert res.unfinished == 0
    assert [r.request_id for r in res.records] == [r.request_id for r in reqs]
    for r in res.records:
      assert r.arrival_s <= r.prefill_start_s <= r.prefill_end_s <= r.decode_start_s <= r.finish_s
    assert res.link_bytes_delivered == pytest.approx(res.link_bytes_requested, rel=1e-9)
    routes = {r.route for r in res.records}
    assert routes == {"homogeneous": {"pdp"}, "naive": {"prfaas"}}.get(name, {"pdp", "prfaas"})


def test_deterministic_for_a_seed(case_systems):
  case, planned = case_systems
  spec, _ = sc.scenario("zipf_prefix", case, rate=2.0, duration_s=100.0)
  a = simulate(planned.configs["prfaas_pd"], generate_requests(spec, np.random.default_rng(3)))
  b = simulate(planned.configs["prfaas_pd"], generate_requests(spec, np.random.default_rng(3)))
  c = simulate(planned.configs["prfaas_pd"], generate_requests(spec, np.random.default_rng(4)))
  assert a.records == b.records and np.array_equal(a.egress_bytes_per_bin, b.egress_bytes_per_bin)
  assert a.records != c.records


def test_prefix_hotspots_hit_caches_and_cross_clusters(case_systems):
  case, planned = case_systems
  spec, _ = sc.scenario("zipf_prefix", case, rate=2.0, duration_s=200.0)
  reqs = generate_requests(spec, np.random.default_rng(5))
  m = summarize(simulate(planned.configs["prfaas_pd"], reqs))
  assert m["cached_token_fraction"] > 0.05
  assert m["cross_cluster_prefix_transfers"] > 0
  assert summarize(simulate(planned.configs["homogeneous"], reqs))["cross_cluster_prefix_transfers"] == 0


def test_simulator_calls_the_shared_router(case_systems):
  case, planned = case_systems
  seen = []

  @dataclasses.dataclass(frozen=True)
  class Spy(PrfaasRouter):

    def decide(self, request, view):
      seen.append((request.l_total, view.prfaas_instances, view.pdp_instances))
      return super().decide(request, view)

  cfg = planned.configs["prfaas_pd"]
  cfg = dataclasses.replace(cfg, router=Spy(cfg.router.config))
  spec, _ = sc.scenario("poisson", case, rate=2.0, duration_s=60.0)
  reqs = generate_requests(spec, np.random.default_rng(0))
  res = simulate(cfg, reqs)
  assert [s[0] for s in seen] == [r.input_tokens for r in reqs]
  assert all(s[1:] == (4, 3) for s in seen)
  t = cfg.router.threshold_tokens
  assert all((r.route == "pdp") == (r.input_tokens <= t) for r in res.records if r.reason.endswith("base"))


def test_rebalancer_retunes_a_bad_threshold(case_systems):
  case, planned = case_systems
  cfg = planned.configs["prfaas_pd_static"]
  bad = dataclasses.replace(cfg, router=cfg.router.with_threshold(0.0), rebalance_interval_s=100.0,
                            rebalancer=Rebalancer(case.system, case.n_prfaas, case.n_local, min_samples=100))
  spec, _ = sc.scenario("poisson", case, rate=2.5, duration_s=300.0)
  res = simulate(bad, generate_requests(spec, np.random.default_rng(9)))
  (t0, thr0), (t1, thr1) = res.threshold_history[:2]
  assert thr0 == 0.0 and t1 == pytest.approx(100.0)
  assert 15_000 < thr1 < 25_000
  assert res.unfinished == 0


def test_bad_configs_raise():
  with pytest.raises(ValueError):
    Deployment(0, 0, 1)
  with pytest.raises(ValueError):
    Deployment(1, 1, 0)
  with pytest.raises(ValueError):
    Simulator(_cfg(Deployment(1, 1, 1))).run([SimRequest(0, 0.0, 10, 5), SimRequest(0, 1.0, 10, 5)])
