"""Long-timescale re-balancing: re-solve t and the N_p/N_d split from measurements.

The short-timescale router reacts to queues and link load within seconds; this object
runs every few minutes on *measured* inputs (recent request lengths, re-profiled prefill
and decode numbers, the link capacity actually observed) and proposes a new deployment.
It is pure: the caller owns the clock and applies the plan (flip idle instances between
PD-P and PD-D, push the new t to the broker).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from paas_jax.scheduling.distributions import EmpiricalLengths
from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile
from paas_jax.scheduling.throughput import (SystemModel, ThroughputBreakdown, evaluate,
                                            solve_deployment)


@dataclasses.dataclass(frozen=True)
class RebalanceProposal:
  """What the Rebalancer recommends.

  Attributes:
    plan: the re-solved optimum under the new measurements.
    current: the currently deployed (t, N_p, N_d) evaluated under the new measurements.
    apply: True iff the plan beats the current deployment by more than the hysteresis.
    relative_gain: plan.lambda_max / current.lambda_max - 1.
  """

  plan: ThroughputBreakdown
  current: ThroughputBreakdown
  apply: bool
  relative_gain: float


@dataclasses.dataclass(frozen=True)
class Rebalancer:
  """Re-solves Eqs. 1-8 from measured inputs with hysteresis.

  Attributes:
    base: the model the deployment was planned with; measured parts replace its fields.
    n_prfaas: PrfaaS instances (fixed: a different region's budget).
    n_local: local instances to split between PD-P and PD-D.
    min_relative_gain: only propose a change that raises Lambda_max by more than this,
      because moving an instance between roles drains it (lost capacity for a while).
    min_samples: below this many length samples the measured distribution is too noisy.
    threshold_step_tokens: grid step of the t search.
    min_move_gain: ``propose_split`` only: a different N_p/N_d split must beat the best t at
      the current split by more than this (re-tuning t is free, a move drains nodes).
  """

  base: SystemModel
  n_prfaas: int
  n_local: int
  min_relative_gain: float = 0.05
  min_samples: int = 200
  threshold_step_tokens: float = 100.0
  min_move_gain: float = 0.10

  def __post_init__(self):
    if (self.min_relative_gain < 0 or self.min_samples < 1 or self.threshold_step_tokens <= 0
        or self.min_move_gain < 0):
      raise ValueError("min_relative_gain >= 0, min_samples >= 1, threshold_step_tokens > 0, "
                       "min_move_gain >= 0 required")

  def measured_system(self, length_samples: Sequence[float] | np.ndarray, *,
                      prfaas_profile: PrefillProfile | None = None,
                      pdp_profile: PrefillProfile | None = None,
                      decode_profile: DecodeProfile | None = None,
                      egress_bandwidth_bps: float | None = None) -> SystemModel:
    samples = np.asarray(length_samples, dtype=np.float64).ravel()
    if samples.size < self.min_samples:
      raise ValueError(f"need >= {self.min_samples} length samples to rebalance, got {samples.size}")
    b = self.base
    return dataclasses.replace(
        b, lengths=EmpiricalLengths.from_array(samples),
        prfaas_profile=prfaas_profile or b.prfaas_profile,
        pdp_profile=pdp_profile or b.pdp_profile,
        decode_profile=decode_profile or b.decode_profile,
        egress_bandwidth_bps=b.egress_bandwidth_bps if egress_bandwidth_bps is None else egress_bandwidth_bps)

  def propose(self, current_threshold: float, current_n_p: int,
              length_samples: Sequence[float] | np.ndarray, *,
              n_p_choices: Sequence[int] | None = None, **measured) -> RebalanceProposal:
    """Re-solves on measurements.

    Args:
      current_threshold, current_n_p: the deployed operating point.
      length_samples: recent request lengths (tokens).
      n_p_choices: restrict the split (e.g. ``(current_n_p,)`` to re-solve t only).
      **measured: keyword overrides of ``measured_system`` (profiles, bandwidth).
    """
    if not 0 <= current_n_p < self.n_local:
      raise ValueError(f"current_n_p={current_n_p} must lie in [0, n_local={self.n_local})")
    system = self.measured_system(length_samples, **measured)
    # Thresholds on the measured sample grid: t between two adjacent samples all give the
    # same split, so the step only needs to resolve the distribution, not finer.
    lo, hi = system.lengths.lo, system.lengths.hi
    grid = np.unique(np.concatenate([[0.0], np.arange(lo, hi, self.threshold_step_tokens), [hi]]))
    plan = solve_deployment(system, self.n_prfaas, self.n_local, n_p_choices=n_p_choices,
                            thresholds=grid).best
    current = evaluate(system, current_threshold, self.n_prfaas, current_n_p,
                       self.n_local - current_n_p)
    if current.lambda_max > 0:
      gain = plan.lambda_max / current.lambda_max - 1.0
    else:
      gain = float("inf") if plan.lambda_max > 0 else 0.0
    return RebalanceProposal(plan=plan, current=current, apply=gain > self.min_relative_gain,
                             relative_gain=gain)

  def propose_split(self, current_threshold: float, current_n_p: int,
                    length_samples: Sequence[float] | np.ndarray, *,
                    n_p_choices: Sequence[int] | None = None, **measured) -> RebalanceProposal:
    """``propose`` for a deployment that moves nodes between PD-P and PD-D.

    The free optimum over ``n_p_choices`` is returned only if its split equals the current
    one, or if it beats the best t at the current split by more than ``min_move_gain``: the
    move has to pay for its drains by itself, since re-tuning t alone costs nothing.
    Otherwise the result is the t-only proposal at the current split (so ``plan.n_p ==
    current_n_p``). On the heavy-tailed case-study lengths, a few hundred samples make the
    free optimum flip between adjacent splits 6% apart; the extra margin stops those moves.
    """
    free = self.propose(current_threshold, current_n_p, length_samples, n_p_choices=n_p_choices,
                        **measured)
    if free.plan.n_p == current_n_p:
      return free
    stay = self.propose(current_threshold, current_n_p, length_samples,
                        n_p_choices=(current_n_p,), **measured)
    if free.plan.lambda_max > stay.plan.lambda_max * (1.0 + self.min_move_gain):
      return free
    return stay
