"""Grouped (ragged) matmul: rows sorted by group, each group times its own weight."""

from pallas_kernels.grouped_matmul.ops import grouped_matmul

__all__ = ["grouped_matmul"]
