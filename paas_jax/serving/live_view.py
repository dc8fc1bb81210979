"""What the broker's adaptive router sees: a live ``ClusterView`` plus prefix probes.

``LiveClusterState`` keeps, without ever blocking a request:

* **queue depths** from the servers' ``GetStats`` (prefill ``queue``, decode
  ``pdp_queue``), polled by a background thread every ``poll_s`` (200 ms) with a
  deadline per call; a server that does not answer keeps its last value and is
  counted in ``poll_errors``;
* **link utilization** over the trailing ``window_s`` from the broker's own
  record of recent transfers (``TransferDone``: bytes on the link, Begin to
  Commit time), each transfer's bytes spread evenly over its duration;
* **link backlog**: bytes of transfers that have started (prefill running or
  state streaming) and not finished, each estimated from the prompt length
  with the bytes/token of past transfers (``c + k*l`` once two lengths were
  seen). It over-counts a transfer that is half sent.

``view()`` returns the latest snapshot as a ``ClusterView``; ``probe_prefix``
asks both regions for the cached prefix of a prompt (``StatsRequest.
prefix_probe_ids``) in parallel with a short deadline (0 on timeout).

The long timescale: every ``rebalance_every_s`` the state fits prefill
profiles to the broker's measured requests (``ServiceProfile.from_demo_records``
over per-request prefill time and link bytes) and runs a ``Rebalancer`` step.
The deployment has one PD node, which does both PD-P and PD-D, so the split
cannot move: the step re-solves t with the split pinned and only *reports*
the proposal (``last_proposal``); applying t is opt-in (``apply_threshold``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from paas_jax.proto import serving_pb2

log = logging.getLogger("paas_jax.serving.live_view")


@dataclasses.dataclass
class _Transfer:
  start: float
  end: float
  nbytes: float


class LiveClusterState:
  """Live inputs of ``PrfaasRouter``; see the module docstring."""

  def __init__(self, prefill_stubs: Sequence, decode_stubs: Sequence, *,
               link_bandwidth_bps: float, poll_s: float = 0.2, rpc_deadline_s: float = 0.5,
               window_s: float = 2.0, probe_deadline_s: float = 0.25,
               clock: Callable[[], float] = time.monotonic):
    self.prefill_stubs = list(prefill_stubs)
    self.decode_stubs = list(decode_stubs)
    self.link_bandwidth_bps = float(link_bandwidth_bps)
    self.poll_s, self.rpc_deadline_s = poll_s, rpc_deadline_s
    self.window_s, self.probe_deadline_s = window_s, probe_deadline_s
    self.clock = clock
    self._lock = threading.Lock()
    self._transfers: collections.deque[_Transfer] = collections.deque(maxlen=4096)
    self._inflight: dict[str, float] = {}  # request id -> estimated bytes
    self._size_samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=256)
    self.prfaas_queue = [0] * len(self.prefill_stubs)
    self.pdp_queue = [0] * len(self.decode_stubs)
    self.poll_errors = 0
    self.polls = 0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._periodic: list[tuple[float, Callable[[], None], list]] = []
    self.ingress_bytes = 0.0  # B->A link bytes (cross-cluster prefixes)
    # () -> (PD-P, PD-D) instances serving now (the broker's PD roles); None:
    # every PD node counts as PD-P (one colocated node).
    self.instance_counts: Callable[[], tuple[int, int]] | None = None

  # -- lifecycle ------------------------------------------------------------------

  def start(self) -> "LiveClusterState":
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="live-view", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=2)

  def every(self, period_s: float, fn: Callable[[], None]) -> None:
    """Runs ``fn`` on the poll thread about every ``period_s`` (errors are logged)."""
    self._periodic.append((period_s, fn, [self.clock()]))

  def _loop(self) -> None:
    while not self._stop.wait(self.poll_s):
      self.poll_once()
      for period, fn, last in self._periodic:
        if self.clock() - last[0] >= period:
          last[0] = self.clock()
          try:
            fn()
          except Exception:  # pylint: disable=broad-except
            log.exception("periodic task failed")

  def poll_once(self) -> None:
    """One round of GetStats to every server, in parallel, each with a deadline."""
    calls = [("prefill", i, s.GetStats.future(serving_pb2.StatsRequest(),
                                              timeout=self.rpc_deadline_s))
             for i, s in enumerate(self.prefill_stubs)]
    calls += [("decode", i, s.GetStats.future(serving_pb2.StatsRequest(),
                                              timeout=self.rpc_deadline_s))
              for i, s in enumerate(self.decode_stubs)]
    for kind, i, fut in calls:
      try:
        g = fut.result().gauges
      except grpc.RpcError:
        self.poll_errors += 1
        continue
      if kind == "prefill":
        self.prfaas_queue[i] = int(g.get("queue", 0))
      else:
        self.pdp_queue[i] = int(g.get("pdp_queue", 0))
    self.polls += 1

  # -- link accounting ---------------------------------------------------------------

  def estimate_bytes(self, prompt_tokens: int) -> float:
    with self._lock:
      samples = list(self._size_samples)
    if not samples:
      return 0.0
    ls = np.array([s[0] for s in samples], np.float64)
    bs = np.array([s[1] for s in samples], np.float64)
    if np.ptp(ls) > 0:
      k, c = np.polyfit(ls, bs, 1)
      if k >= 0 and c >= 0:
        return float(c + k * prompt_tokens)
    return float(np.median(bs / ls) * prompt_tokens)

  def transfer_started(self, request_id: str, prompt_tokens: int,
                       direction: str = "A->B") -> None:
    """A transfer of ``prompt_tokens`` tokens' state (a request's, or a
    cross-cluster prefix's: same ``c + k*l`` size) starts. Only the PrfaaS->PD
    direction (A->B) is the router's link; B->A (prefixes PD-P ships to
    PrfaaS) is its own pipe, counted in ``ingress_bytes`` only, as in the
    simulator."""
    if direction != "A->B":
      return
    est = self.estimate_bytes(prompt_tokens)
    with self._lock:
      self._inflight[request_id] = est

  def transfer_finished(self, request_id: str, *, prompt_tokens: int = 0,
                        nbytes: float = 0.0, duration_s: float = 0.0,
                        direction: str = "A->B") -> None:
    """Ends an in-flight transfer; a successful one (nbytes > 0) enters the window."""
    now = self.clock()
    with self._lock:
      if direction != "A->B":
        self.ingress_bytes += max(float(nbytes), 0.0)
        return
      self._inflight.pop(request_id, None)
      if nbytes > 0:
        self._transfers.append(_Transfer(now - max(duration_s, 0.0), now, float(nbytes)))
        if prompt_tokens > 0:
          self._size_samples.append((int(prompt_tokens), float(nbytes)))

  def link_utilization(self) -> float:
    if self.link_bandwidth_bps <= 0:
      return 1.0
    now = self.clock()
    lo = now - self.window_s
    delivered = 0.0
    with self._lock:
      transfers = list(self._transfers)
    for t in transfers:
      if t.end <= lo:
        continue
      span = t.end - t.start
      if span <= 0:
        delivered += t.nbytes
      else:
        delivered += t.nbytes * (min(t.end, now) - max(t.start, lo)) / span
    return min(1.0, max(0.0, 8.0 * delivered / (self.link_bandwidth_bps * self.window_s)))

  def backlog_bytes(self) -> float:
    with self._lock:
      return float(sum(self._inflight.values()))

  # -- the router's inputs -------------------------------------------------------------

  def view(self):
    from paas_jax.scheduling import ClusterView  # pylint: disable=g-import-not-at-top
    return ClusterView(link_bandwidth_bps=self.link_bandwidth_bps,
                       link_utilization=self.link_utilization(),
                       prfaas_queue_depth=sum(self.prfaas_queue),
                       pdp_queue_depth=sum(self.pdp_queue),
                       prfaas_instances=len(self.prefill_stubs),
                       pdp_instances=self._pdp_instances(),
                       link_backlog_bytes=self.backlog_bytes())

  def _pdp_instances(self) -> int:
    """PD-P instances serving now: from the broker's live PD roles when it set
    ``instance_counts`` (``() -> (pdp, pdd)``), else every PD node."""
    if self.instance_counts is None:
      return len(self.decode_stubs)
    return int(self.instance_counts()[0])

  def probe_prefix(self, prompt: Sequence[int]) -> tuple[int, int]:
    """(l_pd_cached, l_prfaas_cached): the longest cached prefix in each region
    (max over its servers); a server that does not answer in time counts as 0."""
    req = serving_pb2.StatsRequest(prefix_probe_ids=list(prompt))
    futs = [("pdp", s.GetStats.future(req, timeout=self.probe_deadline_s))
            for s in self.decode_stubs]
    futs += [("prfaas", s.GetStats.future(req, timeout=self.probe_deadline_s))
             for s in self.prefill_stubs]
    best = {"pdp": 0, "prfaas": 0}
    for side, fut in futs:
      try:
        v = int(fut.result().gauges.get("prefix_cached_tokens", 0))
      except grpc.RpcError:
        continue
      best[side] = max(best[side], v)
    n = len(prompt)
    return min(best["pdp"], n), min(best["prfaas"], n)

  def snapshot(self) -> dict:
    v = self.view()
    return {"link_bandwidth_bps": v.link_bandwidth_bps, "link_utilization": v.link_utilization,
            "link_backlog_bytes": v.link_backlog_bytes,
            "prfaas_queue_depth": v.prfaas_queue_depth, "pdp_queue_depth": v.pdp_queue_depth,
            "polls": self.polls, "poll_errors": self.poll_errors,
            "ingress_bytes": self.ingress_bytes}


def tiny_reference_profile(n_slots: int, link_bandwidth_bps: float):
  """A placeholder ``ServiceProfile`` for the fit's unmeasured parts (tiny models on CPU)."""
  from paas_jax.scheduling import DecodeProfile, PrefillProfile  # pylint: disable=g-import-not-at-top
  from paas_jax.simulation.calibration import ServiceProfile  # pylint: disable=g-import-not-at-top
  from paas_jax.simulation.link import BandwidthTrace  # pylint: disable=g-import-not-at-top
  prof = PrefillProfile(name="live", lengths=(64.0, 256.0, 1024.0),
                        prefill_seconds=(0.02, 0.06, 0.25), kv_bytes=(6e4, 1.2e5, 3.5e5),
                        gpus_per_instance=1)
  return ServiceProfile(prfaas_prefill=prof, pdp_prefill=prof,
                        decode=DecodeProfile(max_batch_size=max(n_slots, 1), step_seconds=0.02),
                        link=BandwidthTrace.constant(link_bandwidth_bps if link_bandwidth_bps > 0
                                                     else 1e9))


def rebalance_step(records: Sequence[dict], *, threshold: float, n_slots: int,
                   link_bandwidth_bps: float, min_samples: int = 8, n_pd_nodes: int = 1,
                   current_n_p: int | None = None, n_prfaas: int = 1) -> dict:
  """Fits profiles to finished requests and re-solves t and the P/D split.

  ``records``: dicts with route, input_tokens, cached_tokens, output_tokens,
  prefill_s, link_bytes and optionally tpot_s (as the demo report writes them);
  PD-P and PrfaaS prefill times are fitted per route, the decode step from
  the median TPOT. With one PD node (``n_pd_nodes=1``: PD-P and PD-D on the
  same node) the split is pinned and only t is re-solved. With N > 1 the split
  is free: N_p in 1..N-1 of ``n_local = N``, evaluated against the deployed
  ``current_n_p`` (default N // 2).
  Returns a JSON-able proposal (``{"status": ...}`` when it cannot run yet).
  """
  from paas_jax.scheduling import (EmpiricalLengths, Rebalancer,  # pylint: disable=g-import-not-at-top
                                   SystemModel)
  from paas_jax.simulation.calibration import ServiceProfile  # pylint: disable=g-import-not-at-top
  rows = [r for r in records if r.get("route") in ("pdp", "prfaas")
          and r.get("output_tokens", 0) >= 1 and r.get("input_tokens", 0) >= 1]
  if len(rows) < min_samples:
    return {"status": f"waiting: {len(rows)} of {min_samples} finished requests"}
  ref = tiny_reference_profile(n_slots, link_bandwidth_bps)
  # A warm request counts as a cold one of its uncached length (its prefill cost
  # is mostly that of the new tokens); its link bytes still cover the whole state,
  # so S_kv is fitted on truly cold PrfaaS requests only.
  fit_rows = [dict(r, input_tokens=max(int(r["input_tokens"]) - int(r.get("cached_tokens", 0)), 1),
                   cached_tokens=0, link_bytes=r.get("link_bytes") if not r.get("cached_tokens")
                   else None) for r in rows]
  try:
    prof = ServiceProfile.from_demo_records(
        {"requests": fit_rows, "link_bandwidth_bps": link_bandwidth_bps or 1e9,
         "decode_max_batch_size": n_slots}, ref, min_requests_per_point=2)
  except ValueError as e:
    return {"status": f"fit failed: {e}"}
  lengths = [float(r["input_tokens"]) for r in rows]
  out_tokens = float(np.mean([r["output_tokens"] for r in rows]))
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
