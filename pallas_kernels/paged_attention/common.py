"""Paged-attention pieces shared by the TPU (``kernel``) and GPU (``kernel_gpu``)
kernels: which page slots a query can see and the positions of the query rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

def page_range(length, n, page_size, window):
  """(first, last) page slot holding a key some query can see (last < first if none).

  Operands are non-negative, so truncating ``lax.div`` equals floor division
  and avoids the sign fix-up that ``//`` lowers to.
  """
  last = jax.lax.div(jnp.maximum(length, 0) + (page_size - 1), page_size) - 1
  if window is None:
    first = jnp.zeros_like(last)
  else:
    # The earliest query sits at length - n and sees positions > it - window.
    first = jax.lax.div(jnp.maximum(length - n - window + 1, 0), page_size)
  return first, last


def query_rows(lengths, n, grp):
  """Positions of the kernel's query rows, ordered (group member, token): [b, grp*n, 1]."""
  pos = lengths[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None, :]
  return jnp.tile(pos, (1, grp))[:, :, None].astype(jnp.int32)
