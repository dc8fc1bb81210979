"""Decode attention over a paged KV cache (standard GQA and absorbed MLA)."""

from pallas_kernels.paged_attention.ops import paged_attention, paged_mla_attention

__all__ = ["paged_attention", "paged_mla_attention"]
