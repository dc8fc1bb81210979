"""Chunk-pipelined state streaming: every prefill chunk leaves as it is computed.

A long prompt is prefilled in chunks of ``EngineConfig.prefill_chunk`` tokens.
Each chunk travels as one **segment**: a transfer of its own on the ordinary
``StateSender``/``StateReceiver`` interface (so any data plane that carries a
transfer carries segments), with

* for every growing layer (full attention ``A``, MLA ``M``) the KV slice of
  the chunk's tokens ``[start, end)``, handed over the moment the chunk's
  layer is computed;
* at a **commit segment** (every ``commit_every`` chunks, and the prompt's
  last chunk) additionally every fixed-size layer (recurrent ``G``/``m``,
  sliding window ``S``) as it stands at ``end``: fixed-size state travels
  once per commit point, not once per chunk.

A segment's Commit is the receiver's verification (sizes, crc32c, manifest);
``commit_points.SegmentAssembler`` on the decode side turns committed
segments into the longest self-consistent prefix state. The prefill thread
never waits for a device-to-host copy: ``ChunkStreamer.put`` slices on device,
starts ``copy_to_host_async`` and queues; a sender thread materialises and
hands layers to the transport, bounded by ``max_pending`` queued slices (flow
control back to prefill when the link is slower).

Prompt tokens the decode side already holds in its own prefix cache
(``held``) are never sent: they are segment 0, committed from the start
(``state_intake.StateIntake.hold`` restores them there).

Segment transfer ids (``segment_wire_id``) carry what the decode side needs
to build the segment's template before any byte arrives:
``"seg:<index>:<start>:<end>:<c|p>:<request id>"``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
from concurrent import futures
from typing import Any, Callable

import jax

from paas_jax.codec.encode import spans_devices, wire_arrays
from paas_jax.codec.options import CodecOptions
from paas_jax.models.config import ModelConfig
from paas_jax.state import AttentionCache, DecodeState, MLACache, abstract_state

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "seg:"
# Caches whose size grows with the prompt (token axis 1): sent per chunk.
GROWING_CACHES = (AttentionCache, MLACache)
GROWING_KINDS = ("A", "M")


@dataclasses.dataclass(frozen=True)
class SegmentId:
  """One chunk of one request's prompt: tokens ``[start, end)``, chunk ``index``."""

  request_id: str
  index: int
  start: int
  end: int
  commit: bool

  def wire(self) -> str:
    return (f"{SEGMENT_PREFIX}{self.index}:{self.start}:{self.end}:"
            f"{'c' if self.commit else 'p'}:{self.request_id}")

  @classmethod
  def parse(cls, transfer_id: str) -> "SegmentId":
    """Inverse of ``wire``; ``ValueError`` on a malformed id."""
    if not transfer_id.startswith(SEGMENT_PREFIX):
      raise ValueError(f"not a segment transfer id: {transfer_id!r}")
    parts = transfer_id[len(SEGMENT_PREFIX):].split(":", 4)
    if len(parts) != 5 or parts[3] not in ("c", "p") or not parts[4]:
      raise ValueError(f"malformed segment transfer id: {transfer_id!r}")
    index, start, end = (int(p) for p in parts[:3])
    if index < 0 or not 0 <= start < end:
      raise ValueError(f"bad token range in segment transfer id: {transfer_id!r}")
    return cls(parts[4], index, start, end, parts[3] == "c")


def is_segment_transfer(transfer_id: str) -> bool:
  return transfer_id.startswith(SEGMENT_PREFIX)


def segment_layers(config: ModelConfig, commit: bool) -> tuple[int, ...]:
  """Model layer indices a segment carries (in order): growing ones, plus all at commit."""
  return tuple(i for i, k in enumerate(config.layer_kinds) if commit or k in GROWING_KINDS)


def segment_template(config: ModelConfig, seg: SegmentId) -> DecodeState:
  """Abstract batch-1 state of one segment: its layers, growing ones holding
  ``end - start`` tokens; ``lengths`` [1] = ``end``."""
  size = seg.end - seg.start
  full = abstract_state(config, 1, size)
  return DecodeState(layers=tuple(full.layers[i] for i in segment_layers(config, seg.commit)),
                     lengths=full.lengths)


@functools.partial(jax.jit, static_argnames=("size",))
def _take_tokens(x, row, start, size: int):
  """x[row:row+1, start:start+size]; one compile per (shape, size), not per start."""
  x = jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0)
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


@jax.jit
def _take_row(x, row):
  return jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0)


def slice_chunk(cache: Any, row: int, start: int, end: int) -> Any:
  """Row ``row`` of a batched layer cache, tokens ``[start, end)`` for a growing
  cache (device op, no sync), the whole fixed-size state otherwise; starts the
  device-to-host copies."""
  if isinstance(cache, GROWING_CACHES):
    out = jax.tree_util.tree_map(lambda x: _take_tokens(x, row, start, size=end - start),
                                 cache)
  else:
    out = jax.tree_util.tree_map(lambda x: _take_row(x, row), cache)
  for leaf in jax.tree_util.tree_leaves(out):
    if spans_devices(leaf):  # each shard from its own device (no gather)
      for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
          shard.data.copy_to_host_async()
      continue
    copy = getattr(leaf, "copy_to_host_async", None)
    if copy is not None:
      copy()
  return out


@dataclasses.dataclass(frozen=True)
class SegmentRecord:
  """What the prefill side knows of one sent segment."""

  segment: SegmentId
  ok: bool
  error: str = ""
  bytes_sent: int = 0
  first_byte_s: float | None = None
  committed_s: float | None = None
  state_bytes: int = 0
  begin_s: float | None = None
  resent_chunks: int = 0
  code: str = ""             # gRPC status name of a failed segment


@dataclasses.dataclass(frozen=True)
class StreamResult:
  """A whole prompt's streaming, as seen by the prefill side."""

  request_id: str
  prompt_len: int
  commit_point: int          # tokens the decode side holds verified (0: none)
  segments: tuple[SegmentRecord, ...]
  first_byte_s: float | None
  last_commit_s: float | None

  @property
  def ok(self) -> bool:
    return self.commit_point == self.prompt_len

  @property
  def bytes_sent(self) -> int:
    return sum(s.bytes_sent for s in self.segments)

  num_streams: int = 0
  receiver_ready_s: float = 0.0

  @property
  def state_bytes(self) -> int:
    return sum(s.state_bytes for s in self.segments if s.ok)

  @property
  def resent_chunks(self) -> int:
    return sum(s.resent_chunks for s in self.segments)

  @property
  def duration_s(self) -> float:
    """First segment's Begin to the last Commit (0 if nothing committed)."""
    begins = [s.begin_s for s in self.segments if s.begin_s is not None]
    if not begins or self.last_commit_s is None:
      return 0.0
    return max(0.0, self.last_commit_s - min(begins))


_CLOSE = object()


class ChunkStreamer:
  """Streams one request's prefill, chunk by chunk, as segments.

  Args:
    sender: anything with ``StateSender.begin``'s signature.
    config: the model config (layer kinds, fingerprint).
    request_id, prompt_len: the request.
    chunk: prefill chunk length (segments are chunks: ``[c*chunk, (c+1)*chunk)``).
    commit_every: chunks per commit point (K >= 1).
    codec: ``CodecOptions`` or None for the sender's default.
    max_pending: queued layer slices before ``put`` blocks (flow control).
    on_commit: called with the new commit point (tokens) each time it grows.
    start_token: first token streamed (a resumed prefill starts at its commit point).
    first_index: index of the first segment (default ``start_token // chunk``).
    held: prompt tokens ``[0, held)`` the decode side already holds in its own
      prefix cache (``PrefillRequest.decode_held_tokens``): they are segment 0,
      committed from the start and never sent (the decode side restores it:
      ``state_intake.StateIntake.hold``); every chunk part below ``held`` is
      dropped, a chunk across it is sent from ``held``. 0 with ``start_token``.

  Segment indices follow the order in which chunks first reach ``put`` (so a
  cached prefix handed over as one chunk ``[0, reused)`` is segment 0 and the
  computed chunks after it 1, 2, ...); commit segments are every
  ``commit_every``-th index and the prompt's last chunk.
  """

  def __init__(self, sender, config: ModelConfig, request_id: str, prompt_len: int, *,
               chunk: int, commit_every: int = 1, codec=None, max_pending: int = 64,
               on_commit: Callable[[int], None] | None = None, start_token: int = 0,
               finishers: int = 2, first_index: int | None = None, held: int = 0):
    if commit_every < 1 or chunk < 1:
      raise ValueError("ChunkStreamer: chunk and commit_every must be >= 1")
    if not 0 <= held < prompt_len or (held and (start_token or first_index)):
      raise ValueError(f"ChunkStreamer: held={held} must be in [0, {prompt_len}) and comes "
                       "without start_token / first_index")
    self.sender, self.config = sender, config
    self.request_id, self.prompt_len = request_id, prompt_len
    self.chunk, self.commit_every = chunk, commit_every
    self.codec = codec if codec is not None else CodecOptions()
    self.on_commit = on_commit
    self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_pending))
    self._lock = threading.Lock()
    self._records: dict[int, SegmentRecord] = {}
    self._failed_from: int | None = None   # first segment that failed: no commit past it
    self._commit_point = start_token
    self._start_index = start_token // chunk if first_index is None else first_index
    self._index_of: dict[int, int] = {}   # chunk start -> segment index (prefill thread)
    self._next_index = self._start_index
    self.held = held
    if held:
      # Segment 0 is the decode side's own prefix: committed, zero bytes sent.
      seg = SegmentId(request_id, 0, 0, held, True)
      self._records[0] = SegmentRecord(seg, True)
      self._commit_point, self._next_index = held, 1
    self._aborted = False
    self._error: BaseException | None = None
    self._pool = futures.ThreadPoolExecutor(max_workers=finishers,
                                            thread_name_prefix=f"seg-commit-{request_id[:8]}")
    self._pending: list[futures.Future] = []
    self._thread = threading.Thread(target=self._loop, daemon=True,
                                    name=f"seg-send-{request_id[:8]}")
    self._thread.start()

  # -- prefill thread ----------------------------------------------------------------

  def segment(self, start: int, end: int) -> SegmentId:
    index = self._index_of.get(start)
    if index is None:
      index = self._index_of[start] = self._next_index
      self._next_index += 1
    commit = end >= self.prompt_len or (index + 1) % self.commit_every == 0
    return SegmentId(self.request_id, index, start, end, commit)

  def put(self, layer_index: int, cache: Any, start: int, end: int, row: int = 0) -> None:
    """Hands layer ``layer_index`` of the chunk ``[start, end)`` (batched device
    cache, this request in ``row``) to the stream; never waits for the copy."""
    start = max(start, self.held)  # the decode side holds [0, held) already
    if self._aborted or end <= start:
      return
    seg = self.segment(start, end)
    if layer_index not in segment_layers(self.config, seg.commit):
      return
    item = (seg, layer_index, slice_chunk(cache, row, start, end))
    while not self._aborted:  # flow control: wait for the sender thread
      try:
        self._queue.put(item, timeout=0.1)
        return
      except queue.Full:
        continue

  # -- sender thread -------------------------------------------------------------------

  def _loop(self) -> None:
    open_tx: dict[int, tuple[Any, list[int]]] = {}
    while not self._aborted:
      try:
        item = self._queue.get(timeout=0.1)
      except queue.Empty:
        continue
      if item is _CLOSE:
        break
      seg, layer_index, cache = item
      if (self._failed_from is not None and seg.index >= self._failed_from):
        continue
      try:
        if seg.index not in open_tx:
          tx = self.sender.begin(model_id=self.config.name,
                                 config_fingerprint=self.config.fingerprint(),
                                 num_layers=len(segment_layers(self.config, seg.commit)),
                                 lengths=[seg.end], token_count=seg.end - seg.start,
                                 codec=self.codec, transfer_id=seg.wire())
          open_tx[seg.index] = (tx, list(segment_layers(self.config, seg.commit)))
        tx, layers = open_tx[seg.index]
        # Waits for this copy only; a leaf spread over devices (tensor
        # parallelism) is encoded shard by shard from each device, no gather.
        host = wire_arrays(cache)
        tx.send_layer(layers.index(layer_index), host)
        if layer_index == layers[-1]:
          del open_tx[seg.index]
          self._pending.append(self._pool.submit(self._finish, seg, tx))
      except BaseException as e:  # pylint: disable=broad-except
        log.warning("segment %s not sent: %r", seg.wire(), e)
        self._fail(seg, repr(e), code=getattr(e, "code", None))
        entry = open_tx.pop(seg.index, None)
        if entry is not None:
          entry[0].abort(f"segment failed: {e!r}")
    for tx, _ in open_tx.values():
      tx.abort("the prefill stream ended before this segment was complete")

  def _finish(self, seg: SegmentId, tx) -> None:
    try:
      result = tx.finish()
    except BaseException as e:  # pylint: disable=broad-except
      log.warning("segment %s failed: %r", seg.wire(), e)
      self._fail(seg, getattr(e, "message", repr(e)), tx, code=getattr(e, "code", None))
      return
    tl = result.timeline
    with self._lock:
      self._records[seg.index] = SegmentRecord(seg, True, bytes_sent=tl.bytes_sent,
                                               first_byte_s=tl.first_byte_s,
                                               committed_s=tl.end_s,
                                               state_bytes=tl.state_bytes,
                                               begin_s=tl.start_s,
                                               resent_chunks=tl.resent_chunks)
      advanced = self._advance()
    if advanced and self.on_commit is not None:
      self.on_commit(self._commit_point)

  def _fail(self, seg: SegmentId, message: str, tx=None, code=None) -> None:
    tl = tx.timeline() if tx is not None else None
    with self._lock:
      self._records[seg.index] = SegmentRecord(
          seg, False, error=message, bytes_sent=tl.bytes_sent if tl else 0,
          first_byte_s=tl.first_byte_s if tl else None,
          code=getattr(code, "name", "") if code is not None else "")
      if self._failed_from is None or seg.index < self._failed_from:
        self._failed_from = seg.index

  def _advance(self) -> bool:
    """Recomputes the commit point: the end of the last commit segment of the
    contiguous run of committed segments from the first (holds the lock)."""
    point, i = self._commit_point, self._start_index
    while (rec := self._records.get(i)) is not None and rec.ok:
      if rec.segment.commit:
        point = max(point, rec.segment.end)
      i += 1
    moved, self._commit_point = point > self._commit_point, point
    return moved

  # -- results ---------------------------------------------------------------------------

  @property
  def commit_point(self) -> int:
    """Tokens the decode side holds verified (the prefill side's view)."""
    with self._lock:
      return self._commit_point

  def close(self, timeout_s: float | None = None) -> StreamResult:
    """Waits for every segment's Commit; returns what landed."""
    if not self._aborted:
      self._queue.put(_CLOSE)
    self._thread.join(timeout_s)
    futures.wait(list(self._pending), timeout=timeout_s)
    self._pool.shutdown(wait=False)
    return self.timeline()

  def timeline(self) -> StreamResult:
    """What landed so far (``close`` waits for the rest first)."""
    with self._lock:
      records = tuple(self._records[i] for i in sorted(self._records))
      point = self._commit_point
    firsts = [r.first_byte_s for r in records if r.first_byte_s is not None]
    commits = [r.committed_s for r in records if r.ok and r.committed_s is not None]
    options = getattr(self.sender, "options", None)
    return StreamResult(self.request_id, self.prompt_len, point, records,
                        min(firsts) if firsts else None, max(commits) if commits else None,
                        num_streams=int(getattr(options, "num_streams", 0) or 0))

  def abort(self) -> None:
    """Region A goes away: nothing more is sent (open segments are aborted)."""
    self._aborted = True

