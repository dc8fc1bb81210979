"""Entry point for the grouped matmul (signature in docs/CONTRACTS.md)."""

from __future__ import annotations

from pallas_kernels import _dispatch
from pallas_kernels.grouped_matmul import kernel, reference


def grouped_matmul(lhs, rhs, group_sizes, *, tile=None, out_dtype=None, impl="auto"):
  """Rows sorted by group times their group's weight (``jax.lax.ragged_dot`` semantics).

  Args:
    lhs: [m, k]; group ``e`` owns rows ``[sum(sizes[:e]), sum(sizes[:e+1]))``.
    rhs: [g, k, n], one weight per group.
    group_sizes: int [g], >= 0, summing to at most m (later rows give zeros).
    tile: static rows per tile (default: about the mean group size).
    out_dtype: result dtype (default lhs.dtype); accumulation is f32.
    impl: "auto" | "xla" | "pallas" | "pallas_interpret" | ... | "reference".

  Returns:
    [m, n] in ``out_dtype``.
  """
  path = _dispatch.record("grouped_matmul", _dispatch.resolve_impl(impl))
  if path == "reference":
    return reference.grouped_matmul_reference(lhs, rhs, group_sizes, out_dtype=out_dtype)
  if path == "xla":
    return reference.grouped_matmul_xla(lhs, rhs, group_sizes, tile=tile, out_dtype=out_dtype)
  return kernel.grouped_matmul_pallas(lhs, rhs, group_sizes, tile=tile, out_dtype=out_dtype,
                                      backend=path)
