"""Cluster-level prefix cache for hybrid models, abstracted to block hashes.

A hybrid (linear + full attention) model can resume prefill from a prefix of n tokens only
if it has (a) the full-attention KV of every token < n and (b) the recurrent state *at*
n. Full-attention KV is cached per block of ``block_tokens`` under a chained hash (as in
vLLM/SGLang radix caches); recurrent states are checkpointed every
``checkpoint_interval_tokens``. So the usable prefix is the largest checkpoint boundary
that lies inside the run of cached blocks and whose checkpoint is cached.

Token content is abstracted: a request is ``shared_tokens`` tokens of shared prefix
``prefix_id`` followed by unique tokens. With chained hashing, block i's hash equals
another request's iff both lie wholly inside the same shared prefix, so we key blocks as
("p", prefix_id, i) there and by request elsewhere. Blocks past the shared prefix can never
match, so we store them as one aggregate LRU entry per request (same bytes, same recency,
same eviction behaviour, O(1) instead of O(blocks)).

Eviction is LRU over blocks and checkpoints together, under one byte budget.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Prefix-cache geometry and budget of one cluster.

  Attributes:
    block_tokens: tokens per full-attention KV block.
    checkpoint_interval_tokens: B, recurrent-state checkpoint spacing (multiple of block_tokens).
    capacity_bytes: byte budget for blocks + checkpoints (0 disables caching).
  """

  block_tokens: int = 256
  checkpoint_interval_tokens: int = 4096
  capacity_bytes: float = 512 * 2**30

  def __post_init__(self):
    if self.block_tokens < 1 or self.checkpoint_interval_tokens < self.block_tokens:
      raise ValueError("need block_tokens >= 1 and checkpoint_interval_tokens >= block_tokens")
    if self.checkpoint_interval_tokens % self.block_tokens:
      raise ValueError("checkpoint_interval_tokens must be a multiple of block_tokens")
    if self.capacity_bytes < 0:
      raise ValueError("capacity_bytes must be >= 0")


@dataclasses.dataclass(frozen=True)
class TokenLayout:
  """What the cache knows about a request's tokens (see module docstring)."""

  request_id: int
  total_tokens: int
  prefix_id: int  # -1: no shared prefix
  shared_tokens: int

  def __post_init__(self):
    if self.total_tokens < 1 or not 0 <= self.shared_tokens <= self.total_tokens:
      raise ValueError(f"bad token layout: {self}")
    if self.prefix_id < 0 and self.shared_tokens:
      raise ValueError("shared_tokens > 0 requires a prefix_id >= 0")


class PrefixCache:
  """LRU prefix cache of one cluster. Sizes in bytes, lengths in tokens."""

  def __init__(self, spec: CacheSpec, kv_bytes_per_token: float, state_bytes: float):
    if kv_bytes_per_token < 0 or state_bytes < 0:
      raise ValueError("kv_bytes_per_token and state_bytes must be >= 0")
    self.spec = spec
    self.block_bytes = kv_bytes_per_token * spec.block_tokens
    self.state_bytes = state_bytes
    self._lru: collections.OrderedDict[tuple, float] = collections.OrderedDict()
    self.used_bytes = 0.0
    self.evictions = 0

  def __len__(self) -> int:
    return len(self._lru)

  def _shared_blocks(self, layout: TokenLayout) -> int:
    return layout.shared_tokens // self.spec.block_tokens if layout.prefix_id >= 0 else 0

  def match(self, layout: TokenLayout) -> int:
    """Longest usable cached prefix, in tokens (< total_tokens: one token must be computed)."""
    bt, ck = self.spec.block_tokens, self.spec.checkpoint_interval_tokens
    limit = min(self._shared_blocks(layout), (layout.total_tokens - 1) // bt)
    hit = 0
    while hit < limit and ("kv", layout.prefix_id, hit) in self._lru:
      hit += 1
    j = (hit * bt) // ck
    while j > 0 and ("ck", layout.prefix_id, j) not in self._lru:
      j -= 1
    return j * ck

  def touch(self, layout: TokenLayout, tokens: int) -> None:
    """Marks the shared blocks/checkpoints of the first ``tokens`` tokens as recently used."""
    bt, ck = self.spec.block_tokens, self.spec.checkpoint_interval_tokens
    for i in range(min(tokens // bt, self._shared_blocks(layout))):
      key = ("kv", layout.prefix_id, i)
      if key in self._lru:
        self._lru.move_to_end(key)
    for j in range(1, tokens // ck + 1):
      key = ("ck", layout.prefix_id, j)
      if key in self._lru:
        self._lru.move_to_end(key)

  def insert(self, layout: TokenLayout, tokens: int | None = None,
             with_checkpoints: bool = True) -> None:
    """Caches the KV of the first ``tokens`` tokens (default all) and, if
    ``with_checkpoints``, the recurrent checkpoints at every B inside them."""
    if self.spec.capacity_bytes <= 0:
      return
    tokens = layout.total_tokens if tokens is None else min(tokens, layout.total_tokens)
    bt, ck = self.spec.block_tokens, self.spec.checkpoint_interval_tokens
    n_blocks = tokens // bt
    n_shared = min(n_blocks, self._shared_blocks(layout))
    for i in range(n_shared):
      self._put(("kv", layout.prefix_id, i), self.block_bytes)
    if n_blocks > n_shared:
      self._put(("kv_tail", layout.request_id), (n_blocks - n_shared) * self.block_bytes)
    if with_checkpoints:
      n_ck = tokens // ck
      n_ck_shared = min(n_ck, (n_shared * bt) // ck)
      for j in range(1, n_ck_shared + 1):
        self._put(("ck", layout.prefix_id, j), self.state_bytes)
      if n_ck > n_ck_shared:
        self._put(("ck_tail", layout.request_id), (n_ck - n_ck_shared) * self.state_bytes)
    self._evict()

  def _put(self, key: tuple, nbytes: float) -> None:
    old = self._lru.pop(key, None)
    if old is not None:
      self.used_bytes -= old
    self._lru[key] = nbytes
    self.used_bytes += nbytes

  def _evict(self) -> None:
    while self.used_bytes > self.spec.capacity_bytes and self._lru:
      _, nbytes = self._lru.popitem(last=False)
      self.used_bytes -= nbytes
      self.evictions += 1
