"""What a layer kind is: ``KindSpec``, one per kind module, collected in ``kinds.REGISTRY``."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

import numpy as np
from flax import nnx

from paas_jax.models.config import LayerKind, ModelConfig

# Array name -> (shape, dtype) of one cache or page pool.
Shapes = dict[str, tuple[tuple[int, ...], np.dtype]]


class PrefixRule(enum.Enum):
  """How the hybrid prefix cache reuses a kind's state for a shared prompt prefix."""

  # The cache holds one entry per position: any block-aligned prefix is reusable,
  # block by block (the KV of positions [0, n)).
  BLOCK_KV = "block_kv"
  # The cache is a fixed-size summary of everything seen: reusable only as a
  # checkpoint taken at exactly the matched prefix length.
  EXACT_CHECKPOINT = "exact_checkpoint"


class StatePositions(enum.Enum):
  """How a kind's cache holds the positions it has seen (what a lost or
  shifted state loses: ``state/sensitivity.py`` corrupts by it)."""

  # Entry i holds position i, up to the capacity (KV, MLA latents).
  LINEAR = "linear"
  # A ring buffer of the last ``window`` positions: entry p % window.
  RING = "ring"
  # A fixed-size summary of every position seen (recurrent states): no
  # per-position entries, so no KV block to lose.
  SUMMARY = "summary"


@dataclasses.dataclass(frozen=True)
class PagedLayout:
  """How the decode engine pools a kind's cache in shared pages.

  Attributes:
    pool_type: the pooled cache (fields in the same order as the cache's, each
      ``[num_pages, page_size, ...]``); the mixer's ``paged_step`` takes and
      returns its arrays in that order.
    pool_shapes: ``(config, num_pages, page_size) -> Shapes``.
  """

  pool_type: type
  pool_shapes: Callable[[ModelConfig, int, int], Shapes]


@dataclasses.dataclass(frozen=True)
class KindSpec:
  """Everything the rest of the system needs to know about one layer kind.

  Attributes:
    kind: the enum member (its value is the ``layer_pattern`` letter).
    make_mixer: ``(config, rngs) -> nnx.Module`` with the kind's parameters; the
      module has ``prefill(x, cache, chunk)`` and ``step(x, cache, lengths)``
      (and ``paged_step`` when ``paged`` is set).
    cache_type: the per-request cache (a ``flax.struct`` dataclass).
    cache_shapes: ``(config, batch, capacity) -> Shapes`` of ``cache_type``'s arrays.
    state_bytes: ``config -> (fixed, per_token)`` bytes of one request's cache,
      written independently of ``cache_shapes`` so tests can hold them equal.
    prefix_rule: how the prefix cache reuses this kind's state.
    positions: how the cache holds the positions seen (``StatePositions``),
      along axis 1 of its arrays for LINEAR and RING.
    summary_fields: the cache fields that carry the SUMMARY of the positions
      seen (e.g. the recurrent state, not the short conv window): what a lost
      state loses; empty means every field.
    paged: the decode engine's page-pool layout; None keeps the cache
      slot-indexed (``[n_slots, ...]``).
  """

  kind: LayerKind
  make_mixer: Callable[[ModelConfig, nnx.Rngs], nnx.Module]
  cache_type: type
  cache_shapes: Callable[[ModelConfig, int, int], Shapes]
  state_bytes: Callable[[ModelConfig], tuple[int, int]]
  prefix_rule: PrefixRule
  positions: StatePositions
  summary_fields: tuple[str, ...] = ()
  paged: PagedLayout | None = None

  @property
  def grows(self) -> bool:
    """Whether the cache grows with the context (one entry per position)."""
    return self.prefix_rule is PrefixRule.BLOCK_KV
