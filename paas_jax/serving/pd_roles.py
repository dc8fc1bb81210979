"""Roles of the PD nodes in region B and how they move (the paper's "re-balance P/D nodes").

A PD node (one decode server process) has a role:

* ``pdp``:  PD-P only: it prefills prompts of local requests and streams the
  state to a PD-D node over the intra-region network (never the WAN relay);
* ``pdd``:  PD-D only: it decodes (states from PD-P nodes or from PrfaaS);
* ``both``: colocated PD-P + PD-D (the single-node deployment).

Each role is a set of capabilities, ``prefill`` and ``decode``. Moving a node
from role ``old`` to ``new`` drains it first: while it drains it serves only
the capabilities both roles share (``kept``), gets no new work that needs a
capability it gives up (``dropped``) and none that needs one it is gaining
(``added``) yet. Once the broker's count of its in-flight work of the dropped
capabilities reaches zero, the move completes and it serves ``new``.

A node also has a *shape* (``NodeShape``): what its processes can take and
serve whatever its role, fixed for its lifetime. A single decode process
(``SINGLE``) can hold any role. A decode slice of several processes
(``SLICE``, ``slice_decode_server``) takes a prefill pod's per-process parts
but never a whole state from another PD node, serves no Prefill to other
nodes, keeps no commit points and no prefix cache the broker may probe or
ship to or from (its own prefix cache, with --prefix_block, serves only its
local prefills: ``slice_prefix``): its role is ``both`` (it prefills its own
local requests and decodes), always. Whether a PD-P
node may stream a state to a PD-D node is ``can_hand_off`` of their shapes;
roles are checked against shapes (``check_roles``) and the default split and
the rebalancer's moves place only the nodes whose role may change.

Everything here is pure (frozen dataclasses in, new ones out); the broker owns
the clock, the lock and the in-flight counters.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

PDP_ROLE, PDD_ROLE, BOTH_ROLE = "pdp", "pdd", "both"
ROLES = (PDP_ROLE, PDD_ROLE, BOTH_ROLE)
PREFILL, DECODE = "prefill", "decode"
_CAPS = {PDP_ROLE: frozenset({PREFILL}), PDD_ROLE: frozenset({DECODE}),
         BOTH_ROLE: frozenset({PREFILL, DECODE})}


class RoleError(ValueError):
  """A role assignment that cannot be served; ``precondition`` distinguishes a
  well-formed one that would leave no node able to decode (FAILED_PRECONDITION)
  from a malformed one (INVALID_ARGUMENT)."""

  def __init__(self, message: str, precondition: bool = False):
    super().__init__(message)
    self.precondition = precondition


@dataclasses.dataclass(frozen=True)
class NodeShape:
  """What a PD node's processes can do, whatever its role (module docstring).

  roles: the roles it may hold; whole_state_in: takes a whole state another
  PD node (PD-P) streams to its StateTransfer port; prefills_for_others:
  serves Prefill for another PD node; commit_points: resumes an attempt from
  them (``resume_from``); ships_prefixes: its prefix cache (the broker
  probes any node's) is also an ExportPrefix source and target, so that the
  broker ships prefixes to and from it (a slice's cache is per process and
  serves only its own local prefills).
  """

  name: str
  roles: frozenset[str]
  whole_state_in: bool
  prefills_for_others: bool
  commit_points: bool
  ships_prefixes: bool

  @property
  def fixed_role(self) -> str | None:
    """Its only role, if it may hold just one."""
    return next(iter(self.roles)) if len(self.roles) == 1 else None


SINGLE = NodeShape("single", frozenset(ROLES), whole_state_in=True, prefills_for_others=True,
                   commit_points=True, ships_prefixes=True)
# A slice restores per-process parts in place (pod_transfer) and serves no
# Prefill: a PD-P split can neither feed it nor be done by it, so it prefills
# its own local requests ("both").
SLICE = NodeShape("slice", frozenset({BOTH_ROLE}), whole_state_in=False,
                  prefills_for_others=False, commit_points=False, ships_prefixes=False)


def can_hand_off(src: NodeShape, dst: NodeShape) -> bool:
  """Whether a PD-P node of shape ``src`` may stream a whole state to a PD-D
  node of shape ``dst`` (the only node-to-node handoff)."""
  return src.prefills_for_others and dst.whole_state_in


def capabilities(role: str) -> frozenset[str]:
  try:
    return _CAPS[role]
  except KeyError:
    raise RoleError(f"unknown role {role!r} (one of {', '.join(ROLES)})") from None


@dataclasses.dataclass(frozen=True)
class NodeRole:
  """One PD node's role; ``target`` is set while it drains toward a new role."""

  role: str
  target: str | None = None

  def __post_init__(self):
    capabilities(self.role)
    if self.target is not None:
      capabilities(self.target)

  @property
  def draining(self) -> bool:
    return self.target is not None and self.target != self.role

  @property
  def serving(self) -> frozenset[str]:
    """Capabilities it takes new work for now."""
    caps = capabilities(self.role)
    return caps & capabilities(self.target) if self.draining else caps

  @property
  def dropped(self) -> frozenset[str]:
    """Capabilities whose in-flight work must finish before the move completes."""
    return capabilities(self.role) - capabilities(self.target) if self.draining else frozenset()

  @property
  def final(self) -> str:
    """The role it will have once any move completes."""
    return self.target if self.draining else self.role


@dataclasses.dataclass(frozen=True)
class RoleMove:
  node: int
  from_role: str
  to_role: str


def validate_roles(roles: Sequence[str]) -> tuple[str, ...]:
  """Checks a full assignment (one role per node)."""
  roles = tuple(roles)
  if not roles:
    raise RoleError("need one role per PD node, got none")
  for r in roles:
    capabilities(r)
  if not any(DECODE in capabilities(r) for r in roles):
    raise RoleError(f"roles {list(roles)} leave no PD node to decode", precondition=True)
  return roles


def check_roles(roles: Sequence[str], shapes: Sequence[NodeShape]) -> tuple[str, ...]:
  """``validate_roles``, and each node's role one its shape may hold."""
  roles = validate_roles(roles)
  if len(roles) != len(shapes):
    raise RoleError(f"need {len(shapes)} roles (one per PD node), got {len(roles)}")
  for i, (r, shape) in enumerate(zip(roles, shapes)):
    if r not in shape.roles:
      raise RoleError(f"PD node {i} is a decode {shape.name}: its role is "
                      f"{' or '.join(sorted(shape.roles))} (it takes no whole state from "
                      f"another node and prefills for none), not {r!r}")
  return roles


def default_roles_for(shapes: Sequence[NodeShape], n_prefill: int | None = None
                      ) -> tuple[str, ...]:
  """``default_roles`` over the nodes whose role may change (in order), the
  others at their fixed role: with a slice and one single node, both are
  ``both``; with a slice and N single nodes those split as ``default_roles(N)``
  (the PD-P ones prefill for the single PD-D ones, never for the slice)."""
  if not shapes:
    raise RoleError("need at least one PD node, got none")
  free = [i for i, s in enumerate(shapes) if s.fixed_role is None]
  if not free and n_prefill is not None and n_prefill > 0:
    # Every node is a slice (role "both"): no PD-P node can be placed, and
    # ignoring the count would hide that from whoever asked for it.
    raise RoleError(f"{n_prefill} PD-P node(s) asked for, but all {len(shapes)} PD nodes are "
                    "decode slices (role both; none prefills for another node)",
                    precondition=True)
  split_free = default_roles(len(free), n_prefill) if free else ()
  out = [s.fixed_role for s in shapes]
  for i, r in zip(free, split_free):
    out[i] = r
  return check_roles(out, shapes)


def default_roles(n_nodes: int, n_prefill: int | None = None) -> tuple[str, ...]:
  """The starting split: one node does both (today's deployment); N > 1 nodes
  split into ``n_prefill`` PD-P nodes (default N // 2) and the rest PD-D. The
  first nodes decode, so node 0 (``decode``, the one existing tools look at)
  stays a decode node."""
  if n_nodes < 1:
    raise RoleError(f"need at least one PD node, got {n_nodes}")
  if n_nodes == 1:
    return (BOTH_ROLE,)
  k = n_nodes // 2 if n_prefill is None or n_prefill < 0 else n_prefill
  if not 0 <= k < n_nodes:
    raise RoleError(f"{k} PD-P nodes out of {n_nodes} leave no PD-D node",
                    precondition=k >= n_nodes)
  return (PDD_ROLE,) * (n_nodes - k) + (PDP_ROLE,) * k


def split(nodes: Sequence[NodeRole]) -> tuple[int, int]:
  """(N_p, N_d) of the assignment the nodes are heading to: a ``both`` node
  counts as a decode node (it holds decode slots; its prefill is colocated)."""
  n_p = sum(1 for n in nodes if n.final == PDP_ROLE)
  return n_p, len(nodes) - n_p


def serving_counts(nodes: Sequence[NodeRole], healthy: Sequence[bool] | None = None
                   ) -> tuple[int, int]:
  """(prefill, decode): healthy nodes taking new work of each capability now."""
  ok = [True] * len(nodes) if healthy is None else list(healthy)
  return (sum(1 for n, h in zip(nodes, ok) if h and PREFILL in n.serving),
          sum(1 for n, h in zip(nodes, ok) if h and DECODE in n.serving))


def eligible(nodes: Sequence[NodeRole], capability: str) -> list[int]:
  return [i for i, n in enumerate(nodes) if capability in n.serving]


def plan_split(roles: Sequence[str], n_p: int, load: Mapping[int, float] | None = None
               ) -> tuple[str, ...]:
  """The assignment with exactly ``n_p`` PD-P and ``len(roles) - n_p`` PD-D
  nodes that changes the fewest nodes' roles. Among equally few, it moves the
  nodes with the least ``load`` (in-flight work they would have to drain)."""
  n = len(roles)
  if not 0 <= n_p < n:
    raise RoleError(f"N_p={n_p} out of {n} PD nodes leaves no PD-D node", precondition=n_p >= n)
  load = load or {}
  out = list(roles)
  pdp = [i for i, r in enumerate(roles) if r == PDP_ROLE]
  pdd = [i for i, r in enumerate(roles) if r == PDD_ROLE]
  both = [i for i, r in enumerate(roles) if r == BOTH_ROLE]
  by_load = lambda idx: sorted(idx, key=lambda i: (load.get(i, 0.0), -i))
  # "both" nodes change role whatever they become; they fill the gaps first,
  # so pure nodes flip only when those are not enough.
  need_p = n_p - len(pdp)
  if need_p >= 0:
    take = by_load(both)[:need_p]
    for i in take:
      out[i] = PDP_ROLE
    rest = [i for i in both if i not in take]
    need_p -= len(take)
    for i in by_load(pdd)[:need_p]:
      out[i] = PDP_ROLE
    for i in rest:
      out[i] = PDD_ROLE
  else:
    for i in by_load(pdp)[:-need_p]:
      out[i] = PDD_ROLE
    for i in both:
      out[i] = PDD_ROLE
  return tuple(out)


def plan_split_for(roles: Sequence[str], shapes: Sequence[NodeShape], n_p: int,
                   load: Mapping[int, float] | None = None) -> tuple[str, ...]:
  """``plan_split`` over the nodes whose role may change (``n_p`` of them
  PD-P, at least one PD-D); nodes of a fixed role keep it."""
  free = [i for i, s in enumerate(shapes) if s.fixed_role is None]
  if not free:
    raise RoleError("no PD node's role may change (decode slices keep theirs)",
                    precondition=True)
  load = load or {}
  planned = plan_split([roles[i] for i in free], n_p,
                       {j: load.get(i, 0.0) for j, i in enumerate(free)})
  out = list(roles)
  for i, r in zip(free, planned):
    out[i] = r
  return tuple(out)


def begin_moves(nodes: Sequence[NodeRole], roles: Sequence[str]) -> tuple[tuple[NodeRole, ...],
                                                                           list[RoleMove]]:
  """Starts moving every node whose final role differs from ``roles``. A node
  already draining toward another role re-targets (its drain keeps counting
  only the work of capabilities the new target lacks); one asked back to the
  role it is leaving stops draining at once."""
  roles = validate_roles(roles)
  if len(roles) != len(nodes):
    raise RoleError(f"need {len(nodes)} roles (one per PD node), got {len(roles)}")
  out, moves = [], []
  for i, (node, new) in enumerate(zip(nodes, roles)):
    if new == node.final:
      out.append(node)
      continue
    moves.append(RoleMove(i, node.final, new))
    out.append(NodeRole(node.role, None if new == node.role else new))
  return tuple(out), moves


def settle(nodes: Sequence[NodeRole], inflight: Mapping[tuple[int, str], int]
           ) -> tuple[tuple[NodeRole, ...], list[int]]:
  """Completes the moves whose dropped capabilities have no in-flight work
  (``inflight[(node, capability)]``); returns the new states and those nodes."""
  out, done = [], []
  for i, node in enumerate(nodes):
    if node.draining and all(inflight.get((i, c), 0) <= 0 for c in node.dropped):
      out.append(NodeRole(node.target))
      done.append(i)
    else:
      out.append(node)
  return tuple(out), done
