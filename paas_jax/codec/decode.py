"""Verifying and restoring a serialized decode state.

Restore never trusts storage: every object listed in the manifest is read,
checked against its size and crc32c, and staged in a private in-memory
store before anything is decoded from it (raw-codec arrays straight from the
staged objects, others through TensorStore), so a bad object fails the whole
restore with an error naming its layer and chunk and no partial state is
returned. Arrays are restored into the reader's template: its capacity (the
live tokens are padded back with zeros), its dtype and its sharding (each
device reads only its own slice, so TP=8 on the sender and TP=2 or 1 here
just work).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np
import tensorstore as ts

from paas_jax.codec import chunks as chunks_lib
from paas_jax.codec import layout
from paas_jax.codec.errors import (ChunkIntegrityError, CodecError, FingerprintMismatchError,
                                   IncompleteStateError, LayoutMismatchError)
from paas_jax.codec.manifest import (GLOBAL_LAYER_INDEX, MANIFEST_KEY, PARTIAL_MANIFEST_PREFIX,
                                     ArrayEntry, ChunkEntry, LayerEntry, StateManifest,
                                     merge_manifests)
from paas_jax.codec.quantize import dequantize
from paas_jax.codec.store import KvStoreLike, MemoryStore, codec_kvstore, crc32c

# A sharding for every leaf: a pytree matching the template (Sharding or None
# leaves), or a function of (leaf name, template leaf).
ShardingsLike = Any | Callable[[str, Any], Any] | None


def _parse_manifest(kv: ts.KvStore, key: str, data: bytes) -> StateManifest:
  try:
    return StateManifest.from_json(data)
  except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
    raise CodecError(f"{key} in {kv.url} is not a valid state manifest: {e}") from e


def _read_partial_manifests(kv: ts.KvStore) -> StateManifest | None:
  """Merges ``manifest.<i>-of-<n>.json`` of a multi-process write, if any."""
  keys = [k.decode() for k in kv.list(ts.KvStore.KeyRange(
      PARTIAL_MANIFEST_PREFIX, PARTIAL_MANIFEST_PREFIX[:-1] + "/")).result()]
  parts = {}
  for key in keys:
    m = re.fullmatch(r"manifest\.(\d+)-of-(\d+)\.json", key)
    if m:
      parts.setdefault(int(m.group(2)), {})[int(m.group(1))] = key
  if not parts:
    return None
  if len(parts) > 1:
    raise CodecError(f"partial manifests of writes with different process counts "
                     f"{sorted(parts)} in {kv.url}")
  (count, found), = parts.items()
  missing = sorted(set(range(count)) - set(found))
  if missing:
    raise IncompleteStateError(
        f"{kv.url}: partial manifests of processes {missing} (of {count}) are missing: "
        "the sharded write never completed; refusing to read a partial state")
  manifests = []
  for i in range(count):
    result = kv.read(found[i]).result()
    manifests.append(_parse_manifest(kv, found[i], result.value))
  try:
    return merge_manifests(manifests)
  except ValueError as e:
    raise CodecError(f"{kv.url}: {e}") from e


def read_manifest(where: KvStoreLike) -> StateManifest:
  """Reads ``manifest.json`` (or merges a multi-process write's partial manifests).

  Raises ``IncompleteStateError`` if the state was never committed.
  """
  kv = codec_kvstore(where)
  result = kv.read(MANIFEST_KEY).result()
  if result.state == "value":
    return _parse_manifest(kv, MANIFEST_KEY, result.value)
  merged = _read_partial_manifests(kv)
  if merged is None:
    raise IncompleteStateError(
        f"no {MANIFEST_KEY} in {kv.url}: the state was never committed (or its writer "
        "died part-way); refusing to read a partial state")
  return merged


def check_identity(manifest: StateManifest, *, expected_model_id: str | None = None,
                   expected_fingerprint: str | None = None) -> None:
  """Raises ``FingerprintMismatchError`` unless the state belongs to the reader's model."""
  if ((expected_fingerprint is not None
       and manifest.config_fingerprint != expected_fingerprint)
      or (expected_model_id is not None and manifest.model_id != expected_model_id)):
    raise FingerprintMismatchError(
        expected_model_id=expected_model_id, expected_fingerprint=expected_fingerprint,
        got_model_id=manifest.model_id, got_fingerprint=manifest.config_fingerprint)


def check_blob(chunk: ChunkEntry, data: bytes | None) -> str | None:
  """Why ``data`` is not the object ``chunk`` describes, or None if it is."""
  if data is None:
    return "missing"
  if len(data) < chunk.nbytes:
    return f"truncated: {len(data)} of {chunk.nbytes} bytes"
  if len(data) > chunk.nbytes:
    return f"size mismatch: {len(data)} bytes where the manifest lists {chunk.nbytes}"
  got = crc32c(data)
  if got != chunk.crc32c:
    return f"crc32c mismatch: data has 0x{got:08x}, manifest lists 0x{chunk.crc32c:08x}"
  return None


def fetch_group(kv: ts.KvStore, group: LayerEntry) -> dict[str, bytes]:
  """Reads and verifies every object of one layer; raises ``ChunkIntegrityError``."""
  reads = [(array, chunk, kv.read(chunk.key)) for array, chunk in group.chunks()]
  blobs = {}
  for array, chunk, future in reads:
    result = future.result()
    data = result.value if result.state == "value" else None
    reason = check_blob(chunk, data)
    if reason is not None:
      raise ChunkIntegrityError(layer_index=group.index, layer_kind=group.kind,
                                array=array.name, key=chunk.key, reason=reason)
    blobs[chunk.key] = data
  return blobs


def _intersect(index: tuple, target_shape, stored_shape):
  """(read box in the stored array, destination slice in the output) of one
  device slice; None if the slice is all padding."""
  src, dst = [], []
  for s, tdim, sdim in zip(index, target_shape, stored_shape):
    start, stop, _ = s.indices(tdim)
    hi = min(stop, sdim)
    if hi <= start:
      return None
    src.append(slice(start, hi))
    dst.append(slice(0, hi - start))
  return tuple(src), tuple(dst)


def _check_fits(group: LayerEntry, entry: ArrayEntry, shape: tuple, dtype: np.dtype) -> None:
  where = ("state-level" if group.index == GLOBAL_LAYER_INDEX
           else f"layer {group.index} ({group.kind})")

  def fail(msg):
    raise LayoutMismatchError(f"{where}, array {entry.name!r}: {msg}")

  if np.dtype(entry.dtype) != dtype:
    fail(f"stored as {entry.dtype}, template wants {dtype.name}")
  if len(shape) != len(entry.shape):
    fail(f"stored rank {len(entry.shape)} (shape {entry.shape}), template shape {shape}")
  for axis, (want, have, full) in enumerate(zip(shape, entry.stored_shape, entry.shape)):
    if axis == entry.token_axis and entry.trim == "prefix":
      if want < have:
        fail(f"{have} live tokens do not fit the template's capacity {want}")
    elif axis == entry.token_axis and entry.trim == "ring":
      if want != full:
        fail(f"ring buffer of window {full} cannot be restored into window {want}")
    elif want != have:
      fail(f"stored shape {entry.stored_shape} does not match template shape {shape} "
           f"on axis {axis}")


def _template_sharding(name: str, leaf: Any, shardings: ShardingsLike, flat_shardings):
  if callable(shardings) and not isinstance(shardings, jax.sharding.Sharding):
    return shardings(name, leaf)
  if flat_shardings is not None:
    return flat_shardings[name]
  return getattr(leaf, "sharding", None)


_ALIGN = 64


def _host_array(shape: tuple, dtype: np.dtype, *, zero: bool) -> np.ndarray:
  """A fresh host array aligned to 64 bytes, which lets ``jax.device_put`` on
  the CPU backend adopt it instead of copying it (the codec never touches it
  again); zero-filled if ``zero`` (calloc'd pages, zeroed lazily by the OS)."""
  nbytes = math.prod(shape) * dtype.itemsize
  raw = (np.zeros if zero else np.empty)(nbytes + _ALIGN, np.uint8)
  offset = -raw.ctypes.data % _ALIGN
  return raw[offset:offset + nbytes].view(dtype).reshape(shape)


class _StoredArray:
  """Reads boxes of one verified zarr3 array of a ``MemoryStore``.

  Raw-codec arrays are read straight from the store's objects
  (``chunks.read_raw_box``); any other array (compressed, or metadata the
  fast path does not recognise) through TensorStore's zarr3 driver.
  """

  def __init__(self, store: MemoryStore, entry: ArrayEntry):
    self.store = store
    self.entry = entry
    self.stored_dtype = np.dtype(ts.dtype(entry.stored_dtype).numpy_dtype)
    self._raw = chunks_lib.raw_layout(store.get(entry.metadata_key), entry.stored_shape,
                                      entry.stored_dtype)
    self._ts: ts.TensorStore | None = None

  def _tensorstore(self) -> ts.TensorStore:
    if self._ts is None:
      self._ts = ts.open(self.store.zarr_spec(self.entry.name), context=self.store.context,
                         open=True, read=True).result()
    return self._ts

  def read(self, src: tuple, out: np.ndarray | None = None) -> np.ndarray:
    """Box ``src`` (slices with explicit bounds) of the stored array, into
    ``out`` (exactly the box's shape) when given."""
    if self._raw is not None:
      dtype, chunk = self._raw
      target = out if out is not None else np.empty(
          tuple(s.stop - s.start for s in src), dtype)
      try:
        chunks_lib.read_raw_box(self.store.get, self.entry.name, self.entry.stored_shape,
                                dtype, chunk, src, target)
        return target
      except chunks_lib.BadChunkError:
        self._raw = None  # Let TensorStore read (and reject) it.
    data = self._tensorstore()[src].read().result()
    if out is None:
      return data
    out[...] = data
    return out


def restore_array(store: MemoryStore, group: LayerEntry, entry: ArrayEntry, shape: tuple,
                  dtype: np.dtype, sharding: jax.sharding.Sharding | None, *,
                  as_numpy: bool = False):
  """Restores one array from a verified store into ``shape`` / ``dtype`` / ``sharding``.

  Live positions are copied, the rest of the template's capacity is zero; each
  device reads only the part of the stored array that its slice covers.
  """
  shape = tuple(int(s) for s in shape)
  dtype = np.dtype(dtype)
  read_slice = _slice_reader(store, group, entry, shape, dtype)
  if as_numpy:
    return read_slice(tuple(slice(None) for _ in shape))
  if sharding is None:
    # Uncommitted, like the output of an ordinary jitted prefill: a committed
    # array would make the decode step's jit cache miss and recompile.
    return jax.device_put(read_slice(tuple(slice(None) for _ in shape)))
  return jax.make_array_from_callback(shape, sharding, read_slice)


def _slice_reader(store: MemoryStore, group: LayerEntry, entry: ArrayEntry, shape: tuple,
                  dtype: np.dtype) -> Callable[[tuple], np.ndarray]:
  """Checks that the entry fits ``shape``/``dtype``; returns index -> host slice."""
  _check_fits(group, entry, shape, dtype)
  arr = _StoredArray(store, entry)
  scale = None
  if entry.quantization != "none":
    scale_entry = group.array(f"{entry.name}@scale")
    scale_array = _StoredArray(store, scale_entry)
    scale = scale_array.read(tuple(slice(0, n) for n in scale_entry.stored_shape))
  t = entry.token_axis

  def read_slice(index: tuple) -> np.ndarray:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out_shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, shape))
    boxes = _intersect(index, shape, entry.stored_shape)
    if boxes is None:
      return np.zeros(out_shape, dtype)
    src, dst = boxes
    box_shape = tuple(s.stop - s.start for s in src)
    if scale is None and arr.stored_dtype == dtype:
      # Straight into the output: no intermediate copy of the box.
      out = _host_array(out_shape, dtype, zero=box_shape != out_shape)
      arr.read(src, out[dst])
      return out
    data = arr.read(src)
    if scale is not None:
      data = dequantize(data, scale[tuple(s for i, s in enumerate(src) if i != t)],
                        token_axis=t, dtype=dtype)
    out = _host_array(out_shape, dtype, zero=data.shape != out_shape)
    out[dst] = data
    return out

  return read_slice


def _template_index(like: Any, shardings: ShardingsLike):
  named = layout.named_leaves(like)
  flat_shardings = None
  if shardings is not None and not callable(shardings):
    leaves = jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding))
    if len(leaves) != len(named):
      raise LayoutMismatchError(f"shardings has {len(leaves)} leaves, template has "
                                f"{len(named)}")
    flat_shardings = {n: s for (n, _), s in zip(named, leaves)}
  return named, flat_shardings


def check_template(manifest: StateManifest, like: Any) -> None:
  """Raises ``LayoutMismatchError`` unless ``like`` has exactly the manifest's layers and arrays."""
  layers, _ = layout.split_state(like)
  if layers and len(layers) != len(manifest.layers):
    raise LayoutMismatchError(f"state has {len(manifest.layers)} layers, template has "
                              f"{len(layers)}")
  for layer, entry in zip(layers, manifest.layers):
    if layout.layer_kind(layer) != entry.kind:
      raise LayoutMismatchError(f"layer {entry.index} is {entry.kind} in the state but "
                                f"{layout.layer_kind(layer)} in the template")
  stored = {a.name for g in manifest.groups for a in g.arrays if a.role == "data"}
  wanted = {n for n, _ in layout.named_leaves(like)}
  if stored != wanted:
    raise LayoutMismatchError(
        f"arrays differ: only in the state {sorted(stored - wanted)}, only in the "
        f"template {sorted(wanted - stored)}")


class RestoreTemplate:
  """The template's leaves and shardings by name, computed once per restore.

  Build it once per transfer (``RestoreTemplate(like, shardings)``) and pass it
  to ``restore_indexed_group`` for every layer, instead of re-indexing ``like``
  per layer as ``restore_group`` does.
  """

  def __init__(self, like: Any, shardings: ShardingsLike):
    named, self.flat_shardings = _template_index(like, shardings)
    self.leaves = dict(named)
    self.shardings = shardings


def restore_group(store: MemoryStore, group: LayerEntry, like: Any,
                  shardings: ShardingsLike = None) -> dict[str, Any]:
  """Restores the data arrays of one group; returns name -> array.

  ``like`` is the full template state (only the group's leaves are used).
  """
  return restore_indexed_group(store, group, RestoreTemplate(like, shardings))


def restore_indexed_group(store: MemoryStore, group: LayerEntry, template: RestoreTemplate
                          ) -> dict[str, Any]:
  """``restore_group`` with a template indexed beforehand (see ``RestoreTemplate``)."""
  out, uncommitted = _restore_group_host(store, group, template)
  out.update(_device_put_uncommitted(uncommitted))
  return out


def _device_put_uncommitted(host: Mapping[str, np.ndarray]) -> dict[str, Any]:
  # Uncommitted, like the output of an ordinary jitted prefill: a committed
  # array would make the decode step's jit cache miss and recompile. One
  # batched transfer instead of one dispatch per array.
  if not host:
    return {}
  return dict(zip(host, jax.device_put(list(host.values()))))


def _restore_group_host(store: MemoryStore, group: LayerEntry, template: RestoreTemplate
                        ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(restored arrays, name -> host array of leaves still to be device_put
  uncommitted)."""
  out = {}
  uncommitted = {}
  for entry in group.arrays:
    if entry.role != "data":
      continue
    if entry.name not in template.leaves:
      raise LayoutMismatchError(f"template has no leaf {entry.name!r}")
    leaf = template.leaves[entry.name]
    sharding = _template_sharding(entry.name, leaf, template.shardings,
                                  template.flat_shardings)
    shape = tuple(int(s) for s in np.shape(leaf))
    if isinstance(leaf, np.ndarray) or sharding is None:
      read_slice = _slice_reader(store, group, entry, shape, np.dtype(leaf.dtype))
      host = read_slice(tuple(slice(None) for _ in shape))
      if isinstance(leaf, np.ndarray):
        out[entry.name] = host
      else:
        uncommitted[entry.name] = host
    else:
      out[entry.name] = restore_array(store, group, entry, shape, np.dtype(leaf.dtype),
                                      sharding)
  return out, uncommitted


class _BatchedRestore:
  """Restores groups one after another, moving uncommitted host arrays to the
  device in batches of up to ``_DEVICE_PUT_BATCH_BYTES``."""

  def __init__(self, template: RestoreTemplate):
    self.template = template
    self.restored: dict[str, Any] = {}
    self._host: dict[str, np.ndarray] = {}
    self._host_bytes = 0

  def add(self, store: MemoryStore, group: LayerEntry) -> None:
    out, host = _restore_group_host(store, group, self.template)
    self.restored.update(out)
    self._host.update(host)
    self._host_bytes += sum(a.nbytes for a in host.values())
    if self._host_bytes >= _DEVICE_PUT_BATCH_BYTES:
      self.flush()

  def flush(self) -> dict[str, Any]:
    self.restored.update(_device_put_uncommitted(self._host))
    self._host, self._host_bytes = {}, 0
    return self.restored


_DEVICE_PUT_BATCH_BYTES = 64 << 20


def assemble(like: Any, restored: Mapping[str, Any]) -> Any:
  """Builds the state pytree from restored arrays named as ``like``'s leaves."""
  named = layout.named_leaves(like)
  treedef = jax.tree_util.tree_structure(like)
  return jax.tree_util.tree_unflatten(treedef, [restored[n] for n, _ in named])


def restore_from_store(store: MemoryStore, manifest: StateManifest, like: Any,
                       shardings: ShardingsLike = None) -> Any:
  """Restores a full state from an already verified in-memory store."""
  check_template(manifest, like)
  batch = _BatchedRestore(RestoreTemplate(like, shardings))
  for group in manifest.groups:
    batch.add(store, group)
  return assemble(like, batch.flush())


def decode_state(where: KvStoreLike, *, like: Any, shardings: ShardingsLike = None,
                 expected_model_id: str | None = None,
                 expected_fingerprint: str | None = None,
                 manifest: StateManifest | None = None) -> Any:
  """Verifies and restores a state written by ``encode_state``.

  Args:
    where: the kvstore the state was written to.
    like: template pytree (concrete arrays or ``jax.ShapeDtypeStruct``s, e.g.
      ``paas_jax.state.abstract_state(config, batch, capacity)``) giving the
      receiver's capacity, dtypes and, via their ``.sharding``, placement.
      numpy leaves are restored as numpy arrays.
    shardings: overrides placement: a pytree like ``like`` with Sharding (or
      None) leaves, or ``f(name, template_leaf) -> Sharding``.
    expected_model_id, expected_fingerprint: refuse states of other models.
    manifest: skip reading ``manifest.json`` (already read).

  Returns:
    The state with ``like``'s structure.

  Raises:
    IncompleteStateError: no manifest.
    FingerprintMismatchError: another model or config.
    ChunkIntegrityError: an object is missing, truncated or corrupted (the
      message names the layer and the chunk).
    LayoutMismatchError: the state does not fit the template.
  """
  kv = codec_kvstore(where)
  if manifest is None:
    manifest = read_manifest(kv)
  check_identity(manifest, expected_model_id=expected_model_id,
                 expected_fingerprint=expected_fingerprint)
  check_template(manifest, like)
  batch = _BatchedRestore(RestoreTemplate(like, shardings))
  # One layer at a time, so at most one layer's encoded bytes are staged.
  for group in manifest.groups:
    store = MemoryStore()
    try:
      store.put_many(fetch_group(kv, group))
      batch.add(store, group)
    finally:
      store.close()
  return assemble(like, batch.flush())


def verify_state(where: KvStoreLike, manifest: StateManifest | None = None) -> StateManifest:
  """Checks every object of a stored state without decoding it; returns the manifest."""
  kv = codec_kvstore(where)
  if manifest is None:
    manifest = read_manifest(kv)
  for group in manifest.groups:
    fetch_group(kv, group)
  return manifest
