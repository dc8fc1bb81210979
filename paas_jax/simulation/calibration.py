"""``ServiceProfile``: the service-time inputs of the simulator, and the calibration hook.

A ServiceProfile holds what the simulator needs to know about the hardware: prefill
profiles of both clusters, the decode instance, the intra-PD RDMA bandwidth and the
inter-region link trace. It is built either from profiles (the paper's case study) or
from the measurements the live two-region demo writes, via ``from_demo_records``.

Demo JSON schema (one object; unknown keys are ignored)::

  {
    "link_bandwidth_bps": 1.0e11,                  # optional; else the reference trace
    "decode_max_batch_size": 20,                   # optional; else the reference decode
    "requests": [
      {"route": "pdp" | "prfaas",
       "input_tokens": 31000, "cached_tokens": 0, "output_tokens": 1024,
       "ttft_s": 2.3, "tpot_s": 0.021,
       "prefill_s": 1.9,                           # optional: pure prefill compute time
       "prefill_queue_s": 0.1,                     # optional: wait for a prefill slot
       "link_bytes": 812345678}                    # bytes this request put on the link
    ]
  }

The fit itself (cold-request binning, S_kv, decode step, per-route overheads) is
``paas_jax.scheduling.calibration.fit_profiles`` on typed ``FinishedRequest`` records,
shared with the live broker's rebalancer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from paas_jax.scheduling.calibration import FinishedRequest, ProfileSet, fit_profiles
from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile
from paas_jax.simulation.link import BandwidthTrace


@dataclasses.dataclass(frozen=True)
class ServiceProfile:
  """Service-time inputs of the simulator.

  Attributes:
    prfaas_prefill: PrfaaS prefill instance profile.
    pdp_prefill: PD-P prefill instance profile.
    decode: PD-D instance profile.
    link: PrfaaS<->PD link capacity over time (each direction gets this capacity).
    rdma_bps: intra-PD PD-P -> PD-D bandwidth per transfer (bits/s), uncontended.
    pdp_overhead_s: fixed latency a locally prefilled request's state takes to be
      ready for decode beyond its compute (RPC and handoff), seconds.
    prfaas_overhead_s: the same for an offloaded request, beyond its compute and its
      bytes at link speed (transfer round trips, RTT, first-token handoff), seconds.
    calibrated: which fields were fitted from measurements (empty for pure profiles).
  """

  prfaas_prefill: PrefillProfile
  pdp_prefill: PrefillProfile
  decode: DecodeProfile
  link: BandwidthTrace
  rdma_bps: float = 800e9
  pdp_overhead_s: float = 0.0
  prfaas_overhead_s: float = 0.0
  calibrated: tuple[str, ...] = ()

  def __post_init__(self):
    if not (self.rdma_bps > 0 and math.isfinite(self.rdma_bps)):
      raise ValueError(f"rdma_bps must be finite and > 0, got {self.rdma_bps}")
    for name in ("pdp_overhead_s", "prfaas_overhead_s"):
      v = getattr(self, name)
      if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {v}")

  def overhead_s(self, route: str) -> float:
    return self.prfaas_overhead_s if route == "prfaas" else self.pdp_overhead_s

  @classmethod
  def from_demo_json(cls, path: str | os.PathLike, reference: "ServiceProfile", **kwargs) -> "ServiceProfile":
    with open(path) as f:
      return cls.from_demo_records(json.load(f), reference, **kwargs)

  @classmethod
  def from_profiles(cls, profiles: ProfileSet, link: BandwidthTrace, **kwargs) -> "ServiceProfile":
    """A ServiceProfile from fitted (or reference) profiles and a link trace."""
    return cls(prfaas_prefill=profiles.prfaas_prefill, pdp_prefill=profiles.pdp_prefill,
               decode=profiles.decode, link=link, pdp_overhead_s=profiles.pdp_overhead_s,
               prfaas_overhead_s=profiles.prfaas_overhead_s, calibrated=profiles.calibrated,
               **kwargs)

  def profiles(self) -> ProfileSet:
    """The profile part (no link trace, no RDMA bandwidth)."""
    return ProfileSet(prfaas_prefill=self.prfaas_prefill, pdp_prefill=self.pdp_prefill,
                      decode=self.decode, pdp_overhead_s=self.pdp_overhead_s,
                      prfaas_overhead_s=self.prfaas_overhead_s, calibrated=self.calibrated)

  @classmethod
  def from_demo_records(cls, data: Mapping[str, Any], reference: "ServiceProfile",
                        max_points: int = 6, min_requests_per_point: int = 3) -> "ServiceProfile":
    """Fits a ServiceProfile to demo measurements; unmeasured parts come from ``reference``."""
    reqs = data.get("requests")
    if not isinstance(reqs, list) or not reqs:
      raise ValueError("demo data needs a non-empty 'requests' list")
    for i, r in enumerate(reqs):
      if not isinstance(r, Mapping):
        raise ValueError(f"requests[{i}] is not an object")
    bandwidth = float(data["link_bandwidth_bps"]) if "link_bandwidth_bps" in data else None
    fit = fit_profiles([FinishedRequest.from_mapping(r) for r in reqs], reference.profiles(),
                       link_bandwidth_bps=bandwidth,
                       decode_max_batch_size=data.get("decode_max_batch_size"),
                       max_points=max_points, min_requests_per_point=min_requests_per_point)
    link = BandwidthTrace.constant(bandwidth) if bandwidth is not None else reference.link
    return cls.from_profiles(fit, link, rdma_bps=reference.rdma_bps)
