"""Discrete-event simulation of PrfaaS-PD serving, driven by the live routing policy."""

from paas_jax.simulation.calibration import ServiceProfile
from paas_jax.simulation.events import EventLoop
from paas_jax.simulation.link import BandwidthTrace, Link
from paas_jax.simulation.metrics import SloSpec, summarize
from paas_jax.simulation.prefix_cache import CacheSpec, PrefixCache, TokenLayout
from paas_jax.simulation.simulator import (Deployment, RequestRecord, RoleMoveRecord, SimConfig, SimResult,
                                           Simulator, simulate)
from paas_jax.simulation.workload import (GammaArrivals, OnOffArrivals, PoissonArrivals, PrefixHotspots,
                                          SimRequest, WorkloadSpec, generate_requests)

__all__ = [
    "BandwidthTrace", "CacheSpec", "Deployment", "EventLoop", "GammaArrivals", "Link", "OnOffArrivals",
    "PoissonArrivals", "PrefixCache", "PrefixHotspots", "RequestRecord", "RoleMoveRecord", "ServiceProfile",
    "SimConfig", "SimRequest", "SimResult", "Simulator", "SloSpec", "TokenLayout", "WorkloadSpec", "generate_requests",
    "simulate", "summarize",
]
