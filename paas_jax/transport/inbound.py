"""What the receiving side keeps per transfer: options, what Begin announced,
the in-progress transfer's verified objects and restores (``Inbound``), the
state handed over (``ReceivedState``), and the failure types the receiver's
RPCs and data plane turn into status codes."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from concurrent import futures
from typing import Any, Callable

import grpc

from paas_jax.codec import layout
from paas_jax.codec.decode import (RestoreTemplate, ShardingsLike, restore_from_store,
                                   restore_indexed_group)
from paas_jax.codec import manifest as manifest_lib
from paas_jax.codec.manifest import GLOBAL_LAYER_INDEX, LayerEntry, StateManifest, splice_groups
from paas_jax.codec.options import CodecOptions
from paas_jax.codec.store import MemoryStore
from paas_jax.transport import channels
from paas_jax.transport.timeline import ReceiveTimeline


@dataclasses.dataclass(frozen=True)
class ReceiverOptions:
  """Limits of the decode side.

  Attributes:
    byte_budget: encoded bytes all in-progress transfers may hold together;
      Begin (or a chunk past the reservation) beyond it gets RESOURCE_EXHAUSTED.
    max_message_bytes: largest gRPC message accepted.
    transfer_timeout_s: a transfer not committed this long after Begin fails
      with DEADLINE_EXCEEDED.
    idle_timeout_s: ... likewise when no frame arrived for this long (a hung
      sender that keeps its connection open).
    max_chunk_attempts: a chunk failing verification this many times fails
      the transfer with DATA_LOSS.
    restore_workers: threads restoring completed layers during the transfer.
    reap_interval_s: how often deadlines are checked.
    failures_kept: recent failed transfer ids remembered for late RPCs.
  """

  byte_budget: int = 4 << 30
  max_message_bytes: int = channels.DEFAULT_MAX_MESSAGE_BYTES
  transfer_timeout_s: float = 600.0
  idle_timeout_s: float = 30.0
  max_chunk_attempts: int = 4
  restore_workers: int = 2
  reap_interval_s: float = 0.1
  failures_kept: int = 1024


@dataclasses.dataclass(frozen=True)
class TransferInfo:
  """What Begin announced."""

  transfer_id: str
  model_id: str
  config_fingerprint: str
  num_layers: int
  token_count: int
  codec: CodecOptions
  peer: str
  sender_id: str = ""  # BeginRequest.sender_id: the sending StateSender ("" unknown)


class SenderClock:
  """When a frame of any transfer of one sender last arrived (monotonic).

  A sender's transfers share its connections: one queued behind another's bytes
  on a slow link gets no frame for a while although the sender is alive. The
  receiver's idle timeout therefore runs on the sender's clock (``Inbound
  .idle_since``), not on each transfer's own.
  """

  __slots__ = ("last", "__weakref__")

  def __init__(self, now: float):
    self.last = now


# (template state, shardings) for a transfer: e.g.
# lambda info: (abstract_state(cfg, 1, round_up(info.token_count + max_new)), None)
TemplateFn = Callable[[TransferInfo], tuple[Any, ShardingsLike]]


@dataclasses.dataclass
class ReceivedState:
  """A complete, verified state handed to the decode side.

  Attributes:
    info: what Begin announced.
    manifest: the committed manifest.
    state: the restored state when the receiver has a template, else None.
    store: the verified encoded objects when it has none (restore with
      ``restore``), else None.
    timeline: the receiving side's timeline.
  """

  info: TransferInfo
  manifest: StateManifest
  state: Any | None
  store: MemoryStore | None
  timeline: ReceiveTimeline

  def restore(self, like: Any, shardings: ShardingsLike = None) -> Any:
    """Restores into ``like`` (and drops the encoded objects)."""
    if self.state is not None:
      return self.state
    if self.store is None:
      raise RuntimeError("state already restored or released")
    try:
      return restore_from_store(self.store, self.manifest, like, shardings)
    finally:
      self.release()

  def release(self) -> None:
    if self.store is not None:
      self.store.close()
      self.store = None


class TransferFailed(Exception):
  """Fails the whole transfer with this status."""

  def __init__(self, code: grpc.StatusCode, message: str):
    self.code, self.message = code, message
    super().__init__(message)


class RpcRefused(TransferFailed):
  """Refuses one RPC but leaves the transfer as it is."""


def restore_layer(t: "Inbound", store: MemoryStore, entry: LayerEntry, like: Any,
                   shardings: ShardingsLike) -> dict[str, Any]:
  """``restore_group``, reusing the transfer's indexed template."""
  cached = t.template_index
  if cached is None or cached[0] is not like or cached[1] is not shardings:
    cached = (like, shardings, RestoreTemplate(like, shardings))
    t.template_index = cached
  return restore_indexed_group(store, entry, cached[2])


class Inbound:
  """One transfer in progress. Guarded by its own lock (chunk handling) and
  by the receiver's lock (registry and budget)."""

  def __init__(self, info: TransferInfo, template, now: float, deadline: float):
    self.info = info
    self.begin_request = None  # the BeginRequest it began with (a repeated BEGIN's check)
    self.template = template  # (like, shardings) or None
    self.lock = threading.Lock()
    self.begin_s = time.time()  # wall clock, for timelines
    self.deadline = deadline  # monotonic
    self.last_activity = now
    # Shared by the open transfers of one sender (None: the sender gave no id).
    self.sender_clock: SenderClock | None = None
    self.status = "open"  # open | committing | done | failed
    self.reserved = 0
    self.held = 0
    self.descriptors: dict[int, LayerEntry] = {}
    # Each adopted descriptor's (parsed JSON, text): Commit's manifest reuses a
    # layer whose JSON equals it instead of parsing it again
    # (``manifest_from_descriptors``).
    self.descriptor_json: dict[int, tuple[dict, str]] = {}
    self.expected: dict[int, dict[str, int]] = {}  # layer -> key -> crc32c
    self.verified: dict[str, tuple[int, int]] = {}  # key -> (layer, crc32c)
    self.pending: dict[str, bytes] = {}
    self.flushed: set[int] = set()
    self.store: MemoryStore | None = MemoryStore()
    self.restores: dict[int, futures.Future] = {}
    # (like, shardings, RestoreTemplate): the template indexed by leaf name once per
    # transfer rather than once per restored layer.
    self.template_index: tuple | None = None
    self.attempts: collections.Counter = collections.Counter()
    self.first_byte: float | None = None
    self.last_byte: float | None = None
    self.bytes_received = 0
    self.chunks_received = 0
    self.rejected = 0
    self.layers_complete: dict[int, float] = {}

  def touch(self, now: float) -> None:
    """A frame of this transfer arrived: it, and its sender, are alive."""
    self.last_activity = now
    clock = self.sender_clock
    if clock is not None:
      clock.last = now

  def idle_since(self) -> float:
    """The later of this transfer's and its sender's last frame (monotonic)."""
    clock = self.sender_clock
    return self.last_activity if clock is None else max(self.last_activity, clock.last)

  def timeline(self, status: str, ready: float | None = None) -> ReceiveTimeline:
    return ReceiveTimeline(
        transfer_id=self.info.transfer_id, status=status, begin_s=self.begin_s,
        first_byte_s=self.first_byte, last_byte_s=self.last_byte, ready_s=ready,
        bytes_received=self.bytes_received, chunks_received=self.chunks_received,
        rejected_chunks=self.rejected, layers_complete_s=dict(self.layers_complete))


def manifest_from_descriptors(text: str, t: "Inbound") -> StateManifest | None:
  """Commit's manifest without parsing its layers again, when it is what a
  sender that splices its descriptors' texts sends (``StateManifest.to_json``
  with ``serialized``): the header's JSON, then exactly the texts of the
  descriptors this transfer adopted. Only the header is parsed; the groups
  are the adopted entries. None where the text is anything else (the caller
  parses it in full): text equality is stricter than the parsed-JSON
  equality the full parse checks.

  Why the split is sound: if ``head + "}"`` is a JSON object on its own, the
  tail after it sits at the top level of the whole text (a string or object
  left open in ``head`` would make ``head + "}"`` invalid), so parsing the
  whole text gives the same header plus these groups."""
  with t.lock:
    parsed = dict(t.descriptor_json)
    entries = dict(t.descriptors)
  n = t.info.num_layers
  if len(parsed) != n + 1 or any(i not in parsed for i in range(GLOBAL_LAYER_INDEX, n)):
    return None
  tail = splice_groups([parsed[i][1] for i in range(n)], parsed[GLOBAL_LAYER_INDEX][1])
  if len(text) <= len(tail) or not text.endswith(tail):
    return None
  try:
    head = manifest_lib.loads(text[:len(text) - len(tail)] + "}")
  except ValueError:
    return None
  if not isinstance(head, dict) or "layers" in head or "state_arrays" in head:
    return None
  head["layers"] = [parsed[i][0] for i in range(n)]
  head["state_arrays"] = parsed[GLOBAL_LAYER_INDEX][0]
  # The same dicts as ``known``: from_dict's equality check is then trivial.
  known = {i: (raw, entries[i]) for i, (raw, _) in parsed.items()}
  return StateManifest.from_dict(head, known)


def check_descriptor(t: "Inbound", entry: LayerEntry, layer_index: int,
                     like_layers=None) -> None:
  """A descriptor fits the transfer Begin announced (and the decode model's
  layer kinds when there is a template; ``like_layers``: the template's
  layers if the caller split it already, for many descriptors at once).
  Raises TransferFailed."""
  if entry.index != layer_index:
    raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                         f"descriptor of layer {entry.index} sent as layer {layer_index}")
  if not GLOBAL_LAYER_INDEX <= entry.index < t.info.num_layers:
    raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, f"layer {entry.index} outside the "
                         f"{t.info.num_layers} layers announced by Begin")
  if t.template is not None and entry.index != GLOBAL_LAYER_INDEX:
    if like_layers is None:
      like_layers, _ = layout.split_state(t.template[0])
    want = layout.layer_kind(like_layers[entry.index])
    if want != entry.kind:
      raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, f"layer {entry.index} is "
                           f"{entry.kind} at the sender but {want} in the decode model")


def location(layer: int, key: str) -> str:
  where = "state-level arrays" if layer == GLOBAL_LAYER_INDEX else f"layer {layer}"
  return f"{where}, chunk {key!r}"
