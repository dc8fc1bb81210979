"""Scenario and system builders shared by ``experiments/simulate_scenarios.py``,
``experiments/reproduce_case_study.py`` and the tests.

The three systems of Table 6 are planned with the throughput model (``solve_deployment``)
on the case-study inputs, then simulated on identical request traces:

- ``prfaas_pd``: 4 PrfaaS (H200) + the solved N_p/N_d H20 split, router at the solved t;
- ``homogeneous``: the solved N_p/N_d split of 12 H20 instances, no PrfaaS;
- ``naive``: 4 PrfaaS + all 8 H20 instances decoding; everything is offloaded.
- ``prfaas_pd_static``: ablation of ``prfaas_pd`` with the short-timescale threshold
  adjustments switched off (raise/lower factors 1): t and the split only.

The ``length_shift`` scenario compares ``prfaas_pd`` with the long-timescale
rebalancer in three modes (``LENGTH_SHIFT_SYSTEMS``, built by ``length_shift_systems``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from paas_jax.scheduling.case_study import CaseStudy
from paas_jax.scheduling.rebalancer import Rebalancer
from paas_jax.scheduling.profiles import DecodeProfile
from paas_jax.scheduling.router import PrfaasRouter, RouterConfig
from paas_jax.scheduling.throughput import solve_deployment
from paas_jax.simulation.calibration import ServiceProfile
from paas_jax.simulation.link import BandwidthTrace
from paas_jax.simulation.prefix_cache import CacheSpec
from paas_jax.simulation.simulator import Deployment, SimConfig
from paas_jax.simulation.workload import (GammaArrivals, OnOffArrivals, PoissonArrivals,
                                          PrefixHotspots, WorkloadSpec)

SYSTEMS = ("prfaas_pd", "prfaas_pd_static", "homogeneous", "naive")
SCENARIOS = ("poisson", "gamma_bursty", "on_off", "link_drop", "link_drop_thin", "zipf_prefix")
# Scenarios that compare rebalancer modes on their own systems (see ``length_shift_systems``).
REBALANCE_SCENARIOS = ("length_shift",)
ALL_SCENARIOS = SCENARIOS + REBALANCE_SCENARIOS
# length_shift: mu of the truncated log-normal after the shift (before: the paper's 9.90).
# The case-study optimum then moves from N_p/N_d = 3/5 to 1/7 (solve_deployment).
LENGTH_SHIFT_MU_AFTER = 8.5
LENGTH_SHIFT_SYSTEMS = ("prfaas_pd_moves", "prfaas_pd_threshold_only", "prfaas_pd_pinned")


@dataclasses.dataclass(frozen=True)
class PlannedSystems:
  """The three deployments planned by the throughput model, with their Lambda_max (req/s)."""

  configs: dict  # system name -> SimConfig
  lambda_max: dict  # system name -> float
  thresholds: dict  # system name -> float tokens


def decode_for_simulation(case: CaseStudy, context_fraction: float) -> DecodeProfile:
  """The case-study decode instance, with a context-dependent step time for the simulator.

  ``reference_context_tokens`` is the mean context over a request's decode (E[L] + L_out/2),
  so a full batch of average requests steps in exactly T_decode, as Eq. 7 assumes.
  """
  sysm = case.system
  ref_ctx = float(sysm.lengths.mean()) + 0.5 * sysm.output_tokens
  return dataclasses.replace(sysm.decode_profile, context_fraction=context_fraction,
                             reference_context_tokens=ref_ctx)


def plan_systems(case: CaseStudy, link: BandwidthTrace, *, context_fraction: float = 0.3,
                 cache: CacheSpec = CacheSpec(), router_kwargs: dict | None = None,
                 utilization_window_s: float = 5.0) -> PlannedSystems:
  """Solves the three deployments and wraps each in a ``SimConfig``."""
  sysm = case.system
  service = ServiceProfile(prfaas_prefill=sysm.prfaas_profile, pdp_prefill=sysm.pdp_profile,
                           decode=decode_for_simulation(case, context_fraction), link=link)
  prfaas_pd = solve_deployment(sysm, case.n_prfaas, case.n_local).best
  plans = {
      "prfaas_pd": prfaas_pd,
      "prfaas_pd_static": prfaas_pd,
      "homogeneous": solve_deployment(sysm, 0, case.n_homogeneous).best,
      "naive": solve_deployment(sysm, case.n_prfaas, case.n_local, n_p_choices=(0,)).best,
  }
  configs, thresholds = {}, {}
  for name, plan in plans.items():
    t = {"homogeneous": math.inf, "naive": 0.0}.get(name, plan.threshold_tokens)
    # Mean prefill time per routed request, for the router's queue-wait estimates.
    rk = dict(prfaas_service_s=_finite_or(plan.theta_prfaas_compute, plan.n_prfaas),
              pdp_service_s=_finite_or(plan.theta_pdp, plan.n_p))
    rk.update(router_kwargs or {})
    if name == "prfaas_pd_static":
      rk.update(raise_factor=1.0, lower_factor=1.0)
    router = PrfaasRouter(RouterConfig(threshold_tokens=t, **rk))
    dep = Deployment(n_prfaas=plan.n_prfaas, n_pdp=plan.n_p, n_decode=plan.n_d)
    configs[name] = SimConfig(service=service, deployment=dep, router=router, cache=cache,
                              utilization_window_s=utilization_window_s)
    thresholds[name] = t
  return PlannedSystems(configs=configs, lambda_max={k: v.lambda_max for k, v in plans.items()},
                        thresholds=thresholds)


def scenario(name: str, case: CaseStudy, rate: float, duration_s: float, *,
             link_gbps: float = 100.0) -> tuple[WorkloadSpec, BandwidthTrace]:
  """The workload and link trace of a named scenario at mean arrival ``rate`` (req/s).

  - poisson:      Poisson arrivals (the steady-state reference).
  - gamma_bursty: renewal arrivals with Gamma inter-arrivals, CV = 3 (clustered bursts).
  - on_off:       60 s at 1.6x rate, then 60 s at 0.4x rate (same mean), repeating.
  - link_drop:    Poisson; the link falls to 25% for 60 s starting at 40% of the run.
  - link_drop_thin: as link_drop on a link a quarter as wide (``link_gbps / 4``), so the
                  dip (to 1/16 of the nominal link) falls below the mean KV egress.
  - zipf_prefix:  Poisson; 70% of requests start with one of 32 shared prefixes
                  (4K-32K tokens) drawn by Zipf(1.2), so prefix caches matter.
  - length_shift: Poisson; at half time the input lengths shift from the paper's
                  mu = 9.90 to ``LENGTH_SHIFT_MU_AFTER`` (much shorter prompts) and the rate
                  scales by Lambda_max(after) / Lambda_max(before), both with a free split
                  N_p in 1..n_local-1: the same fraction of what the best deployment of each
                  phase carries. The best split changes (3/5 -> 1/7), so only a deployment
                  that moves PD nodes keeps up.
  """
  if name not in ALL_SCENARIOS:
    raise ValueError(f"unknown scenario {name!r}; choose from {ALL_SCENARIOS}")
  if rate <= 0 or duration_s <= 0:
    raise ValueError("rate and duration_s must be > 0")
  bps = link_gbps * 1e9
  link = BandwidthTrace.constant(bps)
  hotspots = None
  arrivals = PoissonArrivals(rate)
  if name == "gamma_bursty":
    arrivals = GammaArrivals(rate, cv=3.0)
  elif name == "on_off":
    arrivals = OnOffArrivals(rate_on=1.6 * rate, rate_off=0.4 * rate, on_s=60.0, off_s=60.0)
  elif name in ("link_drop", "link_drop_thin"):
    base = bps if name == "link_drop" else bps / 4
    link = BandwidthTrace.with_drop(base, start_s=0.4 * duration_s, duration_s=60.0, factor=0.25)
  elif name == "zipf_prefix":
    hotspots = PrefixHotspots(num_prefixes=32, zipf_s=1.2, share_prob=0.7, min_tokens=4096,
                              max_tokens=32768)
  sysm = case.system
  lengths_after, shift_at_s = None, math.inf
  if name == "length_shift":
    lengths_after, ratio = length_shift_after(case)
    shift_at_s = 0.5 * duration_s
    # Two phases: rate for [0, shift), rate * ratio after (off_s outlasts the run).
    arrivals = OnOffArrivals(rate_on=rate, rate_off=rate * ratio, on_s=shift_at_s, off_s=duration_s)
  spec = WorkloadSpec(arrivals=arrivals, lengths=sysm.lengths, output_tokens=int(sysm.output_tokens),
                      duration_s=duration_s, hotspots=hotspots, lengths_after=lengths_after,
                      shift_at_s=shift_at_s)
  return spec, link


def length_shift_after(case: CaseStudy, mu_after: float = LENGTH_SHIFT_MU_AFTER):
  """(lengths after the shift, Lambda_max(after) / Lambda_max(before)), N_p in 1..n_local-1."""
  sysm = case.system
  after = dataclasses.replace(sysm.lengths, mu=mu_after)
  choices = tuple(range(1, case.n_local))
  lam = [solve_deployment(dataclasses.replace(sysm, lengths=l), case.n_prfaas, case.n_local,
                          n_p_choices=choices).best.lambda_max for l in (sysm.lengths, after)]
  return after, lam[1] / lam[0]


def length_shift_systems(case: CaseStudy, prfaas_pd: SimConfig, *, interval_s: float = 60.0,
                         min_samples: int = 200) -> dict:
  """PrfaaS-PD (planned at mu = 9.90) with the long-timescale rebalancer in three modes.

  - ``prfaas_pd_moves``: re-solves t and N_p (1..n_local-1) and moves PD nodes with drains;
  - ``prfaas_pd_threshold_only``: re-solves t with the split pinned (the old behaviour);
  - ``prfaas_pd_pinned``: no rebalancer (t and split as planned).
  Both rebalanced systems also push the plan's per-request prefill times into the router.
  """
  rb = Rebalancer(case.system, case.n_prfaas, case.n_local, min_samples=min_samples)
  kw = dict(rebalancer=rb, rebalance_interval_s=interval_s, rebalance_service_times=True)
  return {
      "prfaas_pd_moves": dataclasses.replace(prfaas_pd, rebalance_split=True, **kw),
      "prfaas_pd_threshold_only": dataclasses.replace(prfaas_pd, **kw),
      "prfaas_pd_pinned": prfaas_pd,
  }


def _finite_or(theta: float, n: int) -> float:
  """n / theta = T_prefill(l_class), or 1 s when the cluster gets no traffic in the plan."""
  return n / theta if theta > 0 and math.isfinite(theta) and n > 0 else 1.0


def with_link(cfg: SimConfig, link: BandwidthTrace) -> SimConfig:
  return dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, link=link))


def egress_gbps_series(bin_s: float, bytes_per_bin: np.ndarray) -> np.ndarray:
  return 8.0 * np.asarray(bytes_per_bin) / bin_s / 1e9
