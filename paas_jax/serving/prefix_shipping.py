"""Cross-cluster prefix shipping: before a request prefills, the longer cached
prefix of the other region is moved to the region that will prefill
(``ExportPrefix``: region A -> a PD node's PD-P cache, or a PD node -> region
A), when the adaptive router chose it (abundant link). Best effort: a failed
or late shipment never fails the request, which then prefills without it.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Sequence

import grpc

from paas_jax.observability.logs import request_metadata
from paas_jax.proto import serving_pb2
from paas_jax.serving import common
from paas_jax.serving.node_pool import NodePool
from paas_jax.serving.request_lifecycle import RequestPhase
from paas_jax.serving.request_record import RequestRecord
from paas_jax.serving.routing import PDP, PRFAAS

log = logging.getLogger("paas_jax.serving.broker")
Code = grpc.StatusCode
# Deadline of a cross-cluster prefix transfer (ExportPrefix); past it the
# request prefills without the prefix (at most half its own time left).
PREFIX_TRANSFER_TIMEOUT_S = 10.0


class PrefixShipper:
  """Ships cached prefixes between the regions for the broker.

  ``targets``: region A's prefix (StateTransfer) ports as the PD nodes reach
  them; ``sources``: the regions whose prefixes can be shipped ("prfaas":
  A -> B, "pdp": B -> A). ``live``: the broker's live view (link accounting),
  set once it starts.
  """

  def __init__(self, pool: NodePool, model_name: str, counters: collections.Counter):
    self.pool = pool
    self.model_name = model_name
    self.counters = counters
    self.targets: list[str] = []
    self.sources: frozenset = frozenset()
    self.timeout_s = PREFIX_TRANSFER_TIMEOUT_S
    self.live = None

  def configure(self, prefill_transfer_targets: Sequence[str] = (), *,
                enabled: bool = True, timeout_s: float | None = None) -> frozenset:
    """Which cross-cluster prefix transfers this broker does; returns the
    prefix sources it can ship (the routing policy is told by the broker).

    ``prefill_transfer_targets``: region A's prefix (StateTransfer) ports as
    the PD nodes reach them (e.g. the relay's B->A route), one per prefill
    target; without them only region A's prefixes are shipped (to PD-P).
    ``enabled=False`` ships none: an ``AdaptiveRouterPolicy`` then re-takes
    such decisions with the scarce rule (``no_cross_cluster_prefix``).
    """
    targets = list(prefill_transfer_targets)
    if targets and len(targets) != len(self.pool.prefill_targets):
      raise ValueError(f"{len(targets)} prefill transfer targets for "
                       f"{len(self.pool.prefill_targets)} prefill servers")
    self.targets = targets
    if timeout_s is not None:
      self.timeout_s = timeout_s
    sources = set()
    if enabled and self.pool.prefill_targets:
      sources.add(PRFAAS)
      if targets:
        sources.add(PDP)
    self.sources = frozenset(sources)
    return self.sources

  def ship(self, rec: RequestRecord, prompt, context, route: str, di: int,
           pi: int | None, calls: dict) -> None:
    """Ships the longer cached prefix to the region that will prefill, if the
    router chose one in the other region (abundant link). Never fails the
    request: on any error (or past its deadline) the request just prefills
    without it, and route_reason says so."""
    src = rec.prefix_source
    if src == route or src not in self.sources:
      return
    n = rec.l_prfaas_cached if src == PRFAAS else rec.l_pd_cached
    if n <= 0 or (route == PRFAAS and pi is None):
      return
    if src == PRFAAS:
      # Any prefill server may hold it (the probe took the max); try the healthy ones.
      exporters = [(self.pool.prefill_stubs[i], self.pool.prefill_targets[i])
                   for i in range(len(self.pool.prefill_targets))
                   if self.pool.health.is_healthy(self.pool.prefill_targets[i])]
      importer = self.pool.prefix_importer_node(di)
      if importer < 0:  # the node that prefills takes no shipped prefix (a slice)
        return
      rec.prefix_node = importer
      target, link = self.pool.decode_targets[importer].transfer, "A->B"
    else:
      # Only nodes whose shape ships prefixes export (a slice's cache is its own).
      order = [di] + [i for i in range(len(self.pool.decode_targets)) if i != di]
      exporters = [(self.pool.decode_stubs[i], self.pool.decode_targets[i].control) for i in order
                   if self.pool.shapes[i].ships_prefixes
                   and self.pool.health.is_healthy(self.pool.decode_targets[i].control)]
      target, link = self.targets[pi], "B->A"
    rec.prefix_transfer = f"{src}->{route}"
    rec.lifecycle.advance(RequestPhase.PREFIX_SHIPPING)
    budget = min(self.timeout_s, common.remaining_s(context) / 2)
    deadline = time.monotonic() + budget
    req = serving_pb2.ExportPrefixRequest(transfer_id=rec.downstream_id, model=self.model_name,
                                          prompt_ids=prompt, max_tokens=n, target=target)
    live, tid = self.live, f"prefix:{rec.downstream_id}"
    if live is not None:
      live.transfer_started(tid, n, direction=link)
    resp, error = None, "no healthy exporter"
    try:
      for stub, address in exporters:
        left = deadline - time.monotonic()
        if left <= 0 or rec.client_gone:
          error = error if rec.client_gone else f"DEADLINE_EXCEEDED: {budget:.1f} s budget spent"
          break
        # A future in ``calls``: a client that goes away cancels the export too.
        fut = stub.ExportPrefix.future(req, timeout=left,
                                       metadata=request_metadata(rec.request_id))
        calls["prefix"] = fut
        try:
          resp = fut.result()
          break
        except grpc.RpcError as e:
          error = f"{common.rpc_code(e).name}: {address}: {common.rpc_details(e)}"
          if common.rpc_code(e) != Code.NOT_FOUND:
            break  # the link or the importer failed: another exporter would too
    finally:
      calls.pop("prefix", None)
      if live is not None:
        live.transfer_finished(tid, prompt_tokens=resp.tokens if resp else 0,
                               nbytes=resp.bytes_sent if resp else 0,
                               duration_s=resp.transfer_s if resp else 0.0, direction=link)
      rec.lifecycle.advance(RequestPhase.ROUTED)
    if resp is None:
      rec.prefix_transfer_error = error
      rec.route_reason += f";prefix_transfer_failed({src}->{route}):{error.split(':', 1)[0]}"
      self.counters["prefix_transfer_failed"] += 1
      log.warning("request %s: prefix transfer %s failed, prefilling without it: %s",
                  rec.request_id, rec.prefix_transfer, error,
                  extra={"request_id": rec.request_id})
      return
    rec.prefix_transfer_tokens = resp.tokens
    rec.prefix_transfer_bytes = resp.bytes_sent
    rec.prefix_transfer_s = resp.transfer_s
    rec.route_reason += f";prefix_transfer({src}->{route}):{resp.tokens}"
    self.counters["prefix_transfers"] += 1
    self.counters["prefix_transfer_tokens"] += resp.tokens
    self.counters["prefix_transfer_bytes"] += resp.bytes_sent
