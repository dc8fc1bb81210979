"""What the broker's adaptive router sees: a live ``ClusterView`` plus prefix probes.

``LiveClusterState`` keeps, without ever blocking a request:

* **queue depths** from the servers' typed ``GetLoad`` reports
  (``LoadReport.prefill_queue_depth``: region A's prefill queue, the PD nodes'
  PD-P queue; ``control_plane``), polled by a background thread every
  ``poll_s`` (200 ms) with a deadline per call; a server that does not answer
  keeps its last value and is counted in ``poll_errors``, and a malformed
  report (``control_plane.check_load_report``) is refused the same way and
  counted in ``refused_reports``. Each accepted report also goes to
  ``on_load_report`` (the broker's ``NodePool``);
* **link utilization** over the trailing ``window_s``, measured: the rate of
  the prefill servers' ``LinkLoad.bytes_sent_total`` counters (bytes their
  senders have put on the link, states and prefix exports, counted as gRPC
  takes each chunk; ``paas_jax.transport.LinkCounters``) between successive
  polls. Fallback, when a prefill server reports no ``link`` or fewer than
  two polls exist: the broker's own record of recent transfers
  (``TransferDone``: bytes on the link, Begin to Commit time), each
  transfer's bytes spread evenly over its duration;
* **link backlog**: the prefill servers' ``LinkLoad.bytes_pending`` (bytes
  encoded or queued for the link and not yet sent, of transfers in flight)
  from the latest poll, plus an estimate only for what the servers do not
  report yet:
  a transfer the broker started that no server has listed (waiting for its
  prefill batch, or on an older server) counts ``c + k*l`` bytes (fitted on
  past transfers' prompt length and bytes); one listed but not fully encoded
  (prefill still producing layers) counts what the estimate says is still to
  come, ``max(0, estimate - sent - pending)``; one listed as fully encoded, or
  listed once and gone since (finished there, TransferDone not here yet),
  counts nothing more. Nothing is counted twice. Without any link gauges the
  backlog is the estimates alone, as before.

PD nodes' own sends over the WAN (their prefix exports, B->A) are read the
same way but kept apart as ingress (``snapshot``: ``ingress_*``), as the
simulator keeps its ``pd->prfaas`` pipe apart from the router's link.

``view()`` returns the latest snapshot as a ``ClusterView``; ``probe_prefix``
asks both regions for the cached prefix of a prompt (``ProbePrefix``) in
parallel with a short deadline (0 on timeout or error). It sends the chained
hashes of the prompt's blocks (``PrefixProbeRequest.block_hashes``, 16 bytes
per block) to a server whose block size and config fingerprint the polls have
learned (``LoadReport.prefix_cache``), computed once per distinct pair with
the cache's own ``block_hashes``; the ids (``prompt_ids``) only to a server
not learned yet; nothing to a server without a prefix cache.
``probe_prefix_nodes`` also says which PD nodes hold the longest PD-side
prefix, so that the broker places a local request where its prefix lives.

The long timescale: every ``rebalance_every_s`` the state fits prefill
profiles to the broker's measured requests and runs a ``Rebalancer`` step
(``paas_jax.scheduling.rebalance_step`` over typed ``FinishedRequest`` records:
per-request prefill time and link bytes).
The deployment has one PD node, which does both PD-P and PD-D, so the split
cannot move: the step re-solves t with the split pinned and only *reports*
the proposal (``last_proposal``); applying t is opt-in (``apply_threshold``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from paas_jax.proto import serving_pb2
from paas_jax.scheduling import ClusterView
from paas_jax.serving import control_plane

log = logging.getLogger("paas_jax.serving.live_view")


@dataclasses.dataclass
class _Transfer:
  start: float
  end: float
  nbytes: float


@dataclasses.dataclass(frozen=True)
class LinkReport:
  """One server's ``LinkLoad`` from one poll (``paas_jax.transport.LinkCounters``).

  t: poll time (the state's clock, s); pending, sent_total: bytes;
  transfers: the in-flight transfers by transfer id (``pending``, ``sent``:
  bytes; ``encoded``: every layer encoded).
  """

  t: float
  pending: float
  sent_total: float
  transfers: dict
  # TCP retransmissions on the sender's data-plane connections (TCP_INFO).
  retransmits_total: float = 0.0


# probe info of a server without a prefix cache: probes skip it (it answers 0).
_NO_CACHE = (0, "")


@dataclasses.dataclass(frozen=True)
class PrefixProbe:
  """What the regions' prefix caches hold of one prompt (tokens).

  pd_cached / prfaas_cached: the longest cached prefix in each region (max
  over its servers); pd_nodes: the PD nodes holding ``pd_cached`` (empty
  when it is 0), where a local prefill would reuse it.
  """

  pd_cached: int = 0
  prfaas_cached: int = 0
  pd_nodes: tuple[int, ...] = ()


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
    self.refused_reports = 0  # malformed LoadReports (check_load_report)
    self.polls = 0
    # (kind "prefill"|"decode", index, LoadReport) for each accepted report.
    self.on_load_report: Callable[[str, int, serving_pb2.LoadReport], None] | None = None
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._periodic: list[tuple[float, Callable[[], None], list]] = []
    self.ingress_bytes = 0.0  # B->A link bytes (cross-cluster prefixes)
    # Measured link state (``ingest``): per prefill server (egress, the
    # router's link) and per PD node (its prefix exports, B->A ingress); None
    # until it answers with link gauges. ``_legacy``: prefill servers that
    # answered without them (utilization then falls back to TransferDone).
    self._egress: list[LinkReport | None] = [None] * len(self.prefill_stubs)
    self._ingress: list[LinkReport | None] = [None] * len(self.decode_stubs)
    self._legacy = [False] * len(self.prefill_stubs)
    # (poll time, link_bytes_sent_total) per prefill server, covering the window.
    self._sent_series = [collections.deque(maxlen=1024) for _ in self.prefill_stubs]
    self._seen: set[str] = set()  # in-flight transfers some server has listed
    # ("prfaas"|"pdp", index) -> (block tokens, config fingerprint) of the
    # server's prefix cache, _NO_CACHE, or absent (not learned: probe by ids).
    self._probe_info: dict[tuple[str, int], tuple[int, str]] = {}
    self.probe_requests = 0  # probe RPCs sent
    self.probe_request_bytes = 0  # their serialized PrefixProbeRequest bytes
    self.probe_enabled = True  # the broker probes before routing (--probe_prefix)
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
    """One round of GetLoad to every server, in parallel, each with a deadline."""
    calls = [("prefill", i, s.GetLoad.future(serving_pb2.LoadRequest(),
                                             timeout=self.rpc_deadline_s))
             for i, s in enumerate(self.prefill_stubs)]
    calls += [("decode", i, s.GetLoad.future(serving_pb2.LoadRequest(),
                                             timeout=self.rpc_deadline_s))
              for i, s in enumerate(self.decode_stubs)]
    for kind, i, fut in calls:
      try:
        response = fut.result()
      except grpc.RpcError:
        self.poll_errors += 1
        continue
      if self.ingest(kind, i, response) and self.on_load_report is not None:
        self.on_load_report(kind, i, response)
    self.polls += 1

  def ingest(self, kind: str, i: int, report: serving_pb2.LoadReport,
             now: float | None = None) -> bool:
    """Takes one server's ``LoadReport`` (``kind`` "prefill" or "decode", index
    ``i``, polled at ``now``): queue depth, link, prefix-cache block and
    fingerprint. Returns False (and keeps the server's last values) for a
    report ``control_plane.check_load_report`` refuses. Pure state update
    (tests feed it directly)."""
    now = self.clock() if now is None else now
    try:
      control_plane.check_load_report(report, kind)
    except control_plane.InvalidLoadReport as e:
      with self._lock:
        self.refused_reports += 1
      log.warning("refused the load report of %s server %d: %s", kind, i, e)
      return False
    side = "prfaas" if kind == "prefill" else "pdp"
    cache = report.prefix_cache
    self._probe_info[(side, i)] = ((cache.block_tokens, cache.config_fingerprint)
                                   if cache.enabled else _NO_CACHE)
    link = None
    if report.HasField("link"):
      rows = {t.transfer_id: {"pending": t.pending_bytes, "sent": t.sent_bytes,
                              "encoded": t.encoded} for t in report.link.transfers}
      link = LinkReport(now, float(report.link.bytes_pending),
                        float(report.link.bytes_sent_total), rows,
                        float(report.link.tcp_retransmits_total))
    if kind == "prefill":
      self.prfaas_queue[i] = int(report.prefill_queue_depth)
      with self._lock:
        self._egress[i], self._legacy[i] = link, link is None
        series = self._sent_series[i]
        if link is None:
          series.clear()
          return True
        if series and link.sent_total < series[-1][1]:
          series.clear()  # the server restarted: its counter began again
        series.append((now, link.sent_total))
        # Keep one sample at or before the window's start (the rate's base).
        while len(series) > 2 and series[1][0] <= now - self.window_s:
          series.popleft()
        self._seen.update(t for t in link.transfers if t in self._inflight)
    else:
      self.pdp_queue[i] = int(report.prefill_queue_depth)
      with self._lock:
        self._ingress[i] = link
    return True

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
      self._seen.discard(request_id)
      if nbytes > 0:
        self._transfers.append(_Transfer(now - max(duration_s, 0.0), now, float(nbytes)))
        if prompt_tokens > 0:
          self._size_samples.append((int(prompt_tokens), float(nbytes)))

  def measured_link_rate(self) -> float | None:
    """Bytes/s the prefill servers put on the link over the trailing window,
    from successive polls of ``LinkLoad.bytes_sent_total``; None when it cannot
    be measured (a server reporting no link, or no server polled twice yet).

    Per server: the counter's increase from the window's start (interpolated
    between the polls around it) to its latest poll, over that span. A server
    whose latest poll is older than the window (not answering) adds nothing.
    """
    now = self.clock()
    with self._lock:
      if any(self._legacy):
        return None
      series = [list(s) for s in self._sent_series]
    rate, measured = 0.0, False
    for s in series:
      if len(s) < 2:
        continue
      measured = True
      t_last, v_last = s[-1]
      if now - t_last > self.window_s:
        continue
      lo = t_last - self.window_s
      t0, v0 = s[0]
      if t0 < lo:  # interpolate the counter at the window's start
        t1, v1 = s[1]
        v0 = v0 + (v1 - v0) * (lo - t0) / (t1 - t0) if t1 > t0 else v1
        t0 = lo
      if t_last > t0:
        rate += max(v_last - v0, 0.0) / (t_last - t0)
    return rate if measured else None

  def link_utilization(self) -> float:
    if self.link_bandwidth_bps <= 0:
      return 1.0
    rate = self.measured_link_rate()
    if rate is not None:
      return min(1.0, max(0.0, 8.0 * rate / self.link_bandwidth_bps))
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
    """Bytes waiting for the link (see the module docstring): the servers'
    measured ``LinkLoad.bytes_pending`` plus estimates for what they do not list yet."""
    with self._lock:
      inflight = dict(self._inflight)
      reports = [r for r in self._egress if r is not None]
      seen = set(self._seen)
    if not reports:
      return float(sum(inflight.values()))
    total = sum(r.pending for r in reports)
    rows: dict = {}
    for r in reports:
      rows.update(r.transfers)
    for tid, est in inflight.items():
      row = rows.get(tid)
      if row is None:
        if tid not in seen:  # not begun at any server yet (or an older server)
          total += est
      elif not row.get("encoded", False):
        # Layers still to come: what the estimate says is left beyond what the
        # server has sent or queued already.
        total += max(0.0, est - float(row.get("sent", 0)) - float(row.get("pending", 0)))
    return float(total)

  def ingress_pending_bytes(self) -> float:
    """B->A bytes the PD nodes' prefix exports have queued and not sent (measured)."""
    with self._lock:
      return float(sum(r.pending for r in self._ingress if r is not None))

  # -- the router's inputs -------------------------------------------------------------

  def view(self):
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

  def probe_requests_for(self, prompt: Sequence[int]) -> list[tuple[str, int, object]]:
    """The probe of each server, as (side, index, PrefixProbeRequest): hashes of the
    blocks of prompt[:len-1] for a server whose block and fingerprint are
    known (one hash computation per distinct pair), the ids otherwise; a
    server without a prefix cache, or a prompt without one complete block
    before its last token, gets no probe (it would answer 0)."""
    # Deferred: paas_jax.state loads JAX, and the broker process (which imports this
    # module) stays JAX-free until a prompt is probed.
    from paas_jax.state.prefix_cache import block_hashes, probe_tokens  # pylint: disable=g-import-not-at-top
    out, by_info, ids_req = [], {}, None
    for side, stubs in (("pdp", self.decode_stubs), ("prfaas", self.prefill_stubs)):
      for i in range(len(stubs)):
        info = self._probe_info.get((side, i))
        if info == _NO_CACHE:
          continue
        if info is None:
          if ids_req is None:
            ids_req = control_plane.probe_request(prompt)
          out.append((side, i, ids_req))
          continue
        if info not in by_info:
          hashes = block_hashes(probe_tokens(prompt), info[0], info[1])
          by_info[info] = (control_plane.probe_request(hashes=hashes, block_tokens=info[0])
                           if hashes else None)
        if by_info[info] is not None:
          out.append((side, i, by_info[info]))
    return out

  def probe_prefix(self, prompt: Sequence[int]) -> tuple[int, int]:
    """(l_pd_cached, l_prfaas_cached) of ``probe_prefix_nodes``."""
    probe = self.probe_prefix_nodes(prompt)
    return probe.pd_cached, probe.prfaas_cached

  def probe_prefix_nodes(self, prompt: Sequence[int]) -> PrefixProbe:
    """The longest cached prefix in each region (max over its servers) and the
    PD nodes holding it; a server that does not answer in time, or answers
    with an error, counts as 0. A FAILED_PRECONDITION answer to hashes (the
    server's block size changed, or its cache is gone) forgets what was learned
    of it: it gets ids until the next poll."""
    stubs = {"pdp": self.decode_stubs, "prfaas": self.prefill_stubs}
    futs = []
    for side, i, req in self.probe_requests_for(prompt):
      futs.append((side, i, req, stubs[side][i].ProbePrefix.future(
          req, timeout=self.probe_deadline_s)))
      with self._lock:
        self.probe_requests += 1
        self.probe_request_bytes += req.ByteSize()
    best = {"pdp": 0, "prfaas": 0}
    pd_by_node: dict[int, int] = {}
    for side, i, req, fut in futs:
      try:
        v = max(int(fut.result().cached_tokens), 0)
      except grpc.RpcError as e:
        code = e.code() if callable(getattr(e, "code", None)) else None
        if req.block_tokens and code == grpc.StatusCode.FAILED_PRECONDITION:
          self._probe_info.pop((side, i), None)
        continue
      best[side] = max(best[side], v)
      if side == "pdp":
        pd_by_node[i] = v
    n = len(prompt)
    pd = min(best["pdp"], n)
    holders = tuple(sorted(i for i, v in pd_by_node.items() if v > 0 and min(v, n) == pd))
    return PrefixProbe(pd, min(best["prfaas"], n), holders)

  def link_bytes_sent(self) -> float:
    """Bytes region A's senders put on the link so far (their last polled
    ``LinkLoad.bytes_sent_total``, summed over prefill servers)."""
    with self._lock:
      return float(sum(r.sent_total for r in self._egress if r is not None))

  def link_retransmits(self) -> float:
    """TCP retransmissions region A's senders report on the link (TCP_INFO of
    the data-plane connections), summed over prefill servers."""
    with self._lock:
      return float(sum(r.retransmits_total for r in self._egress if r is not None))

  def snapshot(self) -> dict:
    v = self.view()
    return {"link_bandwidth_bps": v.link_bandwidth_bps, "link_utilization": v.link_utilization,
            "link_backlog_bytes": v.link_backlog_bytes,
            "prfaas_queue_depth": v.prfaas_queue_depth, "pdp_queue_depth": v.pdp_queue_depth,
            "polls": self.polls, "poll_errors": self.poll_errors,
            "refused_reports": self.refused_reports,
            "link_measured": self.measured_link_rate() is not None,
            "link_tcp_retransmits": self.link_retransmits(),
            "ingress_bytes": self.ingress_bytes,
            "ingress_pending_bytes": self.ingress_pending_bytes(),
            "probe_requests": self.probe_requests,
            "probe_request_bytes": self.probe_request_bytes}
