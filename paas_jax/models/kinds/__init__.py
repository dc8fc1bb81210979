"""The layer-kind registry: ``LayerKind`` -> ``KindSpec`` (see ``base.py``).

Each kind's module owns its parameters (the mixer it builds), its cache type and
shapes, its exact state size, its paged decode layout and its prefix-cache rule.
``ModelConfig.layer_pattern`` letters stay the user-facing syntax; code asks
``kind_spec(letter)`` instead of branching on letters. Adding a kind: a
``LayerKind`` member (letter, sub-config), its module here, one line below.
"""

from __future__ import annotations

from paas_jax.models.config import LAYER_KINDS, LayerKind
from paas_jax.models.kinds import attention, gated_delta, mamba2, mla, sliding
from paas_jax.models.kinds.attention import PagedKV
from paas_jax.models.kinds.base import KindSpec, PagedLayout, PrefixRule, Shapes, StatePositions
from paas_jax.models.kinds.mla import PagedLatent

REGISTRY: dict[LayerKind, KindSpec] = {
    LayerKind.ATTENTION: attention.SPEC,
    LayerKind.MLA: mla.SPEC,
    LayerKind.SLIDING: sliding.SPEC,
    LayerKind.GATED_DELTA: gated_delta.SPEC,
    LayerKind.MAMBA2: mamba2.SPEC,
}


def kind_spec(kind: str | LayerKind) -> KindSpec:
  """The spec of a ``layer_pattern`` letter (or member); ``ValueError`` if unknown."""
  try:
    return REGISTRY[LayerKind(kind)]
  except (ValueError, KeyError):
    raise ValueError(f"ModelConfig.layer_pattern: unknown layer kind {kind!r}; expected one "
                     f"of {LAYER_KINDS}") from None


# Cache types that grow with the context, in registry order.
GROWING_CACHES = tuple(s.cache_type for s in REGISTRY.values() if s.grows)
# Page-pool types of the decode engine.
PAGED_CACHES = tuple(s.paged.pool_type for s in REGISTRY.values() if s.paged is not None)

__all__ = ["GROWING_CACHES", "KindSpec", "LayerKind", "PAGED_CACHES", "PagedKV", "PagedLatent",
           "PagedLayout", "PrefixRule", "REGISTRY", "Shapes", "StatePositions", "kind_spec"]
