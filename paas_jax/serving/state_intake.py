"""What arrives on a PD node's transfer port, and where it goes.

``StateIntake`` is the ``StateReceiver``'s template and callbacks for a decode
server (``decode_server.DecodeServicer``). Three kinds of transfer id arrive:

* "prefix:..." (``prefix_transfer``): a prefix of region A's cache, handed to
  PD-P's ``PrefixImporter``;
* "seg:..." (``chunk_stream``): one chunk-streamed segment of a remote
  request's state. Committed segments are assembled into commit points
  (``commit_points.SegmentAssembler``); once the commit point covers the whole
  prompt (``expect`` told its length) the state goes to the handoff check.
  Segments of a request whose attempt failed stay ``SEGMENT_TTL_S`` for a
  resume (``take_resume``);
* a plain request id: a whole state in one transfer (the layerwise path),
  straight to the handoff check;
* "pod:..." (``pod_intake``): one pod process's shards of a state that a
  prefill pod streamed shard to shard; restored once every part is there.

**Held prefix.** When a remote request registers with its prompt ids, ``hold``
looks the prompt up in this node's own prefix cache (PD-P's) and sets the
matched prefix ``[0, n)`` aside as the request's segment 0 (a commit segment:
attention KV ``[0, n)`` and the fixed-size state at ``n``, host copies, so a
later eviction does not matter). The broker passes ``n`` to the prefill side
(``PrefillRequest.decode_held_tokens``), whose ``ChunkStreamer`` then never
sends those tokens: its segments start at ``n`` with index 1.

Remote states reach the scheduler only through the handoff check
(``handoff_probe.HandoffVerifier.state_arrived``); a failed plain transfer
fails its request (``fail``), a failed segment only never counts (the prefill
side reports it, and the broker resumes from the last commit point).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from paas_jax.codec.shard_plan import ShardPlanError
from paas_jax.serving import handoff_probe, pod_transfer, prefix_transfer
from paas_jax.serving.chunk_stream import SegmentId, is_segment_transfer, segment_template
from paas_jax.serving.commit_points import SegmentAssembler, resume_point
from paas_jax.serving.pod_intake import PodIntake
from paas_jax.serving.validation import InvalidRequestError
from paas_jax.state import abstract_state, round_up

# Segments of a request whose attempt failed are kept this long for a resume.
SEGMENT_TTL_S = 300.0
# How long ``hold`` waits for a running PD-P prefill to read the prefix cache;
# past it the request holds nothing (everything is sent).
HOLD_WAIT_S = 0.5


class StateIntake:
  """The transfer port's side of a decode server; see the module docstring.

  Args:
    config: the served ``ModelConfig``.
    max_ctx: the decode pool's context (a segment ending past it is refused).
    verifier: the ``HandoffVerifier`` every remote state goes through.
    fail: ``(request_id, code, message)``: ends a request (``DecodeScheduler.fail``).
    prefix_importer: PD-P's ``PrefixImporter`` ("prefix:" transfers).
    metrics: ``ServingMetrics`` or None.
  """

  def __init__(self, config, *, max_ctx: int, verifier, fail: Callable,
               prefix_importer, metrics=None):
    self.config = config
    self.max_ctx = max_ctx
    self.verifier = verifier
    self.fail = fail
    self.prefix_importer = prefix_importer
    self.metrics = metrics
    self.assembler = SegmentAssembler(config)
    self.pods = PodIntake(config, verifier=verifier, fail=fail, metrics=metrics)
    self._lock = threading.Lock()
    self._prompt_len: dict[str, int] = {}   # remote request -> prompt tokens
    self._seen: dict[str, float] = {}       # request -> last segment / use (monotonic)
    self._done: set[str] = set()
    self.segments_in = 0
    self.transfers_in = 0
    self.transfer_bytes_in = 0
    self.held_requests = 0
    self.held_tokens = 0
    self.hold_busy = 0  # lookups given up: the PD-P engine stayed busy
    # Arrays received as the sender's device shards (ArrayEntry.source_sharding).
    self.sharded_arrays_in = 0

  # -- the decode server's requests ---------------------------------------------------

  def expect(self, request_id: str, prompt_len: int) -> None:
    """A remote request was registered: its state is complete at ``prompt_len``."""
    with self._lock:
      self._prompt_len[request_id] = prompt_len
      self._seen[request_id] = time.monotonic()

  def hold(self, request_id: str, prompt) -> int:
    """Sets aside the longest prefix of ``prompt`` this node's prefix cache holds
    as ``request_id``'s segment 0 (module docstring); returns its tokens (0:
    none, no prefix cache, or the PD-P engine busy past ``HOLD_WAIT_S``)."""
    self._gc()  # held prefixes of requests whose prefill never came go too
    engine = getattr(self.prefix_importer, "engine", None)
    if engine is None or getattr(engine, "prefix_cache", None) is None or len(prompt) < 2:
      return 0
    if engine.cached_prefix_tokens(prompt) <= 0:  # lock-free: a miss never waits
      return 0
    try:
      n, state = engine.export_prefix(prompt, 0, timeout_s=HOLD_WAIT_S)
    except TimeoutError:
      self.hold_busy += 1
      return 0
    if not n or state is None or n >= len(prompt):
      return 0
    self.assembler.add(SegmentId(request_id, 0, 0, n, True).wire(), state)
    with self._lock:
      self._seen[request_id] = time.monotonic()
    self.held_requests += 1
    self.held_tokens += n
    return n

  def take_resume(self, resume_from: str, prompt):
    """The committed state an earlier attempt (downstream id ``resume_from``)
    left for ``prompt``: ``(n, batch-1 state)`` or None (``resume_point``). The
    earlier attempt's segments are dropped either way."""
    with self._lock:
      earlier_len = self._prompt_len.get(resume_from)
    resume = resume_point(self.assembler, resume_from, prompt, earlier_len)
    self.assembler.drop(resume_from)
    self._forget(resume_from)
    return resume

  def segment_requests(self) -> int:
    return len(self.assembler.requests())

  # -- StateReceiver hooks -------------------------------------------------------------

  def template(self, info):
    """The receiver's template for a transfer (``StateReceiver(template=)``)."""
    if prefix_transfer.is_prefix_transfer(info.transfer_id):
      return self.prefix_importer.template(info)
    if pod_transfer.is_pod_transfer(info.transfer_id):
      return self.pods.template(info)
    if is_segment_transfer(info.transfer_id):
      seg = SegmentId.parse(info.transfer_id)
      if seg.end > self.max_ctx:
        raise InvalidRequestError(f"segment {info.transfer_id} ends past the context of "
                                  f"{self.max_ctx} tokens")
      return segment_template(self.config, seg), None
    return abstract_state(self.config, 1, round_up(max(info.token_count, 1))), None

  def on_state(self, received) -> None:
    rid = received.info.transfer_id
    if prefix_transfer.is_prefix_transfer(rid):
      self.prefix_importer.on_ready(received)
      return
    if pod_transfer.is_pod_transfer(rid):
      # A pod sends whole states: a prefix held for the request is not needed.
      try:
        self.assembler.drop(pod_transfer.parse_transfer_id(rid)[0])
      except ShardPlanError:
        pass  # PodIntake refuses it below
      self.pods.on_state(received)
      return
    if is_segment_transfer(rid):
      self._on_segment(received)
      return
    self.transfers_in += 1
    self.transfer_bytes_in += received.manifest.nbytes
    self.assembler.drop(rid)  # a prefix held for it is not needed (whole state)
    self.sharded_arrays_in += _sharded_arrays(received.manifest)
    if self.metrics is not None:
      self.metrics.link_transfers.labels("A->B", "received").inc()
    self.verifier.state_arrived(rid, received.state, {"state_bytes": received.manifest.nbytes},
                                lossy=handoff_probe.lossy_manifest(received.manifest))

  def on_transfer_failure(self, transfer_id: str, code, message: str) -> None:
    if prefix_transfer.is_prefix_transfer(transfer_id):
      self.prefix_importer.on_failure(transfer_id, code, message)
      return
    if pod_transfer.is_pod_transfer(transfer_id):
      self.pods.on_failure(transfer_id, code, message)
      return
    if is_segment_transfer(transfer_id):
      # No commit point at or past it; the prefill side reports the failure
      # to the broker, which resumes from the last commit point (resume.py).
      self.assembler.reject(transfer_id)
      if self.metrics is not None:
        self.metrics.link_transfers.labels("A->B", "receive_failed").inc()
      return
    if self.metrics is not None:
      self.metrics.link_transfers.labels("A->B", "receive_failed").inc()
    self.verifier.forget(transfer_id)
    self.fail(transfer_id, code, f"state transfer failed: {message}")

  # -- segments ---------------------------------------------------------------------------

  def _on_segment(self, received) -> None:
    """A verified segment: keep it; hand the state over once the commit point is
    the whole prompt. A segment that does not match its id raises (the
    sender's Commit fails: that segment never counts)."""
    seg = self.assembler.add(received.info.transfer_id, received.state)
    rid = seg.request_id
    self.segments_in += 1
    self.transfer_bytes_in += received.manifest.nbytes
    self.sharded_arrays_in += _sharded_arrays(received.manifest)
    with self._lock:
      self._seen[rid] = time.monotonic()
      prompt_len = self._prompt_len.get(rid)
      complete = (prompt_len is not None and rid not in self._done
                  and self.assembler.commit_point(rid) >= prompt_len)
      if complete:
        self._done.add(rid)
    self._gc()
    if not complete:
      return
    n, state = self.assembler.committed_state(rid)
    self.assembler.drop(rid)
    self.transfers_in += 1
    if self.metrics is not None:
      self.metrics.link_transfers.labels("A->B", "received").inc()
    self.verifier.state_arrived(rid, state, {"commit_point": n},
                                lossy=handoff_probe.lossy_manifest(received.manifest))

  def _forget(self, rid: str) -> None:
    with self._lock:
      self._prompt_len.pop(rid, None)
      self._seen.pop(rid, None)
      self._done.discard(rid)

  def _gc(self) -> None:
    """Drops the segments of requests idle past SEGMENT_TTL_S (no resume came)."""
    now = time.monotonic()
    with self._lock:
      old = [r for r, t in self._seen.items() if now - t > SEGMENT_TTL_S]
    for rid in old:
      self.assembler.drop(rid)
      self._forget(rid)


def _sharded_arrays(manifest) -> int:
  """Arrays of a received state that the sender encoded shard by shard."""
  return sum(a.source_sharding is not None for g in manifest.groups for a in g.arrays)
