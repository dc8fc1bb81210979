"""Naming, axis roles and chunk shapes of the state's arrays.

A leaf's name is its pytree path joined by "/" (``layers/3/k``, ``lengths``),
so the sender's state and the receiver's template meet by name, whatever
their capacities or shardings. Axis roles come from the typed caches of
``paas_jax.state`` (their layouts are fixed by docs/CONTRACTS.md); leaves of
any other pytree are stored whole and exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

import jax
import numpy as np

from paas_jax.state import (AttentionCache, GatedDeltaCache, Mamba2Cache, MLACache,
                            SlidingWindowCache)


@dataclasses.dataclass(frozen=True)
class ArrayRole:
  """How one leaf is stored.

  Attributes:
    token_axis: the positions axis, or None.
    head_axis: the heads axis, or None (chunked along it as well).
    trim: "none", "prefix" (keep positions [0, n)) or "ring" (keep slots
      [0, min(n, window)) of a ring buffer whose position p sits at p % window).
    quantizable: lossy quantization may be applied (full-attention KV only).
    batch_axis: axis 0 is the request axis: chunks never mix two requests.
  """

  token_axis: int | None = None
  head_axis: int | None = None
  trim: str = "none"
  quantizable: bool = False
  batch_axis: bool = False


EXACT = ArrayRole()

# Field roles of the typed caches. Full-attention KV is the only quantizable
# part: its errors are averaged by softmax, whereas a recurrent state or a
# sliding window ring feeds every later token.
_CACHE_ROLES: dict[type, dict[str, ArrayRole]] = {
    AttentionCache: {
        "k": ArrayRole(1, 2, "prefix", True, True),
        "v": ArrayRole(1, 2, "prefix", True, True)},
    MLACache: {
        "latent": ArrayRole(1, None, "prefix", True, True),
        "k_rope": ArrayRole(1, None, "prefix", True, True)},
    SlidingWindowCache: {
        "k": ArrayRole(1, 2, "ring", False, True),
        "v": ArrayRole(1, 2, "ring", False, True)},
    GatedDeltaCache: {
        "conv": ArrayRole(None, None, "none", False, True),
        "recurrent": ArrayRole(None, 1, "none", False, True)},
    Mamba2Cache: {
        "conv": ArrayRole(None, None, "none", False, True),
        "ssm": ArrayRole(None, 1, "none", False, True)},
}


def key_name(key: Any) -> str:
  """One pytree path element as a name component."""
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path: Sequence[Any]) -> str:
  return "/".join(key_name(k) for k in path)


def layer_prefix(layer_index: int) -> str:
  return f"layers/{layer_index}"


def layer_kind(layer: Any) -> str:
  return type(layer).__name__


def role_of(layer: Any, sub_path: Sequence[Any]) -> ArrayRole:
  """The role of a leaf at ``sub_path`` inside the layer node ``layer``."""
  roles = _CACHE_ROLES.get(type(layer))
  if roles is None or len(sub_path) != 1:
    return EXACT
  return roles.get(key_name(sub_path[0]), EXACT)


def layer_leaves(layer_index: int, layer: Any) -> list[tuple[str, Any, ArrayRole]]:
  """(name, leaf, role) of every array of one layer cache."""
  out = []
  for sub_path, leaf in jax.tree_util.tree_flatten_with_path(layer)[0]:
    out.append((f"{layer_prefix(layer_index)}/{path_name(sub_path)}", leaf,
                role_of(layer, sub_path)))
  return out


def split_state(state: Any) -> tuple[tuple[Any, ...], list[tuple[str, Any]]]:
  """Splits a state into its layer nodes and the (name, leaf) of everything else.

  ``DecodeState`` (or any pytree whose top level has a ``layers`` sequence)
  gives one group per layer; every other leaf is a state-level array named by
  its path. A pytree without ``layers`` is all state-level arrays.
  """
  if isinstance(state, dict):
    layers = tuple(state.get("layers", ()))
  else:
    layers = tuple(getattr(state, "layers", ()))
  rest = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if layers and path and key_name(path[0]) == "layers":
      continue
    rest.append((path_name(path), leaf))
  return layers, rest


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
  """(name, leaf) of every leaf of a full state or template, in tree order."""
  return [(path_name(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def live_extent(role: ArrayRole, extent: int, token_count: int) -> int:
  """How many positions along the token axis are stored."""
  if role.trim in ("prefix", "ring"):
    return min(extent, max(0, token_count))
  return extent


def _largest_divisor_at_most(n: int, limit: int) -> int:
  limit = max(1, min(n, limit))
  for d in range(limit, 0, -1):
    if n % d == 0:
      return d
  return 1


def chunk_shape(stored_shape: Sequence[int], shard_shape: Sequence[int],
                sharded_axes: Iterable[int], itemsize: int, role: ArrayRole,
                target_bytes: int, heads_per_chunk: int | None) -> tuple[int, ...]:
  """A zarr3 chunk shape: at most ``target_bytes``, aligned to device shards.

  Along a sharded axis the chunk size divides the shard size, so every chunk
  lies inside exactly one device's shard: each process writes whole chunks
  that no other process touches. Along the token axis of an unsharded array
  the live length is split into equal chunks, because zarr stores an edge
  chunk at full size and a 4096-token chunk holding 37 live tokens would ship
  99% padding.
  """
  ndim = len(stored_shape)
  sharded = set(sharded_axes)
  chunk = [max(1, min(int(s), int(p))) for s, p in zip(stored_shape, shard_shape)]
  if role.batch_axis and ndim:
    chunk[0] = 1
  if heads_per_chunk is not None and role.head_axis is not None:
    h = role.head_axis
    chunk[h] = _largest_divisor_at_most(chunk[h], heads_per_chunk)

  def nbytes() -> int:
    return math.prod(chunk) * itemsize

  order = [a for a in (role.token_axis, role.head_axis) if a is not None]
  order += [a for a in range(1 if role.batch_axis else 0, ndim) if a not in order]
  for axis in order:
    if nbytes() <= target_bytes:
      break
    per_slice = nbytes() // chunk[axis]
    fit = max(1, target_bytes // max(1, per_slice))
    if axis in sharded or axis != role.token_axis:
      chunk[axis] = _largest_divisor_at_most(chunk[axis], fit)
    else:
      pieces = -(-int(stored_shape[axis]) // fit)
      chunk[axis] = max(1, -(-int(stored_shape[axis]) // pieces))
  return tuple(chunk)


def shard_layout(leaf: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(per-device shard shape, axes split across devices) of a leaf."""
  shape = tuple(int(s) for s in np.shape(leaf))
  sharding = getattr(leaf, "sharding", None)
  if sharding is None or not isinstance(leaf, jax.Array):
    return shape, ()
  shard = tuple(int(s) for s in sharding.shard_shape(shape))
  return shard, tuple(i for i, (a, b) in enumerate(zip(shape, shard)) if a != b)
