"""One rebalancer step of the live broker: fit profiles to its finished requests,
re-solve t and the PD-P / PD-D split.

The broker calls ``rebalance_step`` every ``rebalance_every_s`` with the requests
it has finished (typed ``FinishedRequest`` records) and publishes the returned
proposal (a JSON-able dict) in ``GetStats``; it applies t and the split only when
told to. The fit is ``calibration.fit_profiles``; the parts it cannot measure come
from ``tiny_reference_profiles`` (tiny models on CPU).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from paas_jax.scheduling.calibration import FinishedRequest, ProfileSet, fit_profiles
from paas_jax.scheduling.distributions import EmpiricalLengths
from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile
from paas_jax.scheduling.rebalancer import Rebalancer
from paas_jax.scheduling.throughput import SystemModel


def tiny_reference_profiles(n_slots: int) -> ProfileSet:
  """Placeholder profiles for the fit's unmeasured parts (tiny models on CPU)."""
  prof = PrefillProfile(name="live", lengths=(64.0, 256.0, 1024.0),
                        prefill_seconds=(0.02, 0.06, 0.25), kv_bytes=(6e4, 1.2e5, 3.5e5),
                        gpus_per_instance=1)
  return ProfileSet(prfaas_prefill=prof, pdp_prefill=prof,
                    decode=DecodeProfile(max_batch_size=max(n_slots, 1), step_seconds=0.02))


def rebalance_step(requests: Sequence[FinishedRequest], *, threshold: float, n_slots: int,
                   link_bandwidth_bps: float, min_samples: int = 8, n_pd_nodes: int = 1,
                   current_n_p: int | None = None, n_prfaas: int = 1) -> dict:
  """Fits profiles to finished requests and re-solves t and the P/D split.

  ``requests``: route, input_tokens, cached_tokens, output_tokens, prefill_s,
  link_bytes and optionally tpot_s of each finished request; PD-P and PrfaaS
  prefill times are fitted per route, the decode step from the median TPOT.
  With one PD node (``n_pd_nodes=1``: PD-P and PD-D on the same node) the split
  is pinned and only t is re-solved. With N > 1 the split is free: N_p in
  1..N-1 of ``n_local = N``, evaluated against the deployed ``current_n_p``
  (default N // 2).
  Returns a JSON-able proposal (``{"status": ...}`` when it cannot run yet).
  """
  rows = [r for r in requests if r.route in ("pdp", "prfaas")
          and (r.output_tokens or 0) >= 1 and (r.input_tokens or 0) >= 1]
  if len(rows) < min_samples:
    return {"status": f"waiting: {len(rows)} of {min_samples} finished requests"}
  ref = tiny_reference_profiles(n_slots)
  # A warm request counts as a cold one of its uncached length (its prefill cost
  # is mostly that of the new tokens); its link bytes still cover the whole state,
  # so S_kv is fitted on truly cold PrfaaS requests only.
  fit_rows = [dataclasses.replace(
      r, input_tokens=max(int(r.input_tokens) - int(r.cached_tokens or 0), 1), cached_tokens=0,
      link_bytes=r.link_bytes if not r.cached_tokens else None) for r in rows]
  try:
    prof = fit_profiles(fit_rows, ref, link_bandwidth_bps=link_bandwidth_bps or 1e9,
                        decode_max_batch_size=n_slots, min_requests_per_point=2)
  except ValueError as e:
    return {"status": f"fit failed: {e}"}
  lengths = [float(r.input_tokens) for r in rows]
  out_tokens = float(np.mean([r.output_tokens for r in rows]))
  base = SystemModel(prfaas_profile=prof.prfaas_prefill, pdp_profile=prof.pdp_prefill,
                     decode_profile=prof.decode, lengths=EmpiricalLengths.from_array(lengths),
                     output_tokens=out_tokens,
                     egress_bandwidth_bps=link_bandwidth_bps if link_bandwidth_bps > 0 else 1e9)
  t_now = threshold if math.isfinite(threshold) else max(lengths) + 1
  if n_pd_nodes <= 1:
    # One PD node runs PD-P and PD-D: model it as N_p = 1, N_d = 1 and pin the split.
    reb = Rebalancer(base, n_prfaas=n_prfaas, n_local=2, min_samples=min_samples,
                     threshold_step_tokens=16.0)
    p = reb.propose(t_now, 1, lengths, n_p_choices=(1,))
    note = "split pinned (one PD node does PD-P and PD-D)"
  else:
    n_p_now = n_pd_nodes // 2 if current_n_p is None else current_n_p
    reb = Rebalancer(base, n_prfaas=n_prfaas, n_local=n_pd_nodes, min_samples=min_samples,
                     threshold_step_tokens=16.0)
    p = reb.propose(t_now, n_p_now, lengths, n_p_choices=range(1, n_pd_nodes))
    note = f"split free: N_p in 1..{n_pd_nodes - 1} of {n_pd_nodes} PD nodes (now {n_p_now})"
  measured = any(c.startswith(("prfaas_prefill", "pdp_prefill")) for c in prof.calibrated)
  return {"status": "ok" if measured else "ok(placeholder prefill profiles)",
          "samples": len(rows), "calibrated": list(prof.calibrated),
          "current_threshold": t_now, "proposed_threshold": p.plan.threshold_tokens,
          "current_lambda_max": p.current.lambda_max, "proposed_lambda_max": p.plan.lambda_max,
          "relative_gain": p.relative_gain, "apply": p.apply,
          "proposed_split": {"n_prfaas": p.plan.n_prfaas, "n_p": p.plan.n_p, "n_d": p.plan.n_d},
          "note": note, "n_pd_nodes": n_pd_nodes,
          "decode_step_s": float(prof.decode.step_seconds),
          "prfaas_service_s": float(prof.prfaas_prefill.t_prefill(
              np.mean([l for l in lengths if l > p.plan.threshold_tokens] or lengths))),
          "pdp_service_s": float(prof.pdp_prefill.t_prefill(
              np.mean([l for l in lengths if l <= p.plan.threshold_tokens] or lengths)))}
