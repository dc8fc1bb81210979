"""Sharing one prefill pool between tenants (the decode regions it serves).

A region-A prefill pool that serves several decode regions must not let a
burst from one region starve the others. ``TenantQueue`` holds the prompts
waiting for a prefill batch, one FIFO per tenant, and hands them out by
start-time fair queueing (SFQ, Goyal et al. 1996) over prompt tokens:

  on arrival of a job of cost c from tenant t (weight w_t):
    S = max(V, F_t)        start tag (V: the start tag of the last job served)
    F_t = S + c / w_t      finish tag of t's newest job
  serve the waiting job with the smallest start tag (ties: arrival order).

So a backlogged tenant gets tokens in proportion to its weight, a tenant that
was idle starts at the current virtual time (it has no credit saved up, and no
debt), and a newcomer waits behind at most one job of each other tenant
rather than behind another tenant's whole backlog. ``fair=False`` serves in
arrival order (the single FIFO of a one-tenant pool; the baseline).

Per-tenant quotas bound how many prompts a tenant may have waiting (admission
control before the queue: a full tenant is refused, the others are not).

Pure Python, no locks: the caller (``PrefillBatcher``) holds its own.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")
DEFAULT_TENANT = "default"


def _parse_map(text: str, cast) -> dict:
  out = {}
  for part in (p.strip() for p in text.split(",") if p.strip()):
    name, sep, value = part.partition("=")
    if not sep or not name.strip():
      raise ValueError(f"expected tenant=value, got {part!r}")
    out[name.strip()] = cast(value)
  return out


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
  """How the pool is shared. ``weights``: tenant -> weight (others:
  ``default_weight``); ``quotas``: tenant -> most prompts waiting (others:
  ``default_quota``; 0: no per-tenant cap); ``fair=False``: arrival order."""

  weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
  default_weight: float = 1.0
  quotas: Mapping[str, int] = dataclasses.field(default_factory=dict)
  default_quota: int = 0
  fair: bool = True

  def __post_init__(self):
    for name, w in list(self.weights.items()) + [("default_weight", self.default_weight)]:
      if not w > 0:
        raise ValueError(f"tenant weight must be > 0, got {name}={w}")
    for name, q in list(self.quotas.items()) + [("default_quota", self.default_quota)]:
      if q < 0:
        raise ValueError(f"tenant quota must be >= 0, got {name}={q}")

  @classmethod
  def parse(cls, weights: str = "", quotas: str = "", fair: bool = True,
            default_quota: int = 0) -> "TenantPolicy":
    """``weights="B=2,C=1"``, ``quotas="B=8"`` (the servers' flag syntax)."""
    return cls(weights=_parse_map(weights, float), quotas=_parse_map(quotas, int),
               default_quota=default_quota, fair=fair)

  def weight(self, tenant: str) -> float:
    return float(self.weights.get(tenant, self.default_weight))

  def quota(self, tenant: str) -> int:
    return int(self.quotas.get(tenant, self.default_quota))


@dataclasses.dataclass(order=True)
class _Entry(Generic[T]):
  start: float
  seq: int
  item: T = dataclasses.field(compare=False)


class TenantQueue(Generic[T]):
  """Waiting jobs of several tenants (see the module docstring).

  ``tenant_of(item) -> str`` and ``cost_of(item) -> float`` (prompt tokens)
  describe a job. ``push`` never refuses: check ``admits`` first.
  """

  def __init__(self, policy: TenantPolicy, tenant_of: Callable[[T], str],
               cost_of: Callable[[T], float]):
    self.policy = policy
    self._tenant_of = tenant_of
    self._cost_of = cost_of
    self._queues: dict[str, collections.deque[_Entry[T]]] = {}
    self._finish: dict[str, float] = {}
    self._virtual = 0.0
    self._seq = itertools.count()
    self.served_cost: collections.Counter = collections.Counter()
    self.served_jobs: collections.Counter = collections.Counter()

  def __len__(self) -> int:
    return sum(len(q) for q in self._queues.values())

  def __iter__(self) -> Iterator[T]:
    """Waiting jobs in the order ``pop`` would serve them now."""
    return iter([e.item for e in sorted(e for q in self._queues.values() for e in q)])

  def waiting(self, tenant: str) -> int:
    return len(self._queues.get(tenant, ()))

  def admits(self, tenant: str) -> bool:
    quota = self.policy.quota(tenant)
    return quota == 0 or self.waiting(tenant) < quota

  def push(self, item: T) -> None:
    tenant = self._tenant_of(item)
    seq = next(self._seq)
    if self.policy.fair:
      start = max(self._virtual, self._finish.get(tenant, 0.0))
      cost = max(float(self._cost_of(item)), 1.0)
      self._finish[tenant] = start + cost / self.policy.weight(tenant)
    else:
      start = float(seq)  # arrival order
    self._queues.setdefault(tenant, collections.deque()).append(_Entry(start, seq, item))

  def pop(self) -> T | None:
    """The next job to serve (None: empty)."""
    heads = [q[0] for q in self._queues.values() if q]
    if not heads:
      return None
    entry = min(heads)
    tenant = self._tenant_of(entry.item)
    self._queues[tenant].popleft()
    if self.policy.fair:
      self._virtual = max(self._virtual, entry.start)
    self.served_cost[tenant] += float(self._cost_of(entry.item))
    self.served_jobs[tenant] += 1
    return entry.item

  def drain(self) -> list[T]:
    """Every waiting job, in serving order; the queue is empty afterwards."""
    items = list(self)
    for q in self._queues.values():
      q.clear()
    return items

  def depths(self) -> dict[str, int]:
    return {t: len(q) for t, q in self._queues.items()}
