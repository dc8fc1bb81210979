"""Encoding a decode state (or one layer of it) into zarr3 objects.

Each layer is encoded into zarr3 objects with their crc32c: with the raw
codec the chunks are cut from the arrays directly (``paas_jax.codec.chunks``,
byte-identical to what TensorStore writes, with TensorStore's own
``zarr.json``); compressed arrays are written into a private in-memory
TensorStore and read back as bytes. The bytes are then either written
to any kvstore (``encode_state``) or streamed over gRPC
(``paas_jax.transport``); both sinks see the same objects, so a state on disk
and a state on the wire verify and decode the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from paas_jax.codec import chunks as chunks_lib
from paas_jax.codec import layout
from paas_jax.codec.layout import ArrayRole
from paas_jax.codec.manifest import (GLOBAL_LAYER_INDEX, GLOBAL_LAYER_KIND, MANIFEST_KEY,
                                     ArrayEntry, ChunkEntry, LayerEntry, StateManifest,
                                     partial_manifest_key)
from paas_jax.codec.options import CodecOptions
from paas_jax.codec.quantize import quantize
from paas_jax.codec.store import KvStoreLike, MemoryStore, codec_kvstore, crc32c


@dataclasses.dataclass
class EncodedGroup:
  """One layer (or the state-level arrays) as stored objects.

  Attributes:
    entry: the manifest entry, with every object's size and crc32c.
    blobs: object key -> encoded bytes.
  """

  entry: LayerEntry
  blobs: dict[str, bytes]

  @property
  def nbytes(self) -> int:
    return sum(len(b) for b in self.blobs.values())


def token_count_of(state: Any) -> int:
  """Live tokens of a state: ``max(lengths)`` (0 for an empty batch)."""
  lengths = state.get("lengths") if isinstance(state, dict) else getattr(state, "lengths", None)
  if lengths is None:
    raise ValueError("state has no `lengths`; pass token_count explicitly")
  if isinstance(lengths, jax.Array) and not lengths.is_fully_addressable:
    if not lengths.is_fully_replicated:
      raise ValueError("lengths is sharded across processes; pass token_count explicitly")
    lengths = lengths.addressable_data(0)
  lengths = np.asarray(lengths)
  return int(lengths.max()) if lengths.size else 0


def _normalize_index(index: tuple, shape: Sequence[int]) -> list[tuple[int, int]]:
  out = []
  for s, dim in zip(index, shape):
    start, stop, step = s.indices(dim)
    if step != 1:
      raise ValueError(f"strided shard index {index} is not supported")
    out.append((start, stop))
  return out


def _host_shards(data) -> list[tuple[list[tuple[int, int]], Any]]:
  """(global box, host array) of each shard this process must write.

  Only addressable shards with replica_id 0 are written: a replicated array is
  stored once, and no process ever touches another process's data.
  """
  shape = np.shape(data)
  if not isinstance(data, jax.Array):
    return [([(0, d) for d in shape], np.asarray(data))]
  shards = [s for s in data.addressable_shards if s.replica_id == 0]
  # Start every device-to-host copy before blocking on the first one.
  for s in shards:
    s.data.copy_to_host_async()
  return [(_normalize_index(s.index, shape), s.data) for s in shards]


def source_sharding(leaf) -> dict | None:
  """``ArrayEntry.source_sharding`` of a leaf: its mesh and partition spec when it
  is a ``jax.Array`` spread over several devices by a ``NamedSharding``."""
  sharding = getattr(leaf, "sharding", None)
  if (not isinstance(leaf, jax.Array) or not isinstance(sharding, jax.sharding.NamedSharding)
      or len(sharding.device_set) < 2):
    return None
  spec = list(sharding.spec) + [None] * (leaf.ndim - len(sharding.spec))
  return {"mesh": {str(k): int(v) for k, v in sharding.mesh.shape.items()},
          "spec": [None if e is None else (e if isinstance(e, str) else list(e))
                   for e in spec]}


def spans_devices(x) -> bool:
  """True for a ``jax.Array`` whose data lies on several devices (sharded or replicated)."""
  return isinstance(x, jax.Array) and len(x.sharding.device_set) > 1


def wire_arrays(tree: Any) -> Any:
  """A (sliced) cache ready for encoding without a gather: leaves spread over
  several devices stay device arrays, each shard's copy to the host started
  (the encoder reads every shard from its own buffer); other leaves become
  numpy arrays (waits for their copy)."""
  def one(x):
    if spans_devices(x):
      for s in x.addressable_shards:
        if s.replica_id == 0:
          s.data.copy_to_host_async()
      return x
    return np.asarray(x)
  return jax.tree_util.tree_map(one, tree)


def _dimension_names(ndim: int, role: ArrayRole, drop_token_axis: bool = False) -> list:
  names: list = [None] * ndim
  if role.batch_axis:
    names[0] = "batch"
  if role.token_axis is not None:
    names[role.token_axis] = "tokens"
  if role.head_axis is not None:
    names[role.head_axis] = "heads"
  if drop_token_axis and role.token_axis is not None:
    del names[role.token_axis]
  return names


def _open_array(store: MemoryStore, name: str, shape, dtype: np.dtype, chunk,
                options: CodecOptions, dim_names: list, wait: bool = True):
  spec = store.zarr_spec(name)
  spec.update({
      "metadata": {
          "shape": list(shape),
          "data_type": np.dtype(dtype).name,
          "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
          "codecs": options.zarr_codecs(np.dtype(dtype).itemsize),
          "dimension_names": dim_names,
      },
      "create": True,
  })
  opened = ts.open(spec, context=store.context)
  return opened.result() if wait else opened


class _ArrayWriter:
  """Writes the arrays of one group: raw-codec arrays are chunked here
  (``chunks.encode_raw_chunks``), everything else goes through a private
  TensorStore memory store, opened only if some array needs it."""

  def __init__(self, options: CodecOptions):
    self.options = options
    self.objects: dict[str, tuple[bytes, int | None]] = {}  # key -> (bytes, crc or None)
    self._store: MemoryStore | None = None
    self._opens: list = []  # (open future, data, stored shape)

  def write(self, name: str, data, stored_shape: Sequence[int], dtype: np.dtype, chunk,
            dim_names: list) -> None:
    options = self.options
    if options.compression == "raw":
      shards = _host_shards(data)
      raw = chunks_lib.encode_raw_chunks(name, shards, stored_shape, chunk, dtype)
      if raw is not None:
        meta = chunks_lib.metadata_json(stored_shape, dtype, chunk,
                                        options.zarr_codecs(np.dtype(dtype).itemsize),
                                        dim_names)
        self.objects[f"{name}/zarr.json"] = (meta, None)
        self.objects.update(raw)
        return
    if self._store is None:
      self._store = MemoryStore()
    # Opened now, written in finish(): every array's open runs concurrently.
    self._opens.append((_open_array(self._store, name, stored_shape, dtype, chunk, options,
                                    dim_names, wait=False), data, stored_shape))

  def finish(self) -> tuple[dict[str, bytes], dict[str, int]]:
    """(key -> bytes, key -> crc32c) of every object, sorted by key."""
    try:
      futures = []
      for opened, data, stored_shape in self._opens:
        futures += _write_shards(opened.result(), data, stored_shape)
      for f in futures:
        f.result()
      if self._store is not None:
        for key, value in self._store.read_all().items():
          self.objects[key] = (value, None)
    finally:
      if self._store is not None:
        self._store.close()
    blobs, crcs = {}, {}
    for key in sorted(self.objects):
      value, crc = self.objects[key]
      blobs[key] = value
      crcs[key] = crc32c(value) if crc is None else crc
    return blobs, crcs


def _write_shards(arr: ts.TensorStore, data, stored_shape: Sequence[int]) -> list:
  """Writes each local shard's intersection with the stored box; returns futures."""
  futures = []
  for box, shard in _host_shards(data):
    clipped = [(lo, min(hi, int(n))) for (lo, hi), n in zip(box, stored_shape)]
    if any(hi <= lo for lo, hi in clipped):
      continue
    local = tuple(slice(0, hi - lo) for lo, hi in clipped)
    host = np.asarray(shard)[local]
    target = arr[tuple(slice(lo, hi) for lo, hi in clipped)]
    futures.append(target.write(host))
  return futures


def encode_arrays(layer_index: int, kind: str,
                  leaves: Sequence[tuple[str, Any, ArrayRole]], *, token_count: int,
                  options: CodecOptions) -> EncodedGroup:
  """Encodes named leaves into stored objects.

  Args:
    layer_index: layer number, or -1 for state-level arrays.
    kind: cache class name recorded in the manifest.
    leaves: (name, array, role); arrays are jax.Array (any sharding) or numpy.
    token_count: live positions kept along token axes of trimmed roles.
    options: codec options.
  """
  writer = _ArrayWriter(options)
  pending: list[ArrayEntry] = []
  for name, leaf, role in leaves:
    shape = tuple(int(s) for s in np.shape(leaf))
    dtype = np.dtype(leaf.dtype)
    stored_shape = list(shape)
    if role.token_axis is not None:
      stored_shape[role.token_axis] = layout.live_extent(role, shape[role.token_axis],
                                                         token_count)
    stored_shape = tuple(stored_shape)
    quant = options.quantization
    if not (role.quantizable and quant != "none" and jnp.issubdtype(dtype, jnp.floating)):
      quant = "none"
    data, scale = leaf, None
    if quant != "none":
      data, scale = quantize(leaf, stored_shape[role.token_axis], kind=quant,
                             token_axis=role.token_axis)
    stored_dtype = np.dtype(data.dtype)
    shard_shape, sharded_axes = layout.shard_layout(leaf)
    chunk = layout.chunk_shape(stored_shape, shard_shape, sharded_axes,
                               stored_dtype.itemsize, role, options.chunk_bytes,
                               options.heads_per_chunk)
    writer.write(name, data, stored_shape, stored_dtype, chunk,
                 _dimension_names(len(shape), role))
    pending.append(ArrayEntry(
        name=name, role="data", dtype=dtype.name, shape=shape,
        stored_dtype=stored_dtype.name, stored_shape=stored_shape,
        token_axis=role.token_axis, head_axis=role.head_axis, trim=role.trim,
        quantization=quant, chunk_shape=chunk, source_sharding=source_sharding(leaf)))
    if scale is not None:
      t = role.token_axis
      scale_shape = tuple(s for i, s in enumerate(stored_shape) if i != t)
      scale_shard, scale_sharded = layout.shard_layout(scale)
      scale_role = ArrayRole(head_axis=None if role.head_axis is None else
                             role.head_axis - (role.head_axis > t),
                             batch_axis=role.batch_axis)
      scale_chunk = layout.chunk_shape(scale_shape, scale_shard, scale_sharded, 4,
                                       scale_role, options.chunk_bytes,
                                       options.heads_per_chunk)
      scale_name = f"{name}@scale"
      writer.write(scale_name, scale, scale_shape, np.dtype(np.float32), scale_chunk,
                   _dimension_names(len(shape), role, drop_token_axis=True))
      pending.append(ArrayEntry(
          name=scale_name, role="scale", dtype="float32", shape=scale_shape,
          stored_dtype="float32", stored_shape=scale_shape, token_axis=None,
          head_axis=scale_role.head_axis, trim="none", quantization="none",
          chunk_shape=scale_chunk))
  blobs, crcs = writer.finish()

  arrays = []
  for entry in pending:
    prefix = entry.name + "/"
    chunks = tuple(ChunkEntry(key=k, nbytes=len(v), crc32c=crcs[k])
                   for k, v in blobs.items() if k.startswith(prefix))
    arrays.append(dataclasses.replace(entry, chunks=chunks))
  return EncodedGroup(entry=LayerEntry(index=layer_index, kind=kind, arrays=tuple(arrays)),
                      blobs=blobs)


def encode_layer(layer_index: int, layer: Any, *, token_count: int,
                 options: CodecOptions = CodecOptions()) -> EncodedGroup:
  """Encodes one layer cache (e.g. ``AttentionCache``) of a state.

  Args:
    layer_index: its position in ``DecodeState.layers``.
    layer: the cache; arrays may be sharded jax arrays (each addressable shard
      is written where it is, without a gather) or numpy arrays.
    token_count: live tokens of the request (``max(lengths)`` after prefill).
  """
  return encode_arrays(layer_index, layout.layer_kind(layer),
                       layout.layer_leaves(layer_index, layer),
                       token_count=token_count, options=options)


def encode_state_arrays(named: Sequence[tuple[str, Any]], *,
                        options: CodecOptions = CodecOptions()) -> EncodedGroup:
  """Encodes the state-level arrays (everything outside ``layers``), exactly."""
  return encode_arrays(GLOBAL_LAYER_INDEX, GLOBAL_LAYER_KIND,
                       [(n, leaf, layout.EXACT) for n, leaf in named],
                       token_count=0, options=options)


def encode_groups(state: Any, *, options: CodecOptions = CodecOptions(),
                  token_count: int | None = None) -> Iterator[EncodedGroup]:
  """Yields each layer's ``EncodedGroup`` in order, then the state-level arrays."""
  if token_count is None:
    token_count = token_count_of(state)
  layers, rest = layout.split_state(state)
  for i, layer in enumerate(layers):
    yield encode_layer(i, layer, token_count=token_count, options=options)
  yield encode_state_arrays(rest, options=options)


def build_manifest(groups: Sequence[LayerEntry], *, model_id: str, config_fingerprint: str,
                   token_count: int, batch: int, options: CodecOptions) -> StateManifest:
  """Assembles the manifest from per-layer entries (any order) and the state arrays."""
  layers = sorted((g for g in groups if g.index != GLOBAL_LAYER_INDEX), key=lambda g: g.index)
  state_arrays = [g for g in groups if g.index == GLOBAL_LAYER_INDEX]
  if len(state_arrays) != 1:
    raise ValueError(f"expected exactly one state-level group, got {len(state_arrays)}")
  for i, g in enumerate(layers):
    if g.index != i:
      raise ValueError(f"layers must be 0..{len(layers) - 1} without gaps; got index "
                       f"{g.index} at position {i}")
  return StateManifest(model_id=model_id, config_fingerprint=config_fingerprint,
                       token_count=token_count, batch=batch, codec=options,
                       layers=tuple(layers), state_arrays=state_arrays[0])


def batch_of(state: Any) -> int:
  lengths = state.get("lengths") if isinstance(state, dict) else getattr(state, "lengths", None)
  return 0 if lengths is None else int(np.shape(lengths)[0])


def encode_state(state: Any, dest: KvStoreLike, *, model_id: str, config_fingerprint: str,
                 options: CodecOptions = CodecOptions(), token_count: int | None = None,
                 process_index: int | None = None,
                 process_count: int | None = None) -> StateManifest:
  """Serializes a whole state into any TensorStore kvstore and returns its manifest.

  Layout under ``dest``: one zarr3 array per leaf at ``<leaf path>/`` (e.g.
  ``layers/3/k/zarr.json``, ``layers/3/k/c/0/0/0/0``) and ``manifest.json``,
  written last as the commit marker. An older manifest at ``dest`` is deleted
  first, so a crash part-way leaves a store that readers refuse rather than a
  mix of two states. Objects of an older state that the new manifest does not
  list are never read.

  Args:
    state: ``DecodeState`` (or any pytree; see ``layout.split_state``).
    dest: URL such as ``file:///path/``, ``gs://bucket/path/``, a JSON spec,
      a ``ts.KvStore`` or a ``MemoryStore``.
    model_id, config_fingerprint: recorded and checked on restore.
    token_count: live tokens; default ``max(state.lengths)``.
    process_index, process_count: default ``jax.process_index()`` /
      ``jax.process_count()``. With several processes each one writes only
      the shards it holds and a partial manifest listing them
      (``manifest.<i>-of-<n>.json``); readers merge all n parts and refuse
      the state while any is missing.

  Returns:
    The manifest of what this process wrote.
  """
  if process_index is None:
    process_index = jax.process_index()
  if process_count is None:
    process_count = jax.process_count()
  manifest_key = (MANIFEST_KEY if process_count == 1
                  else partial_manifest_key(process_index, process_count))
  kv = codec_kvstore(dest)
  kv.write(manifest_key, None).result()
  if token_count is None:
    token_count = token_count_of(state)
  entries, in_flight = [], []
  for group in encode_groups(state, options=options, token_count=token_count):
    entries.append(group.entry)
    # Writing layer i overlaps encoding layer i+1; at most two layers of bytes
    # are held at once.
    previous, in_flight = in_flight, [kv.write(k, v) for k, v in group.blobs.items()]
    for f in previous:
      f.result()
  for f in in_flight:
    f.result()
  manifest = build_manifest(entries, model_id=model_id, config_fingerprint=config_fingerprint,
                            token_count=token_count, batch=batch_of(state), options=options)
  kv.write(manifest_key, manifest.to_json().encode()).result()
  return manifest
