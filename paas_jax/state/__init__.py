"""Decode state: typed per-layer caches, analytic sizes, prefix cache."""

from paas_jax.state.cache import (
    CAPACITY_ALIGN,
    AttentionCache,
    DecodeState,
    GatedDeltaCache,
    LayerCache,
    Mamba2Cache,
    MLACache,
    SlidingWindowCache,
    StateBytes,
    abstract_state,
    init_state,
    round_up,
    state_bytes,
)
from paas_jax.state.prefix_cache import (HybridPrefixCache, PrefixCacheStats, block_hashes,
                                         probe_tokens)
