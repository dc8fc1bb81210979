"""Small helpers shared by the op folders."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The reference and XLA paths are the accuracy baseline, so their f32 matmuls
# must not be demoted to bf16 passes (the TPU default for f32 dots).
HIGHEST = jax.lax.Precision.HIGHEST


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pad_axis(x: jax.Array, axis: int, new_size: int, value=0) -> jax.Array:
  """Right-pads ``x`` along ``axis`` to ``new_size`` with ``value``."""
  pad = new_size - x.shape[axis]
  if pad == 0:
    return x
  if pad < 0:
    raise ValueError(f"cannot pad axis {axis} of size {x.shape[axis]} to {new_size}")
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def require(cond: bool, msg: str) -> None:
  if not cond:
    raise ValueError(msg)


def shape_str(**arrays) -> str:
  return ", ".join(f"{k}={tuple(v.shape)}" for k, v in arrays.items() if v is not None)
