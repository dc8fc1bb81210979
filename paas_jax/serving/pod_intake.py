"""A decode server's intake of states that a prefill *pod* streamed shard to shard.

A pod of P processes (``pod_prefill``) sends one transfer per pod process,
``pod:<request>:<p>->0``, each carrying only the objects the shard plan routes
from process p (its own shards) plus the pod's envelope (merged manifest with
both placements). The decode server's ``StateReceiver`` keeps each verified
transfer's objects without restoring (``template`` returns None for these
ids). ``PodIntake`` holds them per request until every pod process's part is
there, then checks the whole (``pod_transfer.verify_collected``: exactly the
objects the plan routes here, sizes and crc32c as the merged manifest lists
them) and restores the batch-1 state onto this single-process decode server;
only then does the state reach the handoff check. A part whose transfer
failed drops the request's other parts and fails the request: nothing
partial is ever restored or decoded.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from paas_jax.codec.shard_plan import MeshSpec, ShardPlanError
from paas_jax.serving import handoff_probe, pod, pod_transfer
from paas_jax.state import abstract_state, round_up

log = logging.getLogger("paas_jax.serving.pod_intake")

# Parts of a request whose other parts never came are dropped after this long.
PARTS_TTL_S = 300.0


class PodIntake:
  """Pod transfers of a decode server (module docstring).

  Args:
    config: the served ``ModelConfig``.
    verifier: the ``HandoffVerifier`` (``state_arrived``).
    fail: ``(request_id, code, message)``: ends a request.
    metrics: ``ServingMetrics`` or None.
  """

  TARGET = 0  # a decode server is one slice process: every pod part is routed to 0

  def __init__(self, config, *, verifier, fail: Callable, metrics=None):
    self.config = config
    self.verifier = verifier
    self.fail = fail
    self.metrics = metrics
    self.placement = pod.state_placement(config, MeshSpec(("tp",), (1,), (0,)))
    self._lock = threading.Lock()
    self._parts: dict[str, pod_transfer.PodParts] = {}
    self.states_in = 0
    self.parts_in = 0
    self.refused = 0

  @staticmethod
  def template(info):
    """No template: the receiver keeps the verified objects for ``on_state``."""
    del info
    return None

  def on_state(self, received) -> None:
    """One pod process's verified part; restores the state once all are in.
    Raises (the sender's Commit fails) for a part that does not fit."""
    rid, _, target = pod_transfer.parse_transfer_id(received.info.transfer_id)
    if target != self.TARGET:
      received.release()
      raise ShardPlanError(
          f"transfer {received.info.transfer_id} is for slice process {target}; this decode "
          "server is a single process (0)")
    with self._lock:
      self._gc()
      parts = self._parts.setdefault(rid, pod_transfer.PodParts(rid, self.TARGET))
      parts.add(received)
      self.parts_in += 1
      if not parts.complete:
        return
      del self._parts[rid]
    try:
      collected = parts.collected()
      tokens = collected.envelope.manifest.token_count
      state = pod_transfer.restore(collected, self.TARGET, self.placement,
                                   abstract_state(self.config, 1, round_up(max(tokens, 1))),
                                   None)
    except Exception as e:  # pylint: disable=broad-except
      parts.close()
      self.refused += 1
      log.error("pod state of %s refused: %s", rid, e, extra={"request_id": rid})
      self.verifier.forget(rid)
      self.fail(rid, grpc.StatusCode.DATA_LOSS, f"the pod's state was refused: {e}")
      return
    self.states_in += 1
    if self.metrics is not None:
      self.metrics.link_transfers.labels("A->B", "received").inc()
    self.verifier.state_arrived(
        rid, state, {"state_bytes": collected.envelope.manifest.nbytes,
                     "pod_processes": collected.envelope.source_processes},
        lossy=handoff_probe.lossy_manifest(collected.envelope.manifest))

  def on_failure(self, transfer_id: str, code, message: str) -> None:
    """A pod process's part failed: the request's other parts go, the request fails."""
    try:
      rid, src, _ = pod_transfer.parse_transfer_id(transfer_id)
    except ShardPlanError:
      return
    with self._lock:
      parts = self._parts.pop(rid, None)
    if parts is not None:
      parts.close()
    if self.metrics is not None:
      self.metrics.link_transfers.labels("A->B", "receive_failed").inc()
    self.verifier.forget(rid)
    self.fail(rid, code, f"state transfer from pod process {src} failed: {message}")

  def drop(self, request_id: str) -> bool:
    """The request is gone (cancelled, or its attempt failed): its parts go now
    instead of after ``PARTS_TTL_S``. True if there were any."""
    with self._lock:
      parts = self._parts.pop(request_id, None)
    if parts is not None:
      parts.close()
    return parts is not None

  def pending(self) -> int:
    with self._lock:
      return len(self._parts)

  def _gc(self) -> None:
    now = time.monotonic()
    for rid in [r for r, p in self._parts.items() if now - p.updated > PARTS_TTL_S]:
      self._parts.pop(rid).close()
