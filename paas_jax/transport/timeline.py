"""Per-transfer timelines that the scheduler reads.

Timestamps are wall-clock seconds (``time.time()``) so that sender and
receiver timelines of the same transfer can be laid side by side; durations
are differences of those.
"""

from __future__ import annotations

import dataclasses
import threading
import time


@dataclasses.dataclass(frozen=True)
class LayerTiming:
  """One layer on the sending side.

  Attributes:
    index: layer index (-1: state-level arrays).
    submitted_s: the layer was handed to the sender (prefill produced it).
    encoded_s: its objects were encoded and queued.
    first_sent_s, last_sent_s: its first / last frame was handed to gRPC.
    nbytes: encoded bytes of the layer.
    chunks: stored objects of the layer.
  """

  index: int
  submitted_s: float
  encoded_s: float | None = None
  first_sent_s: float | None = None
  last_sent_s: float | None = None
  nbytes: int = 0
  chunks: int = 0


@dataclasses.dataclass(frozen=True)
class TransferTimeline:
  """What one transfer cost, as seen by the sender.

  Attributes:
    transfer_id: id shared with the receiver.
    status: "running", "ok", or the gRPC status name it failed with.
    start_s: before the Begin RPC.
    end_s: Commit acknowledged (or the failure), None while running.
    state_bytes: encoded bytes of the state (each object once).
    bytes_sent: payload bytes put on the wire, resends included.
    chunks_sent: frames carrying an object, resends included.
    resent_chunks: objects sent again after a rejection or a Commit miss.
    num_streams, num_connections: parallelism used.
    first_byte_s, last_byte_s: first / last payload frame handed to gRPC.
    receiver_ready_s: seconds from Begin to a restored state at the receiver.
    peak_queued_bytes: high-water mark of the flow-control queue.
    layers: per-layer timings in submission order.
  """

  transfer_id: str
  status: str
  start_s: float
  end_s: float | None
  state_bytes: int
  bytes_sent: int
  chunks_sent: int
  resent_chunks: int
  num_streams: int
  num_connections: int
  first_byte_s: float | None
  last_byte_s: float | None
  receiver_ready_s: float | None
  peak_queued_bytes: int
  layers: tuple[LayerTiming, ...]

  @property
  def duration_s(self) -> float | None:
    return None if self.end_s is None else self.end_s - self.start_s

  @property
  def goodput_bytes_per_s(self) -> float | None:
    """State bytes delivered per second of the whole transfer (Begin to Commit)."""
    d = self.duration_s
    return None if not d else self.state_bytes / d

  @property
  def wire_bytes_per_s(self) -> float | None:
    """Payload bytes per second while frames were flowing."""
    if self.first_byte_s is None or self.last_byte_s is None:
      return None
    span = self.last_byte_s - self.first_byte_s
    return None if span <= 0 else self.bytes_sent / span

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["duration_s"] = self.duration_s
    d["goodput_bytes_per_s"] = self.goodput_bytes_per_s
    d["wire_bytes_per_s"] = self.wire_bytes_per_s
    return d


class _LayerRecord:
  """The mutable side of one ``LayerTiming``: updated in place per event (a
  frozen LayerTiming rebuilt per event was a visible part of a tiny
  transfer's cost); ``snapshot`` freezes it."""

  __slots__ = ("index", "submitted_s", "encoded_s", "first_sent_s", "last_sent_s", "nbytes",
               "chunks")

  def __init__(self, index: int, submitted_s: float):
    self.index, self.submitted_s = index, submitted_s
    self.encoded_s = self.first_sent_s = self.last_sent_s = None
    self.nbytes = self.chunks = 0

  def frozen(self) -> LayerTiming:
    return LayerTiming(index=self.index, submitted_s=self.submitted_s, encoded_s=self.encoded_s,
                       first_sent_s=self.first_sent_s, last_sent_s=self.last_sent_s,
                       nbytes=self.nbytes, chunks=self.chunks)


class TimelineRecorder:
  """Thread-safe mutable side of a ``TransferTimeline``."""

  def __init__(self, transfer_id: str, num_streams: int, num_connections: int):
    self._lock = threading.Lock()
    self._transfer_id = transfer_id
    self._num_streams = num_streams
    self._num_connections = num_connections
    self._start = time.time()
    self._end: float | None = None
    self._status = "running"
    self._state_bytes = 0
    self._bytes_sent = 0
    self._chunks_sent = 0
    self._resent = 0
    self._first_byte: float | None = None
    self._last_byte: float | None = None
    self._ready: float | None = None
    self._peak_queued = 0
    self._layers: dict[int, _LayerRecord] = {}

  def layer_submitted(self, index: int) -> None:
    with self._lock:
      self._layers[index] = _LayerRecord(index, time.time())

  def layer_encoded(self, index: int, nbytes: int, chunks: int) -> None:
    now = time.time()
    with self._lock:
      timing = self._layers.get(index)
      if timing is None:
        timing = self._layers[index] = _LayerRecord(index, now)
      timing.encoded_s, timing.nbytes, timing.chunks = now, nbytes, chunks
      self._state_bytes += nbytes

  def frame_sent(self, layer_index: int, nbytes: int, is_chunk: bool, resend: bool,
                 chunks: int = 1) -> None:
    """``chunks``: objects in ``nbytes`` (a layer's share of a BUNDLE frame)."""
    now = time.time()
    with self._lock:
      if is_chunk:
        self._bytes_sent += nbytes
        self._chunks_sent += chunks
        self._resent += chunks if resend else 0
        if self._first_byte is None:
          self._first_byte = now
        self._last_byte = now
      timing = self._layers.get(layer_index)
      if timing is not None and not resend:
        timing.first_sent_s = timing.first_sent_s or now
        timing.last_sent_s = now

  def queue_peak(self, peak: int) -> None:
    with self._lock:
      self._peak_queued = max(self._peak_queued, peak)

  def finished(self, status: str, receiver_ready_s: float | None = None) -> None:
    with self._lock:
      if self._end is None:
        self._end = time.time()
        self._status = status
        self._ready = receiver_ready_s

  def snapshot(self) -> TransferTimeline:
    with self._lock:
      return TransferTimeline(
          transfer_id=self._transfer_id, status=self._status, start_s=self._start,
          end_s=self._end, state_bytes=self._state_bytes, bytes_sent=self._bytes_sent,
          chunks_sent=self._chunks_sent, resent_chunks=self._resent,
          num_streams=self._num_streams, num_connections=self._num_connections,
          first_byte_s=self._first_byte, last_byte_s=self._last_byte,
          receiver_ready_s=self._ready, peak_queued_bytes=self._peak_queued,
          layers=tuple(record.frozen() for record in self._layers.values()))


@dataclasses.dataclass(frozen=True)
class ReceiveTimeline:
  """What one transfer cost, as seen by the receiver.

  Attributes:
    begin_s: Begin accepted. first_byte_s / last_byte_s: first / last chunk
    stored. ready_s: state restored and handed over. bytes_received: payload
    bytes that passed verification. rejected_chunks: frames dropped on
    arrival. layers_complete_s: layer index -> all its objects verified.
  """

  transfer_id: str
  status: str
  begin_s: float
  first_byte_s: float | None
  last_byte_s: float | None
  ready_s: float | None
  bytes_received: int
  chunks_received: int
  rejected_chunks: int
  layers_complete_s: dict[int, float]

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)
