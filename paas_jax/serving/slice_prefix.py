"""A decode slice's prefix cache for its own local prefills (every slice process).

A slice process holds only its own shards of a request's sharded state
(``pod.state_shardings``: caches split by head over the ``tp`` mesh, the rest
replicated). ``HybridPrefixCache`` slices and joins a batch-1 state along its
positions, which a global array spanning several processes does not allow
eagerly (the result's devices would include other processes', and an eager op
over them would be a collective that no barrier lines up). So each process
keeps its own part: ``SlicePrefix.local`` cuts a sharded state down to this
process's block of every leaf (the union of its devices' shards: the mesh is
ordered by process, so it is one contiguous range of heads, or the whole leaf
where it is replicated), the ``HybridPrefixCache`` stores and joins those
blocks as on a single process (its ``empty_state`` is this process's block of
an empty state), and ``SlicePrefix.shards`` / ``assemble`` put a looked-up
block back on this process's devices and make the global array. None of that
is a collective: no process waits for another.

Every process runs the same lookups and inserts in the same round order on
the same token hashes, so the caches stay identical in what they hold (bytes
are counted per process; each holds the same share, the budget is per
process). ``SlicePrefix.prefill`` first makes every process post what its
cache would reuse (``agree``, through the region's key-value store): if any
differ, every process raises ``PrefixDisagreement`` before a collective runs,
the round fails and the slice restarts as a unit (as on any lost lockstep).
Then each continues the sharded prefill from the cached prefix in chunks that
end on block boundaries (as ``api.cached_prefill``; chunked prefill is exact,
see the model tests), keeps its block of the recurrent layers at each
boundary, and afterwards inserts every boundary's KV blocks (from one copy of
the final state) and checkpoint.

Process 0 answers the broker's ProbePrefix from its own cache
(``control_plane.probe_prefix``; every process's holds the same blocks), so the
broker routes a prompt whose prefix the slice holds to the slice's local
prefill. Not done here: shipping prefixes to or from a slice (ExportPrefix
stays refused; ``pd_roles.SLICE.ships_prefixes``): a shipped prefix would
have to arrive as per-process parts, as a state does.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paas_jax.models.api import Model, prefill_bucket
from paas_jax.models.config import ModelConfig
from paas_jax.models.kinds import PrefixRule, kind_spec
from paas_jax.serving import pod
from paas_jax.state import DecodeState, abstract_state
from paas_jax.state.prefix_cache import HybridPrefixCache

# agree(mine) -> every process's ``mine`` in rank order (``lockstep.agree``).
Agree = Callable[[dict], list[dict]]


class PrefixDisagreement(RuntimeError):
  """Slice processes' prefix caches differ: the slice is out of lockstep."""


def _box(sharding, shape: tuple[int, ...], devices) -> tuple[slice, ...]:
  """The block of a global array of ``shape`` that ``devices``' shards cover
  together; raises if they do not form one box (then a process could not
  keep its part as one array)."""
  index = sharding.devices_indices_map(tuple(shape))
  box = []
  for axis, dim in enumerate(shape):
    ranges = {index[d][axis].indices(dim)[:2] for d in devices}
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    if sum(b - a for a, b in ranges) != hi - lo:
      raise ValueError(f"the shards of {sorted(ranges)} on axis {axis} are not one block")
    box.append(slice(lo, hi))
  return tuple(box)


def _relative(index: tuple[slice, ...], box: tuple[slice, ...], shape) -> tuple[slice, ...]:
  out = []
  for s, b, dim in zip(index, box, shape):
    lo, hi = s.indices(dim)[:2]
    out.append(slice(lo - b.start, hi - b.start))
  return tuple(out)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _prefill_chunk(graphdef, params, tokens, state, n_valid, out_shardings, whole):
  """One chunk continuing ``state`` (its ``lengths`` tokens in); the last valid
  position's logits, replicated, as ``pod.region_prefill_logits``."""
  logits, state = nnx.merge(graphdef, params).prefill(tokens, state, n_valid)
  last = logits[jnp.arange(logits.shape[0]), n_valid - 1].astype(jnp.float32)
  return (jax.lax.with_sharding_constraint(last, whole),
          jax.lax.with_sharding_constraint(state, out_shardings.tree))


class SlicePrefix:
  """One slice process's prefix cache (module docstring).

  Args:
    config: the model's config.
    mesh: the slice's mesh (``pod.region_mesh``).
    block_size, capacity_bytes: as ``HybridPrefixCache`` (bytes of this
      process's shards).
    devices: the devices whose shards this cache keeps (default: this
      process's devices of ``mesh``; a test can split one process's mesh).

  ``prefix_cache`` and the ``prefix_*`` counters are what
  ``common.prefix_cache_gauges`` reads, as of a ``PrefillEngine``.
  """

  def __init__(self, config: ModelConfig, mesh: Mesh, block_size: int, capacity_bytes: int,
               devices: Sequence | None = None):
    self.config = config
    self.mesh = mesh
    if devices is None:
      devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    self.devices = tuple(devices)
    self.prefix_cache = HybridPrefixCache(config, block_size, capacity_bytes,
                                          empty_state=self._empty)
    # Per layer: cached as KV blocks (positions) or as checkpoints (as the cache).
    self._growing = tuple(kind_spec(k).prefix_rule is PrefixRule.BLOCK_KV
                          for k in config.layer_kinds)
    self._layouts: dict[int, tuple] = {}
    self.prefix_prompts = 0
    self.prefix_prompts_hit = 0
    self.prefix_reused_tokens = 0
    self.prefix_released_bytes = 0  # nothing is released: no transfer owns entries here

  @property
  def block_size(self) -> int:
    return self.prefix_cache.block_size

  def _layout(self, capacity: int):
    """(treedef, [(global shape, dtype, sharding)] per leaf) of a batch-1 state
    (kept per capacity: a slice uses a few, powers of two)."""
    if capacity not in self._layouts:
      like = abstract_state(self.config, 1, capacity)
      leaves, treedef = jax.tree_util.tree_flatten(like)
      shardings = jax.tree_util.tree_leaves(pod.state_shardings(self.config, self.mesh, 1,
                                                                capacity))
      self._layouts[capacity] = (treedef, [(x.shape, x.dtype, s)
                                           for x, s in zip(leaves, shardings)])
    return self._layouts[capacity]

  def _empty(self, capacity: int) -> DecodeState:
    """This process's block of an empty (all zeros, as ``init_state``) state."""
    treedef, leaves = self._layout(capacity)
    blocks = []
    for shape, dtype, sharding in leaves:
      box = _box(sharding, shape, self.devices)
      blocks.append(jnp.zeros(tuple(b.stop - b.start for b in box), dtype))
    return jax.tree_util.tree_unflatten(treedef, blocks)

  def local(self, state: DecodeState) -> DecodeState:
    """This process's block of every leaf of the sharded batch-1 ``state``
    (copied off its devices: the cache keeps no view of a live state)."""
    def block(x):
      box = _box(x.sharding, x.shape, self.devices)
      out = np.empty(tuple(b.stop - b.start for b in box), x.dtype)
      for shard in x.addressable_shards:
        if shard.device in self.devices:
          out[_relative(shard.index, box, x.shape)] = np.asarray(shard.data)
      return jnp.asarray(out)
    return jax.tree_util.tree_map(block, state)

  def shards(self, local: DecodeState, capacity: int) -> list[dict]:
    """Per leaf of ``local`` (a block as ``local`` makes, at ``capacity``):
    device -> its shard, on this process's devices."""
    _, leaves = self._layout(capacity)
    out = []
    for x, (shape, _, sharding) in zip(jax.tree_util.tree_leaves(local), leaves):
      box = _box(sharding, shape, self.devices)
      index = sharding.devices_indices_map(tuple(shape))
      out.append({d: jax.device_put(x[_relative(index[d], box, shape)], d)
                  for d in self.devices})
    return out

  def assemble(self, capacity: int, parts: Sequence[list[dict]]) -> DecodeState:
    """The global sharded batch-1 state from ``shards`` of every process
    holding devices of this process (one part in a real slice)."""
    treedef, leaves = self._layout(capacity)
    arrays = []
    for i, (shape, _, sharding) in enumerate(leaves):
      by_device = {d: a for part in parts for d, a in part[i].items()}
      arrays.append(jax.make_array_from_single_device_arrays(
          tuple(shape), sharding, [by_device[d] for d in sharding.addressable_devices]))
    return jax.tree_util.tree_unflatten(treedef, arrays)

  def stats_key(self) -> list[int]:
    """What every process's cache must agree on (blocks, checkpoints, bytes)."""
    st = self.prefix_cache.stats
    return [st.blocks, st.checkpoints, st.nbytes]

  def insert(self, tokens: Sequence[int], state: DecodeState) -> int:
    return self.prefix_cache.insert(list(tokens), self.local(state))

  def prefill(self, model: Model, prompt: Sequence[int], capacity: int, barrier,
              agree: Agree | None = None) -> tuple[np.ndarray, DecodeState, int]:
    """The sharded prefill of ``prompt`` from its longest cached prefix.

    Every process of the slice calls it for the same prompt in the same round
    (``agree``: None on a single process).

    Returns:
      (logits f32 [vocab] of the last prompt position, identical on every
      process; the batch-1 state sharded by ``pod.state_shardings`` at
      ``capacity``; the prompt tokens taken from the cache).

    Raises:
      PrefixDisagreement: the processes' caches differ (on every process).
    """
    prompt = [int(t) for t in prompt]
    matched = self.prefix_cache.match_length(prompt)
    if agree is not None:
      mine = {"matched": matched, "cache": self.stats_key()}
      verdicts = agree(mine)
      if any(v != mine for v in verdicts):
        raise PrefixDisagreement(f"slice processes disagree on their prefix caches "
                                 f"(per process: {verdicts}): out of lockstep")
    capacity = max(capacity, len(prompt))
    reused, cached = self.prefix_cache.lookup(prompt, capacity=capacity)  # == matched
    self.prefix_prompts += 1
    self.prefix_prompts_hit += int(reused > 0)
    self.prefix_reused_tokens += reused
    shardings = pod.state_shardings(self.config, self.mesh, 1, capacity)
    if cached is None:
      state = pod.empty_state(self.config, 1, capacity, shardings)
    else:
      state = self.assemble(capacity, [self.shards(cached, capacity)])
    whole = NamedSharding(self.mesh, PartitionSpec())
    block, pos, logits = self.block_size, reused, None
    checkpoints = []  # (boundary, this process's block of the non-growing layers there)
    while pos < len(prompt):
      # Chunks end on block boundaries, so that each boundary's recurrent
      # state is there to checkpoint (as api.cached_prefill).
      end = min(len(prompt), (pos // block + 1) * block)
      tokens = np.zeros((1, prefill_bucket(end - pos)), np.int32)
      tokens[0, :end - pos] = prompt[pos:end]
      logits, state = pod.synchronized_call(
          _prefill_chunk, (0, 5, 6),
          (model.graphdef, model.params, pod.replicated(self.mesh, tokens), state,
           pod.replicated(self.mesh, np.array([end - pos], np.int32)),
           pod.StaticShardings(shardings), whole), barrier, "slice_prefix_chunk")
      if end % block == 0:
        checkpoints.append((end, self.local(tuple(
            None if growing else layer for growing, layer in zip(self._growing,
                                                                 state.layers)))))
      pos = end
    self._insert_boundaries(prompt, state, checkpoints)
    return np.asarray(logits.addressable_data(0))[0], state, reused

  def _insert_boundaries(self, prompt: list[int], state: DecodeState, checkpoints) -> None:
    """Inserts every boundary of this prefill, in order, as ``api.cached_prefill``
    does after each chunk: the KV blocks from the final state (a position's
    KV does not change once written, so one copy off the devices serves every
    boundary) with the recurrent layers as they were at that boundary."""
    if not checkpoints:
      return
    final = self.local(state)
    for end, kept in checkpoints:
      layers = tuple(full if growing else part
                     for growing, full, part in zip(self._growing, final.layers, kept))
      self.prefix_cache.insert(prompt[:end], DecodeState(
          layers=layers, lengths=jnp.full((1,), end, jnp.int32)))
