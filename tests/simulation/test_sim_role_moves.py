"""PD nodes moving between PD-P and PD-D in the simulator (rebalance_split): when moves
happen, drains, conservation, determinism."""

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

from paas_jax.scheduling import case_study as cs
from paas_jax.scheduling.rebalancer import Rebalancer
from paas_jax.simulation import scenarios as sc
from paas_jax.simulation.link import BandwidthTrace
from paas_jax.simulation.simulator import Deployment, simulate
from paas_jax.simulation.workload import generate_requests

PDP, PDD = "pdp", "pdd"


@pytest.fixture(scope="module")
def case_systems():
  case = cs.build_case_study()
  planned = sc.plan_systems(case, BandwidthTrace.constant(100e9))
  return case, planned


def _shift_trace(case, planned, seed=0, load=0.85, duration_s=400.0):
  spec, _ = sc.scenario("length_shift", case, load * planned.lambda_max["prfaas_pd"], duration_s)
  return spec, generate_requests(spec, np.random.default_rng(seed))


def _systems(case, planned, **kw):
  return sc.length_shift_systems(case, planned.configs["prfaas_pd"], interval_s=30.0, min_samples=100, **kw)


def _check_conservation(res, reqs):
  assert res.unfinished == 0
  assert [r.request_id for r in res.records] == [r.request_id for r in reqs]
  for r in res.records:
    assert r.arrival_s <= r.prefill_start_s <= r.prefill_end_s <= r.decode_start_s <= r.finish_s
    assert (r.prefill_node >= 0) == (r.route == "pdp")
    assert r.decode_node >= 0
  assert res.link_bytes_delivered == pytest.approx(res.link_bytes_requested, rel=1e-9)


def _not_serving(res, node, capability_role, horizon):
  """Intervals in which ``node`` takes no new work of ``capability_role``'s kind: from the
  start of a move away from that role until the end of a later move back to it."""
  out, since = [], None
  for mv in sorted((m for m in res.role_moves if m.node == node), key=lambda m: m.start_s):
    if mv.from_role == capability_role and mv.to_role != capability_role and since is None:
      since = mv.start_s
    elif mv.to_role == capability_role and since is not None:
      out.append((since, mv.end_s if math.isfinite(mv.end_s) else horizon))
      since = None
  if since is not None:
    out.append((since, horizon))
  return out


def _check_drains(res):
  horizon = max(r.finish_s for r in res.records) + 1.0
  nodes = {m.node for m in res.role_moves}
  for node in nodes:
    for lo, hi in _not_serving(res, node, PDP, horizon):
      starts = [r.prefill_start_s for r in res.records if r.prefill_node == node and lo <= r.prefill_start_s < hi]
      assert not starts, f"node {node} started a prefill while leaving PD-P ({lo:.2f}..{hi:.2f})"
    for lo, hi in _not_serving(res, node, PDD, horizon):
      adm = [r.decode_start_s for r in res.records if r.decode_node == node and lo <= r.decode_start_s < hi]
      assert not adm, f"node {node} admitted a decode while leaving PD-D ({lo:.2f}..{hi:.2f})"
  for mv in res.role_moves:
    assert math.isfinite(mv.end_s) and mv.drain_s == pytest.approx(mv.end_s - mv.start_s) and mv.drain_s >= 0
    if mv.from_role == PDP:
      # Completes exactly when the prefill it was running at the start ends (or at once).
      running = [r.prefill_end_s for r in res.records
                 if r.prefill_node == mv.node and r.prefill_start_s < mv.start_s < r.prefill_end_s]
      assert mv.end_s == pytest.approx(max(running, default=mv.start_s))
    else:
      # Completes when the last member of its batch at the start finishes.
      members = [r.finish_s for r in res.records
                 if r.decode_node == mv.node and r.decode_start_s <= mv.start_s < r.finish_s]
      assert mv.end_s == pytest.approx(max(members, default=mv.start_s))


def test_length_shift_changes_the_optimal_split(case_systems):
  # The scenario's premise, from the throughput model itself.
  case, _ = case_systems
  after, ratio = sc.length_shift_after(case)
  from paas_jax.scheduling.throughput import solve_deployment
  choices = tuple(range(1, case.n_local))
  before_np = solve_deployment(case.system, case.n_prfaas, case.n_local, n_p_choices=choices).best.n_p
  after_np = solve_deployment(dataclasses.replace(case.system, lengths=after), case.n_prfaas, case.n_local,
                              n_p_choices=choices).best.n_p
  assert (before_np, after_np) == (3, 1)
  assert ratio > 1.3


def test_moves_follow_the_length_shift(case_systems):
  case, planned = case_systems
  spec, reqs = _shift_trace(case, planned)
  res = simulate(_systems(case, planned)["prfaas_pd_moves"], reqs)
  _check_conservation(res, reqs)
  assert res.role_moves
  # Every move is PD-P -> PD-D (fewer prefill nodes for short prompts), after the shift.
  assert all((m.from_role, m.to_role) == (PDP, PDD) for m in res.role_moves)
  assert all(m.start_s >= spec.shift_at_s for m in res.role_moves)
  assert res.split_history[0] == (0.0, 3, 5) and res.split_history[-1][1:] == (1, 7)
  # Moves only ever start on a rebalance tick.
  assert all(m.start_s / 30.0 == pytest.approx(round(m.start_s / 30.0)) for m in res.role_moves)
  _check_drains(res)


def test_no_moves_without_a_shift(case_systems):
  # Same moving system on the planned length distribution: the split is already optimal.
  case, planned = case_systems
  cfg = _systems(case, planned)["prfaas_pd_moves"]
  spec, _ = sc.scenario("poisson", case, 0.85 * planned.lambda_max["prfaas_pd"], 400.0)
  reqs = generate_requests(spec, np.random.default_rng(1))
  res = simulate(cfg, reqs)
  _check_conservation(res, reqs)
  assert res.role_moves == () and res.split_history == ((0.0, 3, 5),)
  assert len(res.threshold_history) >= 1


def test_hysteresis_blocks_small_gains(case_systems):
  # The move 3/5 -> 1/7 gains ~40% over the best t at 3/5; with a 60% margin required for a
  # move, only t is re-tuned.
  case, planned = case_systems
  _, reqs = _shift_trace(case, planned)
  cfg = _systems(case, planned)["prfaas_pd_moves"]
  cfg = dataclasses.replace(cfg, rebalancer=dataclasses.replace(cfg.rebalancer, min_move_gain=0.6))
  res = simulate(cfg, reqs)
  assert res.role_moves == () and res.split_history == ((0.0, 3, 5),)
  assert len(res.threshold_history) > 1
  _check_conservation(res, reqs)


def test_propose_split_needs_the_move_to_pay_for_itself(case_systems):
  case, _ = case_systems
  samples = case.system.lengths.sample(np.random.default_rng(0), 2000)
  short = dataclasses.replace(case.system.lengths, mu=sc.LENGTH_SHIFT_MU_AFTER).sample(np.random.default_rng(0), 2000)
  rb = Rebalancer(case.system, case.n_prfaas, case.n_local)
  choices = tuple(range(1, case.n_local))
  # Planned split on planned lengths: nothing to move, and a bad t alone is re-tuned in place.
  prop = rb.propose_split(0.0, 3, samples, n_p_choices=choices)
  assert prop.apply and prop.plan.n_p == 3
  # Short prompts: the move is worth it unless the margin is prohibitive.
  assert rb.propose_split(19_100.0, 3, short, n_p_choices=choices).plan.n_p == 1
  stay = dataclasses.replace(rb, min_move_gain=1.0).propose_split(19_100.0, 3, short, n_p_choices=choices)
  assert stay.plan.n_p == 3 and stay.apply  # t still moves
  # From 4/4 on planned lengths the free optimum (3/5) is ~6% better: below the 10% margin.
  assert rb.propose(19_100.0, 4, samples, n_p_choices=choices).plan.n_p == 3
  assert rb.propose_split(19_100.0, 4, samples, n_p_choices=choices).plan.n_p == 4


def test_split_off_keeps_todays_behaviour(case_systems):
  case, planned = case_systems
  _, reqs = _shift_trace(case, planned)
  systems = _systems(case, planned)
  res = simulate(systems["prfaas_pd_threshold_only"], reqs)
  assert res.role_moves == () and res.split_history == ((0.0, 3, 5),)
  assert len(res.threshold_history) > 1  # t still re-tuned
  assert all(r.prefill_node in (-1, 5, 6, 7) and r.decode_node in range(5) for r in res.records)
  # Without a rebalancer, the new option changes nothing at all.
  plain = planned.configs["prfaas_pd"]
  assert simulate(plain, reqs).records == simulate(systems["prfaas_pd_pinned"], reqs).records


def test_decode_drains_when_pd_d_moves_to_pd_p(case_systems):
  # Deployed 1/7 on the paper's (long) lengths: the optimum is 3/5, so two PD-D nodes drain
  # their batches before they prefill.
  case, planned = case_systems
  base = planned.configs["prfaas_pd"]
  cfg = dataclasses.replace(base, deployment=Deployment(4, 1, 7), rebalance_split=True,
                            rebalance_interval_s=30.0,
                            rebalancer=Rebalancer(case.system, case.n_prfaas, case.n_local, min_samples=100))
  spec, _ = sc.scenario("poisson", case, 2.6, 300.0)
  reqs = generate_requests(spec, np.random.default_rng(2))
  res = simulate(cfg, reqs)
  _check_conservation(res, reqs)
  assert res.role_moves and all((m.from_role, m.to_role) == (PDD, PDP) for m in res.role_moves)
  assert max(m.drain_s for m in res.role_moves) > 1.0  # a non-empty batch had to finish
  assert res.split_history[-1][1] == 3
  _check_drains(res)
  # After its move a node prefills and never decodes again.
  for m in res.role_moves:
    assert any(r.prefill_node == m.node and r.prefill_start_s >= m.end_s for r in res.records)


def test_moves_are_deterministic(case_systems):
  case, planned = case_systems
  cfg = _systems(case, planned)["prfaas_pd_moves"]
  _, a_reqs = _shift_trace(case, planned, seed=5)
  a, b = simulate(cfg, a_reqs), simulate(cfg, _shift_trace(case, planned, seed=5)[1])
  c = simulate(cfg, _shift_trace(case, planned, seed=6)[1])
  assert a.records == b.records and a.role_moves == b.role_moves and a.split_history == b.split_history
  assert a.role_moves
  assert a.records != c.records


def test_bad_split_configs_raise(case_systems):
  case, planned = case_systems
  base = planned.configs["prfaas_pd"]
  with pytest.raises(ValueError):
    dataclasses.replace(base, rebalance_split=True)  # no rebalancer
  with pytest.raises(ValueError):
    dataclasses.replace(base, rebalance_split=True,
                        rebalancer=Rebalancer(case.system, case.n_prfaas, case.n_local + 1))


def test_shifted_workload_lengths(case_systems):
  case, planned = case_systems
  spec, reqs = _shift_trace(case, planned, duration_s=600.0)
  before = np.array([r.input_tokens for r in reqs if r.arrival_s < spec.shift_at_s])
  after = np.array([r.input_tokens for r in reqs if r.arrival_s >= spec.shift_at_s])
  assert np.mean(before) == pytest.approx(case.system.lengths.mean(), rel=0.15)
  assert np.mean(after) == pytest.approx(spec.lengths_after.mean(), rel=0.15)
  # The rate after the shift is scaled by the ratio of the two phases' Lambda_max.
  _, ratio = sc.length_shift_after(case)
  assert after.size / before.size == pytest.approx(ratio, rel=0.15)


def test_simulator_imports_no_serving_dependencies():
  code = ("import sys, paas_jax.simulation.simulator, paas_jax.simulation.scenarios; "
          "bad = [m for m in sys.modules if m.split('.')[0] in ('grpc', 'jax')]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
