"""PrfaaS scheduling: throughput model (paper Eqs. 1-8), routing policy, re-balancing."""

from paas_jax.scheduling.calibration import FinishedRequest, ProfileSet, fit_profiles
from paas_jax.scheduling.distributions import EmpiricalLengths, LengthDistribution, TruncatedLogNormal
from paas_jax.scheduling.live_rebalance import rebalance_step, tiny_reference_profiles
from paas_jax.scheduling.profiles import GBPS, MIB, DecodeProfile, PrefillProfile, fit_time_map
from paas_jax.scheduling.rebalancer import RebalanceProposal, Rebalancer
from paas_jax.scheduling.router import (ClusterView, PrfaasRouter, RequestInfo, RouteRule,
                                        RouterConfig, RoutingDecision, ThresholdAdjustment)
from paas_jax.scheduling.throughput import (DeploymentPlan, SystemModel, ThroughputBreakdown,
                                            default_thresholds, evaluate, select_offload_threshold,
                                            solve_deployment, theta_pdd, ttft_no_queue)

__all__ = [
    "ClusterView", "DecodeProfile", "DeploymentPlan", "EmpiricalLengths", "FinishedRequest", "GBPS",
    "LengthDistribution", "MIB", "PrefillProfile", "PrfaasRouter", "ProfileSet", "RebalanceProposal",
    "Rebalancer", "RequestInfo", "RouteRule", "RouterConfig", "RoutingDecision", "SystemModel",
    "ThresholdAdjustment", "ThroughputBreakdown", "TruncatedLogNormal",
    "default_thresholds", "evaluate", "fit_profiles", "fit_time_map", "rebalance_step",
    "select_offload_threshold", "solve_deployment", "theta_pdd", "tiny_reference_profiles",
    "ttft_no_queue",
]
