"""Prefill attention: causal by position, GQA/MQA, sliding window, packed segments."""

from pallas_kernels.flash_attention.ops import flash_attention

__all__ = ["flash_attention"]
