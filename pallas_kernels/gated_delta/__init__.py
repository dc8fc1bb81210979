"""Gated delta rule (Gated DeltaNet and KDA): chunked prefill and single-step decode."""

from pallas_kernels.gated_delta.ops import chunk_gated_delta, gated_delta_step

__all__ = ["chunk_gated_delta", "gated_delta_step"]
