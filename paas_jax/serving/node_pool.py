"""The broker's nodes: PrfaaS prefill servers and PD nodes, with their channels,
health, in-flight load, roles and drains.

The broker asks the pool, never the nodes' bookkeeping directly:

* ``pick(kind)`` / ``release(kind, i)``: the least loaded healthy node of a
  ``NodeKind`` (a PrfaaS prefill server, a PD node serving decode, a PD node
  serving PD-P prefill) and the end of the work it was picked for; a
  preference for nodes holding a cached prefix yields to load past the
  pool's ``AffinityBalance``;
* health: every node is probed (``HealthMonitor``, over the same channels the
  requests use); ``mark_down`` takes a node whose connection broke out of
  picking until a probe succeeds again;
* roles: ``set_roles`` moves PD nodes between PD-P / PD-D / both; a moving
  node drains first (the pure rules live in ``pd_roles``), and ``release``
  completes the moves whose old-role work has drained;
* shapes: each PD node's ``pd_roles.NodeShape`` (a single decode process, or
  a decode slice: ``DecodeTarget.shape``) bounds its roles and which nodes a
  PD-P split may pair (``pick(PDP, to=...)``, ``colocated``): a slice is
  never fed a whole state by another node and never prefills for one;
* reported load: ``observe_load`` keeps each node's latest typed ``GetLoad``
  report (``NodeLoad``: queue, decode slots; the live view's polls feed it),
  shown next to the broker's own in-flight count in ``roles_info`` /
  ``reported_load``. Picking still counts only the broker's in-flight work
  (what it routed and has not seen finish), so routes do not depend on poll
  timing.

Thread-safe: one lock guards load and roles.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import threading
import time
from typing import Collection, Sequence

import grpc

from paas_jax.observability.health import FAST_RECONNECT, HealthMonitor
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import common
from paas_jax.serving import pd_roles

log = logging.getLogger("paas_jax.serving.broker")


@dataclasses.dataclass(frozen=True)
class AffinityBalance:
  """When a prefix-cache preference yields to load.

  A node preferred only because its prefix cache holds the prompt's prefix
  (``pick(..., soft=True)``) is passed over for the least loaded qualifying
  node once it carries more than ``abs_load`` more in-flight requests than
  that node *and* more than ``rel_load`` times as many: a hot prefix must
  not pile every request sharing it onto one node while others idle (the
  same two-threshold rule as SGLang's cache-aware router). A hard
  preference (a commit point to resume from, a prefix shipped for this very
  request) never yields.
  """

  abs_load: int = 4
  rel_load: float = 2.0

  def __post_init__(self):
    if self.abs_load < 0 or self.rel_load < 1.0:
      raise ValueError(f"affinity balance needs abs_load >= 0 and rel_load >= 1, got "
                       f"{self.abs_load}, {self.rel_load}")

  def yields(self, preferred_load: int, least_load: int) -> bool:
    """Whether a preferred node with ``preferred_load`` in flight yields to a
    node with ``least_load``."""
    return (preferred_load - least_load > self.abs_load
            and preferred_load > self.rel_load * least_load)


@dataclasses.dataclass(frozen=True)
class DecodeTarget:
  """A decode server: its control address (from the broker) and the address of
  its StateTransfer port as the prefill region reaches it (e.g. via the WAN).

  A decode slice of several processes (``slice_decode_server``) takes state on
  every process: ``slice`` lists their StateTransfer addresses as region A
  dials them (``transfer`` is the first), ``slice_devices`` the devices each
  owns; ``with_slice`` fills them from what the node announces."""

  control: str
  transfer: str
  # Its StateTransfer address inside region B (PD-P node -> PD-D node states
  # never cross the WAN relay); empty: same as ``transfer``.
  local_transfer: str = ""
  slice: tuple[str, ...] = ()
  slice_devices: int = 0

  @property
  def intra_transfer(self) -> str:
    return self.local_transfer or self.transfer

  @property
  def shape(self) -> pd_roles.NodeShape:
    """What the node can take and serve (``pd_roles``): a slice once
    ``with_slice`` (or a ``+`` list) said it is one."""
    return pd_roles.SLICE if self.slice else pd_roles.SINGLE

  @property
  def decode_slice(self) -> serving_pb2.DecodeSlice | None:
    """``PrefillRequest.decode_slice`` for this node (None: one decode process)."""
    if not self.slice:
      return None
    return serving_pb2.DecodeSlice(transfer_targets=list(self.slice),
                                   devices_per_process=self.slice_devices)

  @classmethod
  def parse(cls, control: str, transfer: str, local_transfer: str = "") -> "DecodeTarget":
    """From the broker's flags: ``transfer`` may list a slice's processes'
    addresses joined by ``+`` (by rank, as region A dials them)."""
    dial = tuple(a for a in transfer.split("+"))
    if not all(dial):
      raise ValueError(f"empty address in decode transfer entry {transfer!r}")
    return cls(control, dial[0], local_transfer, dial if len(dial) > 1 else ())

  def with_slice(self, announced: serving_pb2.DecodeSlice | None) -> "DecodeTarget":
    """This target once its node answered GetModel (``ServedModel.slice``;
    None or empty: a single decode process). Pure.

    A slice given one transfer address is dialled there for process 0 and
    at its own announced addresses for the others; given a ``+`` list, that
    list must have one address per slice process.

    Raises:
      ValueError: the node and the broker's entry disagree.
    """
    if announced is None or not announced.transfer_targets:
      if self.slice:
        raise ValueError(f"decode node {self.control} is one process, but its transfer "
                         f"entry lists {len(self.slice)} addresses")
      return self
    own = tuple(announced.transfer_targets)
    dial = self.slice or (self.transfer,) + own[1:]
    if len(dial) != len(own):
      raise ValueError(f"decode node {self.control} is a slice of {len(own)} processes, "
                       f"but its transfer entry lists {len(dial)} addresses")
    if announced.devices_per_process < 1:
      raise ValueError(f"decode slice {self.control} announced "
                       f"{announced.devices_per_process} devices per process")
    return dataclasses.replace(self, slice=dial,
                               slice_devices=int(announced.devices_per_process))


class NodeKind(enum.StrEnum):
  """What a node is picked for (the in-flight load is counted per kind)."""

  PREFILL = "prefill"  # a PrfaaS prefill server (region A)
  DECODE = "decode"    # a PD node decoding (colocated requests included)
  PDP = "pdp"          # a PD node prefilling for another PD node (PD-P)


@dataclasses.dataclass(frozen=True)
class NodeLoad:
  """A node's latest ``LoadReport`` (``control_plane``), as the pool keeps it.

  prefill_queue: prompts waiting for a prefill batch (a PD node: its PD-P
  queue); decode_slots_busy / decode_slots_total / decode_waiting: a PD node's
  decode pool (0 on a prefill server); at: ``time.monotonic()`` of the report.
  """

  prefill_queue: int
  prefill_queue_limit: int
  decode_slots_total: int
  decode_slots_busy: int
  decode_waiting: int
  at: float

  @classmethod
  def from_report(cls, report, at: float) -> "NodeLoad":
    return cls(prefill_queue=report.prefill_queue_depth,
               prefill_queue_limit=report.prefill_queue_limit,
               decode_slots_total=report.decode_slots_total,
               decode_slots_busy=report.decode_slots_busy,
               decode_waiting=report.decode_waiting, at=at)


class NodePool:
  """Prefill servers and PD nodes; see the module docstring.

  ``counters``: the broker's counters (server_up/down, role_moves, ...).
  ``roles``: the PD nodes' starting roles (default:
  ``pd_roles.default_roles_for`` their shapes); checked against the shapes.
  ``affinity``: when a prefix-cache preference yields to load.
  """

  def __init__(self, prefill_targets: Sequence[str], decode_targets: Sequence[DecodeTarget], *,
               channel_credentials: grpc.ChannelCredentials | None = None,
               health_interval_s: float = 1.0, roles: Sequence[str] | None = None,
               counters: collections.Counter | None = None,
               affinity: AffinityBalance = AffinityBalance()):
    self.affinity = affinity
    if not decode_targets:
      raise ValueError("the broker needs at least one decode server")
    self.prefill_targets = list(prefill_targets)
    self.decode_targets = list(decode_targets)
    self.counters = counters if counters is not None else collections.Counter()
    self._channels = [common.make_channel(t, channel_credentials, FAST_RECONNECT)
                      for t in self.prefill_targets]
    self._channels += [common.make_channel(t.control, channel_credentials, FAST_RECONNECT)
                       for t in self.decode_targets]
    n_prefill = len(self.prefill_targets)
    self.prefill_stubs = [serving_pb2_grpc.PrefillStub(c) for c in self._channels[:n_prefill]]
    self.decode_stubs = [serving_pb2_grpc.DecodeStub(c) for c in self._channels[n_prefill:]]
    # Every PD node also serves Prefill (PD-P for another PD node), same channel.
    self.pdp_stubs = [serving_pb2_grpc.PrefillStub(c) for c in self._channels[n_prefill:]]
    # What each node can take and serve (a single process or a slice).
    self.shapes = tuple(t.shape for t in self.decode_targets)
    # One node: "both" (colocated PD-P + PD-D); more: a PD-P / PD-D split
    # of the nodes whose role may change (a slice is always "both").
    if roles is not None and len(roles) != len(self.decode_targets):
      raise ValueError(f"{len(roles)} roles for {len(self.decode_targets)} PD nodes")
    self._roles = tuple(pd_roles.NodeRole(r) for r in (
        pd_roles.check_roles(roles, self.shapes) if roles is not None
        else pd_roles.default_roles_for(self.shapes)))
    self.role_moves: collections.deque[dict] = collections.deque(maxlen=256)
    # Probed only once start() runs; until then every server counts as up.
    # Probes go over the same channels as the real calls: a server counts as
    # back only once the channel the requests will use has reconnected.
    addresses = self.prefill_targets + [t.control for t in self.decode_targets]
    self.health = HealthMonitor(addresses, credentials=channel_credentials,
                                interval_s=health_interval_s, on_change=self._on_health,
                                channels=dict(zip(addresses, self._channels)))
    self._lock = threading.Lock()
    self._load = collections.Counter()  # (NodeKind, index) -> in-flight work
    # (NodeKind.PREFILL | NodeKind.DECODE, index) -> latest NodeLoad (observe_load).
    self._reported: dict[tuple[NodeKind, int], NodeLoad] = {}
    # Round-robin start per kind: a PrfaaS request's prefill pick must not
    # step the decode picks' rotation (two kinds per request would otherwise
    # keep landing on the same parity of PD nodes).
    self._rr = {k: itertools.count() for k in NodeKind}

  def start(self) -> None:
    self.health.start()

  def close(self) -> None:
    self.health.stop()
    for c in self._channels:
      c.close()

  def _on_health(self, target: str, healthy: bool, reason: str) -> None:
    self.counters["server_up" if healthy else "server_down"] += 1

  # -- addresses and health -------------------------------------------------------

  def address(self, kind: NodeKind, index: int) -> str:
    return (self.prefill_targets[index] if kind == NodeKind.PREFILL
            else self.decode_targets[index].control)

  def healthy(self, kind: NodeKind, index: int) -> bool:
    return self.health.is_healthy(self.address(kind, index))

  def mark_down(self, kind: NodeKind, index: int, reason: str) -> None:
    """Its connection broke: out of picking until a health probe succeeds."""
    self.health.mark_down(self.address(kind, index), reason)

  def healthy_prefill(self, exclude=()) -> list[int]:
    return [i for i in range(len(self.prefill_targets))
            if i not in exclude and self.healthy(NodeKind.PREFILL, i)]

  def decode_index(self, control: str) -> int:
    """The PD node with control address ``control`` (-1: none)."""
    for i, t in enumerate(self.decode_targets):
      if t.control == control:
        return i
    return -1

  def other_decode_healthy(self, index: int) -> bool:
    """Whether a healthy PD node other than ``index`` exists (a restart target)."""
    return any(i != index and self.health.is_healthy(t.control)
               for i, t in enumerate(self.decode_targets))

  # -- picking --------------------------------------------------------------------

  def pick(self, kind: NodeKind, exclude=(), prefer: int | Collection[int] = -1,
           to: int | None = None, soft: bool = False) -> int | None:
    """The least loaded healthy node of ``kind`` not in ``exclude`` (None: none).

    PREFILL: a PrfaaS server; DECODE: a PD node serving decode (role pdd/both,
    not draining away from it), or, when none is healthy, any healthy PD node
    (colocated fallback), non-draining ones first; PDP: a PD node serving PD-P
    prefill (no fallback: the caller prefills colocated) whose shape serves
    Prefill to other nodes and, with ``to``, may hand a state to PD node
    ``to`` (``pd_roles.can_hand_off``). ``prefer``: a node, or nodes, taken
    whenever one qualifies (where a shipped prefix, a commit point or the
    longest cached prefix waits), the least loaded of them first; ``soft``
    (a prefix-cache preference): unless the pool's ``affinity`` says it
    yields to a less loaded node (counted as ``affinity_yielded``).
    Counts one unit of load on the node until ``release``.
    """
    kind = NodeKind(kind)
    n = len(self.prefill_targets) if kind == NodeKind.PREFILL else len(self.decode_targets)
    with self._lock:
      start = next(self._rr[kind])
      order = [(start + i) % n for i in range(n)]
      order = [i for i in order if i not in exclude
               and self.health.is_healthy(self.address(kind, i))]
      if kind == NodeKind.DECODE:
        order = ([i for i in order if pd_roles.DECODE in self._roles[i].serving]
                 or [i for i in order if not self._roles[i].draining] or order)
      elif kind == NodeKind.PDP:
        order = [i for i in order if pd_roles.PREFILL in self._roles[i].serving
                 and self.shapes[i].prefills_for_others
                 and (to is None or pd_roles.can_hand_off(self.shapes[i], self.shapes[to]))]
      if not order:
        return None
      preferred = {prefer} if isinstance(prefer, int) else set(prefer)
      load = lambda i: self._load[(kind, i)]
      best = min(order, key=load)
      chosen = [i for i in order if i in preferred]
      if chosen:
        best_preferred = min(chosen, key=load)
        if soft and self.affinity.yields(load(best_preferred), load(best)):
          self.counters["affinity_yielded"] += 1
        else:
          best = best_preferred
      self._load[(kind, best)] += 1
      return best

  def release(self, kind: NodeKind, index: int) -> None:
    kind = NodeKind(kind)
    with self._lock:
      self._load[(kind, index)] -= 1
      if kind != NodeKind.PREFILL:
        self._settle_roles_locked()

  def load(self, kind: NodeKind, index: int) -> int:
    with self._lock:
      return self._load[(NodeKind(kind), index)]

  def colocated(self, di: int) -> bool:
    """Whether PD node ``di`` prefills its own requests (one node, PD-P is
    among the capabilities it serves now, or it takes no whole state from
    another node: a slice prefills its own local requests)."""
    with self._lock:
      return self._colocated_locked(di)

  def _colocated_locked(self, di: int) -> bool:
    return (len(self.decode_targets) == 1 or pd_roles.PREFILL in self._roles[di].serving
            or not self.shapes[di].whole_state_in)

  def decode_nodes_reusing(self, holders: Collection[int]) -> set[int]:
    """The PD nodes whose local attempt would reuse a prefix cached on
    ``holders``: a holder that serves decode (it prefills colocated), and a
    decode node that does not prefill itself and that a holder serving PD-P
    may hand a state to (``pick(PDP, prefer=holders)`` then picks it)."""
    with self._lock:
      n, out = len(self.decode_targets), set()
      for h in holders:
        serving = self._roles[h].serving
        if pd_roles.DECODE in serving:
          out.add(h)
        if pd_roles.PREFILL in serving and self.shapes[h].prefills_for_others:
          out |= {i for i in range(n) if i != h and pd_roles.DECODE in self._roles[i].serving
                  and not self._colocated_locked(i)
                  and pd_roles.can_hand_off(self.shapes[h], self.shapes[i])}
      return out

  def decode_nodes_holding(self, holders: Collection[int]) -> set[int]:
    """The holders that serve decode and keep a remote request's cached prefix
    as its first commit segment (``state_intake``: region A then sends only
    the rest; a slice does not)."""
    with self._lock:
      return {h for h in holders if pd_roles.DECODE in self._roles[h].serving
              and self.shapes[h].commit_points}

  def prefix_importer_node(self, di: int) -> int:
    """The PD node whose PD-P prefix cache should get a prefix from region A:
    the decode node when it prefills colocated, else the PD-P node a pdp
    request would pick now (the least loaded healthy one). -1: the node
    that would prefill takes no shipped prefix (a decode slice: its own prefix
    cache serves only its local prefills)."""
    with self._lock:
      if self._colocated_locked(di):
        return di if self.shapes[di].ships_prefixes else -1
      nodes = [i for i in range(len(self.decode_targets)) if i != di
               and pd_roles.PREFILL in self._roles[i].serving
               and pd_roles.can_hand_off(self.shapes[i], self.shapes[di])
               and self.health.is_healthy(self.decode_targets[i].control)]
      return min(nodes, key=lambda i: self._load[(NodeKind.PDP, i)]) if nodes else di

  # -- PD node roles ----------------------------------------------------------------

  def _settle_roles_locked(self) -> None:
    """Completes the moves whose old-role work has drained (caller holds _lock).
    Decode work = decode streams (colocated requests included: they hold a
    slot); prefill work = PD-P prefills for other nodes, until their state
    transfer ended."""
    if not any(n.draining for n in self._roles):
      return
    inflight = {}
    for i in range(len(self._roles)):
      inflight[(i, pd_roles.DECODE)] = self._load[(NodeKind.DECODE, i)]
      inflight[(i, pd_roles.PREFILL)] = self._load[(NodeKind.PDP, i)]
    self._roles, done = pd_roles.settle(self._roles, inflight)
    now = time.time()
    for i in done:
      for m in reversed(self.role_moves):
        if m["index"] == i and m["completed"] is None:
          m["completed"], m["drain_s"] = now, now - m["time"]
          break
      self.counters["role_moves_completed"] += 1
      log.info("PD node %s now serves role %s", self.decode_targets[i].control,
               self._roles[i].role)

  def set_roles(self, roles: Sequence[str], reason: str = "operator") -> list:
    """Moves PD nodes to ``roles`` (one per node, in decode-target order).

    Returns the moves started (``pd_roles.RoleMove``). Each moving node drains
    first (module ``pd_roles``); ``role_moves`` records when it started and
    completed. Raises ``pd_roles.RoleError`` (nothing changes) for an unknown
    role, a wrong count, no node left to decode or a role the node's shape
    cannot hold (a slice's other than "both").
    """
    pd_roles.check_roles(roles, self.shapes)
    with self._lock:
      nodes, moves = pd_roles.begin_moves(self._roles, roles)
      self._roles = nodes
      now = time.time()
      for m in moves:
        self.role_moves.append({"time": now, "node": self.decode_targets[m.node].control,
                                "index": m.node, "from": m.from_role, "to": m.to_role,
                                "reason": reason, "completed": None, "drain_s": None})
        log.info("PD node %s: %s -> %s (%s)", self.decode_targets[m.node].control,
                 m.from_role, m.to_role, reason)
      self.counters["role_moves"] += len(moves)
      self._settle_roles_locked()
    return moves

  def roles(self) -> list[str]:
    """The role each PD node serves or is draining toward."""
    with self._lock:
      return [n.final for n in self._roles]

  def split_now(self) -> tuple[int, bool]:
    """(PD-P nodes by current role, whether any node is still draining)."""
    with self._lock:
      n_p, _ = pd_roles.split(self._roles)
      return n_p, any(n.draining for n in self._roles)

  def node_load(self) -> dict[int, int]:
    """In-flight work (decode + PD-P) per PD node, for picking nodes to move."""
    with self._lock:
      return {i: self._load[(NodeKind.DECODE, i)] + self._load[(NodeKind.PDP, i)]
              for i in range(len(self.decode_targets))}

  def observe_load(self, server: str, index: int, report) -> None:
    """Keeps a node's latest ``LoadReport`` (``server``: "prefill" for a PrfaaS
    server, "decode" for a PD node); the caller checked it
    (``control_plane.check_load_report``)."""
    kind = NodeKind.PREFILL if server == "prefill" else NodeKind.DECODE
    with self._lock:
      self._reported[(kind, index)] = NodeLoad.from_report(report, time.monotonic())

  def reported_load(self, kind: NodeKind, index: int) -> NodeLoad | None:
    """The node's latest reported load (PREFILL or DECODE; PDP reads its PD
    node's), None before its first report."""
    kind = NodeKind.PREFILL if NodeKind(kind) == NodeKind.PREFILL else NodeKind.DECODE
    with self._lock:
      return self._reported.get((kind, index))

  def roles_info(self) -> list[dict]:
    with self._lock:
      nodes = list(self._roles)
      load = dict(self._load)
      reported = {i: self._reported.get((NodeKind.DECODE, i))
                  for i in range(len(self.decode_targets))}
    return [{"node": t.control, "index": i, "shape": t.shape.name, "role": n.role,
             "target": n.final,
             "draining": n.draining, "serving": sorted(n.serving),
             "inflight_decode": load.get((NodeKind.DECODE, i), 0),
             "inflight_prefill": load.get((NodeKind.PDP, i), 0),
             "healthy": self.health.is_healthy(t.control),
             **({"reported": {"pdp_queue": r.prefill_queue,
                              "decode_slots_busy": r.decode_slots_busy,
                              "decode_slots_total": r.decode_slots_total,
                              "decode_waiting": r.decode_waiting}}
                if (r := reported[i]) is not None else {})}
            for i, (t, n) in enumerate(zip(self.decode_targets, nodes))]

  def instance_counts(self) -> tuple[int, int]:
    """(PD-P, PD-D) instances by role now (draining ones count for the
    capabilities they still serve), for the router's ClusterView. Health is
    left to the picking, as for the PrfaaS instance count."""
    with self._lock:
      return pd_roles.serving_counts(self._roles)
