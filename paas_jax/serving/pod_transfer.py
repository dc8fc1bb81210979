"""Shard-to-shard state transfer from a prefill pod (P processes) to a decode
slice (Q processes), never through one host.

Prefill side, in every pod process after ``pod.region_prefill``::

  groups = list(codec.encode_groups(state))          # only this process's shards
  manifest = exchange_manifests(groups, ...)         # the pod's merged manifest
  plan = shard_plan.plan_transfer(manifest, source, target)
  send_shards(groups, plan, ...)                     # to each slice process

Each pod process opens one ``StateSender`` transfer per slice process
(``transfer_id = pod:<request>:<s>-><t>``) carrying exactly the objects the
plan routes from it to that process, plus a small state-level array
``pod_envelope`` (uint8 JSON: the merged manifest with both placements, the
first generated token, the pod's process count). A slice process
(``collect`` then ``restore``) waits for one transfer per pod process,
recomputes and checks the plan from the envelope, refuses unless it received
exactly the objects the plan routes to it (same sizes and crc32c as the
merged manifest), and restores its own shards in place
(``make_array_from_callback`` reads only the boxes its devices hold).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import time
from typing import Any, Sequence

import numpy as np

from paas_jax.codec.decode import restore_from_store
from paas_jax.codec.encode import EncodedGroup, build_manifest, encode_state_arrays
from paas_jax.codec.errors import IncompleteStateError
from paas_jax.codec.manifest import (GLOBAL_LAYER_INDEX, LayerEntry, StateManifest,
                                     merge_manifests)
from paas_jax.codec.options import CodecOptions
from paas_jax.codec.shard_plan import (ShardPlan, ShardPlanError, StatePlacement, check_plan,
                                       plan_transfer)
from paas_jax.codec.store import MemoryStore
from paas_jax.transport.receiver import ReceivedState, StateReceiver
from paas_jax.transport.sender import SenderOptions, StateSender

ENVELOPE = "pod_envelope"


def transfer_id(request_id: str, source: int, target: int) -> str:
  return f"pod:{request_id}:{source}->{target}"


@dataclasses.dataclass(frozen=True)
class Envelope:
  """What every pod process tells every slice process besides the shards.

  Attributes:
    manifest: the pod's merged manifest, ``placements`` set to both meshes.
    first_token: the token sampled from the prefill logits.
    source_processes: P; the slice waits for one transfer from each.
  """

  manifest: StateManifest
  first_token: int
  source_processes: int

  @property
  def source(self) -> StatePlacement:
    return StatePlacement.from_dict(self.manifest.placements["source"])

  @property
  def target(self) -> StatePlacement:
    return StatePlacement.from_dict(self.manifest.placements["target"])

  def to_array(self) -> np.ndarray:
    data = json.dumps({"manifest": self.manifest.to_dict(), "first_token": self.first_token,
                       "source_processes": self.source_processes}, sort_keys=True)
    return np.frombuffer(data.encode(), np.uint8)

  @classmethod
  def from_array(cls, data: np.ndarray) -> "Envelope":
    d = json.loads(np.asarray(data, np.uint8).tobytes())
    return cls(StateManifest.from_dict(d["manifest"]), int(d["first_token"]),
               int(d["source_processes"]))


def partial_manifest(groups: Sequence[EncodedGroup], *, model_id: str,
                     config_fingerprint: str, token_count: int, batch: int,
                     options: CodecOptions) -> StateManifest:
  """The manifest of the objects one pod process encoded."""
  return build_manifest([g.entry for g in groups], model_id=model_id,
                        config_fingerprint=config_fingerprint, token_count=token_count,
                        batch=batch, options=options)


def exchange_manifests(mine: StateManifest, *, key: str, process_id: int,
                       num_processes: int, timeout_s: float, kv: Any) -> StateManifest:
  """Publishes this process's partial manifest and merges everyone's.

  ``kv`` is the region's key-value store (``jax.distributed``'s client:
  ``key_value_set`` / ``blocking_key_value_get(key, timeout_ms)``), so a dead
  peer fails this call after ``timeout_s`` rather than hanging it.
  """
  kv.key_value_set(f"{key}/{process_id}", mine.to_json())
  parts = []
  for p in range(num_processes):
    if p == process_id:
      parts.append(mine)
      continue
    try:
      data = kv.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000))
    except Exception as e:  # The client raises XlaRuntimeError on its deadline.
      raise TimeoutError(f"pod process {p} published no manifest for {key} within "
                         f"{timeout_s:.0f}s: {e}") from e
    parts.append(StateManifest.from_json(data))
  return merge_manifests(parts)


def _only(entry: LayerEntry, keys: set[str]) -> LayerEntry:
  arrays = tuple(dataclasses.replace(a, chunks=tuple(c for c in a.chunks if c.key in keys))
                 for a in entry.arrays)
  return dataclasses.replace(entry, arrays=arrays)


def routed_groups(groups: Sequence[EncodedGroup], plan: ShardPlan, source: int, target: int,
                  envelope: Envelope) -> list[EncodedGroup]:
  """The objects ``plan`` routes from ``source`` to ``target`` as encoded groups
  (every group kept, possibly with metadata only), the envelope added to the
  state-level group.

  Raises:
    ShardPlanError: the plan routes an object this process did not encode.
  """
  keys = {r.key for r in plan.routes if r.source == source and r.target == target}
  have = {k for g in groups for k in g.blobs}
  if keys - have:
    raise ShardPlanError(f"plan routes objects from process {source} that it does not "
                         f"hold: {sorted(keys - have)[:4]}")
  out = []
  for g in groups:
    entry = _only(g.entry, keys)
    blobs = {k: v for k, v in g.blobs.items() if k in keys}
    if entry.index == GLOBAL_LAYER_INDEX:
      env = encode_state_arrays([(ENVELOPE, envelope.to_array())])
      entry = dataclasses.replace(entry, arrays=entry.arrays + env.entry.arrays)
      blobs.update(env.blobs)
    out.append(EncodedGroup(entry=entry, blobs=blobs))
  return out


@dataclasses.dataclass(frozen=True)
class SentReport:
  """What one pod process sent to one slice process."""

  target: int
  keys: tuple[str, ...]   # state objects (the envelope excluded)
  planned_bytes: int      # their bytes per the plan
  wire_bytes: int         # chunk payload bytes on the wire, envelope included
  seconds: float


def send_shards(groups: Sequence[EncodedGroup], plan: ShardPlan, envelope: Envelope, *,
                source: int, targets: Sequence[str], request_id: str, model_id: str,
                config_fingerprint: str, options: SenderOptions = SenderOptions()
                ) -> list[SentReport]:
  """Sends this pod process's routed objects to every slice process
  (``targets[t]`` is slice process t's StateTransfer address)."""
  manifest = envelope.manifest
  reports = []
  for t, address in enumerate(targets):
    sent = routed_groups(groups, plan, source, t, envelope)
    t0 = time.perf_counter()
    with StateSender(address, options=options) as sender:
      with sender.begin(model_id=model_id, config_fingerprint=config_fingerprint,
                        num_layers=len(manifest.layers), token_count=manifest.token_count,
                        batch=manifest.batch, codec=manifest.codec,
                        transfer_id=transfer_id(request_id, source, t)) as tx:
        for g in sent:
          tx.send_encoded(g)
        result = tx.finish()
    keys = tuple(sorted(r.key for r in plan.routes if r.source == source and r.target == t))
    reports.append(SentReport(
        target=t, keys=keys,
        planned_bytes=sum(r.nbytes for r in plan.routes
                          if r.source == source and r.target == t),
        wire_bytes=result.timeline.bytes_sent, seconds=time.perf_counter() - t0))
  return reports


@dataclasses.dataclass
class Collected:
  """The transfers one slice process received for one request."""

  envelope: Envelope
  store: MemoryStore
  received: dict[str, Any]  # key -> ChunkEntry as the senders listed it
  wire_bytes: int


def _envelope_of(rs: ReceivedState) -> Envelope:
  entry = rs.manifest.state_arrays.array(ENVELOPE)
  blobs = {c.key: rs.store.get(c.key) for c in entry.chunks}
  store = MemoryStore()
  store.put_many(blobs)
  try:
    like = {ENVELOPE: np.zeros(entry.shape, np.uint8)}
    manifest = dataclasses.replace(
        rs.manifest, layers=(), state_arrays=dataclasses.replace(
            rs.manifest.state_arrays, arrays=(entry,)))
    return Envelope.from_array(restore_from_store(store, manifest, like)[ENVELOPE])
  finally:
    store.close()


def parse_transfer_id(tid: str) -> tuple[str, int, int]:
  """``pod:<request>:<source>-><target>`` -> (request, source, target).

  Raises:
    ShardPlanError: not a pod transfer id.
  """
  body, _, dst = tid.rpartition("->")
  head, _, src = body.rpartition(":")
  if not tid.startswith("pod:") or not head.startswith("pod:") or not src.isdigit() \
      or not dst.isdigit():
    raise ShardPlanError(f"not a pod transfer id: {tid!r}")
  return head[len("pod:"):], int(src), int(dst)


def is_pod_transfer(tid: str) -> bool:
  return tid.startswith("pod:")


class PodParts:
  """The transfers of one request that one slice process has received so far
  (one per pod process; ``complete`` once every pod process's arrived)."""

  def __init__(self, request_id: str, target: int):
    self.request_id = request_id
    self.target = target
    self.store = MemoryStore()
    self.received: dict[str, Any] = {}
    self.sources: dict[int, Envelope] = {}
    self.wire = 0
    self.updated = time.monotonic()

  @property
  def expected(self) -> int | None:
    return next(iter(self.sources.values())).source_processes if self.sources else None

  @property
  def complete(self) -> bool:
    return self.expected is not None and len(self.sources) >= self.expected

  def missing(self) -> list[int]:
    return sorted(set(range(self.expected or 1)) - set(self.sources))

  def add(self, rs: ReceivedState) -> None:
    """Takes one verified transfer's objects (and releases ``rs``).

    Raises:
      ShardPlanError: a transfer of another request or target, or a duplicate.
    """
    try:
      tid = rs.info.transfer_id
      request, src, dst = parse_transfer_id(tid)
      if request != self.request_id or dst != self.target:
        raise ShardPlanError(f"slice process {self.target} got transfer {tid!r}, expected "
                             f"{transfer_id(self.request_id, '<source>', self.target)!r}")
      if src in self.sources:
        raise ShardPlanError(f"two transfers from pod process {src} for {request}")
      envelope = _envelope_of(rs)
      self.sources[src] = envelope
      self.wire += rs.timeline.bytes_received
      blobs = {}
      for group in rs.manifest.groups:
        for array, chunk in group.chunks():
          if array.name == ENVELOPE:
            continue
          self.received[chunk.key] = chunk
          blobs[chunk.key] = rs.store.get(chunk.key)
      self.store.put_many(blobs)
      self.updated = time.monotonic()
    finally:
      rs.release()

  def collected(self) -> Collected:
    """The parts as one ``Collected`` (the store moves into it).

    Raises:
      ShardPlanError: the pod processes sent different envelopes.
    """
    first = next(iter(self.sources.values()))
    if any(e != first for e in self.sources.values()):
      raise ShardPlanError(f"pod processes sent different envelopes for {self.request_id}")
    return Collected(first, self.store, self.received, self.wire)

  def close(self) -> None:
    self.store.close()


def collect(receiver: StateReceiver, request_id: str, target: int, timeout_s: float
            ) -> Collected:
  """Waits (at most ``timeout_s``) for one transfer of ``request_id`` from each
  pod process; returns their objects in one store.

  Raises:
    TimeoutError: a pod process's transfer did not arrive in time.
    ShardPlanError: a transfer of another request, or a duplicate.
  """
  deadline = time.monotonic() + timeout_s
  parts = PodParts(request_id, target)
  while not parts.complete:
    left = deadline - time.monotonic()
    try:
      rs = receiver.ready.get(timeout=max(0.0, left))
    except queue.Empty:
      raise TimeoutError(f"slice process {target}: transfers of request {request_id} from "
                         f"pod processes {parts.missing()} did not arrive within "
                         f"{timeout_s:.0f}s") from None
    parts.add(rs)
  return parts.collected()


def verify_collected(collected: Collected, target: int, placement: StatePlacement
                     ) -> ShardPlan:
  """Recomputes the plan from the envelope and checks this slice process holds
  exactly what it routes here, byte for byte as the merged manifest lists it.

  Raises:
    ShardPlanError: the pod planned for another target placement, or the plan is bad.
    IncompleteStateError: objects missing, extra, or different from the manifest.
  """
  env = collected.envelope
  if env.target != placement:
    raise ShardPlanError(f"the pod planned for target placement {env.target.to_dict()}, "
                         f"this slice is {placement.to_dict()}")
  plan = plan_transfer(env.manifest, env.source, env.target)
  check_plan(plan, env.manifest)
  expected = plan.keys_to(target)
  got = set(collected.received)
  listed = env.manifest.chunk_index()
  wrong = sorted(k for k in got & expected if collected.received[k] != listed[k][2])
  if expected != got or wrong:
    raise IncompleteStateError(
        f"slice process {target}: missing {sorted(expected - got)[:6]}, unexpected "
        f"{sorted(got - expected)[:6]}, differing from the manifest {wrong[:6]}; "
        "refusing to restore")
  return plan


def restore(collected: Collected, target: int, placement: StatePlacement, like: Any,
            shardings: Any) -> Any:
  """Verifies (``verify_collected``) and restores this slice process's shards
  into ``like`` placed by ``shardings`` (a pytree of global shardings)."""
  verify_collected(collected, target, placement)
  manifest = dataclasses.replace(collected.envelope.manifest, placements=None)
  try:
    return restore_from_store(collected.store, manifest, like, shardings)
  finally:
    collected.store.close()
