"""Mamba2 SSD scan: chunked prefill and single-step decode."""

from pallas_kernels.ssd.ops import ssd, ssd_step

__all__ = ["ssd", "ssd_step"]
