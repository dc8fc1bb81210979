"""Hybrid prefix cache: KV blocks for attention layers, state checkpoints for the rest.

A full-attention layer's cache for a prefix is the concatenation of per-block
slices, so it can be shared block by block. A recurrent layer (gated delta
rule, Mamba2) or a sliding-window ring buffer summarises the whole prefix in a
fixed-size state that cannot be cut or joined; it is reusable only at exactly
the length it was saved at. The cache therefore keeps

* one KV block per ``block_size`` tokens, keyed by a hash chain over the
  tokens up to and including that block, and
* a checkpoint of every non-growing layer at block boundaries,

and a prefix of length ``L`` is a hit iff every KV block up to ``L`` and the
checkpoint at ``L`` are present. Entries are evicted least-recently-used within
a byte budget. Entries made only to feed a cross-region transfer can be tagged
with an owner and dropped with ``release(owner)`` once the transfer is done.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.models.config import ModelConfig
from paas_jax.models.kinds import PrefixRule, kind_spec
from paas_jax.state.cache import DecodeState, init_state


def _nbytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


@dataclasses.dataclass
class _Block:
  """KV of one block: per layer, a batch-free slice [block_size, ...] or None."""

  kv: tuple
  nbytes: int
  owner: str | None


@dataclasses.dataclass
class _Checkpoint:
  """Non-growing layer caches (batch 1) after the prefix ending at this block."""

  layers: tuple
  nbytes: int
  owner: str | None


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
  blocks: int
  checkpoints: int
  nbytes: int
  hits: int
  misses: int
  hit_tokens: int


HASH_BYTES = 16  # bytes of one block hash (blake2b digest size)


def block_hashes(tokens: Sequence[int], block_size: int, fingerprint: str) -> list[bytes]:
  """Chained hashes of every complete ``block_size``-token block of ``tokens``.

  Hash i (``HASH_BYTES`` bytes) covers tokens [0, (i+1)*block_size): it chains
  the previous hash with block i's ids (as int64), seeded by the model config
  ``fingerprint``, so equal hashes mean an equal prefix of the same model. The
  one implementation shared by ``HybridPrefixCache`` (its keys) and the broker
  (``PrefixProbeRequest.block_hashes``, sent instead of the prompt's ids).
  """
  if block_size <= 0:
    raise ValueError(f"block_size must be > 0, got {block_size}")
  arr = np.asarray(tokens, np.int64)
  digest = hashlib.blake2b(fingerprint.encode(), digest_size=HASH_BYTES).digest()
  out = []
  for start in range(0, len(arr) - block_size + 1, block_size):
    block = arr[start:start + block_size].tobytes()
    digest = hashlib.blake2b(digest + block, digest_size=HASH_BYTES).digest()
    out.append(digest)
  return out


def probe_tokens(prompt: Sequence[int]) -> list[int]:
  """The part of a prompt a prefix lookup may match: all but its last token
  (the prefill must compute at least one token to get logits)."""
  prompt = list(prompt)
  return prompt[:max(len(prompt) - 1, 0)]


class HybridPrefixCache:
  """Prefix reuse for hybrid models (one instance per serving process)."""

  def __init__(self, config: ModelConfig, block_size: int = 64,
               capacity_bytes: int = 1 << 30,
               empty_state: Callable[[int], DecodeState] | None = None):
    if block_size <= 0:
      raise ValueError(f"block_size must be > 0, got {block_size}")
    if capacity_bytes <= 0:
      raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
    self.config = config
    self.block_size = block_size
    self.capacity_bytes = capacity_bytes
    self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
    self._checkpoints: collections.OrderedDict[bytes, _Checkpoint] = collections.OrderedDict()
    self._nbytes = 0
    self._hits = self._misses = self._hit_tokens = 0
    # Per layer: reused block by block (KV of positions) or only as an exact checkpoint.
    self._growing = tuple(kind_spec(k).prefix_rule is PrefixRule.BLOCK_KV
                          for k in config.layer_kinds)
    self._fingerprint = config.fingerprint()
    # The empty batch-1 state (at a capacity) that ``lookup`` fills. A process
    # that holds only its own shards of a sharded state (a decode slice,
    # ``serving.slice_prefix``) stores those and passes its shards' shapes.
    self._empty_state = empty_state or (lambda capacity: init_state(config, 1, capacity))

  # -- keys ------------------------------------------------------------------------

  def block_hashes(self, tokens: Sequence[int]) -> list[bytes]:
    """Chained hashes of every complete block of ``tokens`` (``block_hashes``)."""
    return block_hashes(tokens, self.block_size, self._fingerprint)

  # -- queries -----------------------------------------------------------------------

  def match_length(self, tokens: Sequence[int]) -> int:
    """Longest cached prefix of ``tokens`` (a multiple of ``block_size``), no side effects.

    At most ``len(tokens) - 1`` tokens are matched, so the caller always has at
    least one token left to prefill and gets logits for it.
    """
    return self.match_length_hashes(self.block_hashes(probe_tokens(tokens)))

  def match_length_hashes(self, hashes: Sequence[bytes]) -> int:
    """``match_length`` from the chained hashes of the prompt's blocks.

    ``hashes``: ``block_hashes(probe_tokens(prompt), block_size, fingerprint)``,
    i.e. of the complete blocks of all but the last token, so the answer keeps
    ``match_length``'s at-most-``len - 1`` rule. Returns tokens (a multiple of
    ``block_size``): the longest run of cached blocks from the start that ends
    at a checkpoint. No side effects (a probe is not a use).
    """
    best = 0
    for i, h in enumerate(hashes):
      if h not in self._blocks:
        break
      if h in self._checkpoints:
        best = (i + 1) * self.block_size
    return best

  # Probes (a broker's ProbePrefix, a decode node's held prefix) take no lock,
  # so they never wait for a running prefill: membership tests on the cache's
  # dicts are atomic and the answer is at worst slightly stale; a dict resized
  # under one reports a miss.
  def probe(self, tokens: Sequence[int]) -> int:
    """``match_length`` without a lock (0 on a race or for no tokens)."""
    try:
      return self.match_length(tokens) if tokens else 0
    except RuntimeError:
      return 0

  def probe_hashes(self, hashes: Sequence[bytes]) -> int:
    """``match_length_hashes`` without a lock (0 on a race or for no hashes)."""
    try:
      return self.match_length_hashes(hashes) if hashes else 0
    except RuntimeError:
      return 0

  def lookup(self, tokens: Sequence[int], capacity: int | None = None
             ) -> tuple[int, DecodeState | None]:
    """Returns (matched length, a batch-1 state holding that prefix) or (0, None)."""
    matched = self.match_length(tokens)
    if matched == 0:
      self._misses += 1
      return 0, None
    hashes = self.block_hashes(list(tokens)[:matched])
    for h in hashes:
      self._blocks.move_to_end(h)
    self._checkpoints.move_to_end(hashes[-1])
    checkpoint = self._checkpoints[hashes[-1]].layers
    blocks = [self._blocks[h].kv for h in hashes]
    capacity = max(capacity or matched, matched)
    state = self._empty_state(capacity)
    layers = []
    for i, (growing, empty) in enumerate(zip(self._growing, state.layers)):
      if not growing:
        layers.append(checkpoint[i])
        continue
      joined = jax.tree_util.tree_map(
          lambda *parts: jnp.concatenate(parts, axis=0)[None], *[b[i] for b in blocks])
      layers.append(jax.tree_util.tree_map(
          lambda full, part: full.at[:, :matched].set(part), empty, joined))
    self._hits += 1
    self._hit_tokens += matched
    return matched, DecodeState(layers=tuple(layers),
                                lengths=jnp.full((1,), matched, jnp.int32))

  # -- updates -----------------------------------------------------------------------

  def insert(self, tokens: Sequence[int], state: DecodeState, owner: str | None = None) -> int:
    """Caches the blocks of ``tokens`` covered by a batch-1 ``state``.

    ``state`` must be the state after exactly ``len(tokens)`` tokens. KV blocks
    are stored for every complete block not yet cached; a checkpoint of the
    non-growing layers is stored if ``len(tokens)`` is a block boundary.

    Returns:
      bytes added.
    """
    if state.batch_size != 1:
      raise ValueError(f"insert takes a batch-1 state, got batch {state.batch_size}")
    length = int(state.lengths[0])
    if length != len(tokens):
      raise ValueError(f"state holds {length} tokens but {len(tokens)} tokens were given")
    hashes = self.block_hashes(tokens)
    added = 0
    for i, h in enumerate(hashes):
      if h in self._blocks:
        self._blocks.move_to_end(h)
        continue
      lo, hi = i * self.block_size, (i + 1) * self.block_size
      kv = tuple(jax.tree_util.tree_map(lambda x: x[0, lo:hi], cache) if growing else None
                 for growing, cache in zip(self._growing, state.layers))
      entry = _Block(kv=kv, nbytes=_nbytes(kv), owner=owner)
      self._blocks[h] = entry
      added += entry.nbytes
    if hashes and length == len(hashes) * self.block_size and hashes[-1] not in self._checkpoints:
      layers = tuple(None if growing else cache
                     for growing, cache in zip(self._growing, state.layers))
      entry = _Checkpoint(layers=layers, nbytes=_nbytes(layers), owner=owner)
      self._checkpoints[hashes[-1]] = entry
      added += entry.nbytes
    self._nbytes += added
    self._evict()
    return added

  def release(self, owner: str) -> int:
    """Drops every entry tagged with ``owner`` (e.g. after its transfer finished)."""
    freed = 0
    for table in (self._blocks, self._checkpoints):
      for key in [k for k, e in table.items() if e.owner == owner]:
        freed += table.pop(key).nbytes
    self._nbytes -= freed
    return freed

  def _evict(self) -> None:
    while self._nbytes > self.capacity_bytes and (self._blocks or self._checkpoints):
      # Checkpoints are useless without their blocks, and blocks are shared by
      # many prefixes, so checkpoints go first.
      table = self._checkpoints if self._checkpoints else self._blocks
      _, entry = table.popitem(last=False)
      self._nbytes -= entry.nbytes

  @property
  def stats(self) -> PrefixCacheStats:
    return PrefixCacheStats(blocks=len(self._blocks), checkpoints=len(self._checkpoints),
                            nbytes=self._nbytes, hits=self._hits, misses=self._misses,
                            hit_tokens=self._hit_tokens)

