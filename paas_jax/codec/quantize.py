"""Per-channel int8 / fp8 quantization of full-attention KV.

A channel is every index except the token axis: for ``k[b, t, h, d]`` one f32
scale per (b, h, d), taken over the live tokens only (positions beyond the
request's length may hold stale values from an earlier, longer request). Keys
have a few outlier channels whose magnitude is 10-100x the rest (the reason
KV quantizers go per channel rather than per tensor), so per-channel scales
keep the common channels at full int8 resolution.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# Largest finite magnitude of each stored type.
_QMAX = {"int8": 127.0, "fp8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}
STORED_DTYPE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


@functools.partial(jax.jit, static_argnames=("kind", "token_axis"))
def _quantize_jax(x: jax.Array, live: jax.Array, *, kind: str, token_axis: int):
  positions = jax.lax.broadcasted_iota(jnp.int32, x.shape, token_axis)
  mag = jnp.where(positions < live, jnp.abs(x.astype(jnp.float32)), 0.0)
  absmax = jnp.max(mag, axis=token_axis)
  # An all-zero channel gets scale 1 so it dequantizes to exact zeros.
  scale = jnp.where(absmax > 0, absmax / _QMAX[kind], 1.0)
  y = x.astype(jnp.float32) / jnp.expand_dims(scale, token_axis)
  if kind == "int8":
    q = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
  else:
    q = jnp.clip(y, -_QMAX[kind], _QMAX[kind]).astype(jnp.float8_e4m3fn)
  return q, scale


def quantize(x, live: int, *, kind: str, token_axis: int):
  """Quantizes ``x`` per channel over positions ``[0, live)`` of ``token_axis``.

  Args:
    x: jax.Array or np.ndarray, any float dtype; jax inputs keep their sharding
      (the reduction over tokens runs where the shards live, no gather).
    live: number of live positions.
    kind: "int8" or "fp8".

  Returns:
    (q with x's shape in int8 / float8_e4m3fn, scale f32 with the token axis
    removed), as jax arrays for jax input and numpy arrays otherwise.
  """
  if kind not in _QMAX:
    raise ValueError(f"unknown quantization {kind!r}")
  if isinstance(x, jax.Array):
    return _quantize_jax(x, jnp.int32(live), kind=kind, token_axis=token_axis)
  q, scale = _quantize_jax(jnp.asarray(x), jnp.int32(live), kind=kind, token_axis=token_axis)
  return np.asarray(q), np.asarray(scale)


def dequantize(q: np.ndarray, scale: np.ndarray, *, token_axis: int,
               dtype: np.dtype) -> np.ndarray:
  """Host-side inverse of ``quantize`` for one slice: ``q * scale`` in ``dtype``.

  ``scale`` is the matching slice of the scale array (token axis removed).
  """
  out = q.astype(np.float32) * np.expand_dims(scale.astype(np.float32), token_axis)
  return out.astype(dtype)
