"""The manifest: what a serialized decode state contains and how to check it.

The manifest is written last (``manifest.json`` next to the arrays), so its
presence is the commit marker of a stored state; over gRPC the same JSON is
the Commit message. It lists every object of every array with its size and
crc32c, which is what lets a reader refuse a truncated or corrupted state
before any byte of it reaches a decode step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Iterator, Mapping, Sequence

import numpy as np
import orjson

from paas_jax.codec.options import CodecOptions

FORMAT = "paas-jax-decode-state"
FORMAT_VERSION = 1
MANIFEST_KEY = "manifest.json"
# Multi-process writers: each process lists only the objects it wrote.
PARTIAL_MANIFEST_PREFIX = "manifest."


def partial_manifest_key(process_index: int, process_count: int) -> str:
  return f"{PARTIAL_MANIFEST_PREFIX}{process_index:05d}-of-{process_count:05d}.json"
GLOBAL_LAYER_INDEX = -1
GLOBAL_LAYER_KIND = "state"

# orjson, not the json module: a tiny transfer's descriptors and Commit encode
# and parse one text per layer, and json's pure-Python object building was
# the largest part of both sides' fixed cost (bench_transfer --fixed_cost).
# Keys sorted and no spaces; non-str keys become strings as json.dumps does.
_JSON_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def dumps(obj) -> str:
  """Canonical manifest JSON: sorted keys, no whitespace, ASCII only."""
  text = orjson.dumps(obj, option=_JSON_OPTIONS).decode()
  if text.isascii():
    return text
  # Descriptors travel as ASCII (a BUNDLE's table gives byte lengths that the
  # receiver uses as character offsets); json escapes what orjson leaves as is.
  return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def loads(text: str | bytes | bytearray | memoryview):
  """Parses manifest JSON (ValueError if malformed)."""
  return orjson.loads(text)


def splice_groups(layer_texts: Sequence[str], state_arrays_text: str) -> str:
  """The tail of a manifest's JSON after its header's fields: the layers'
  and the state-level group's texts as they are (``StateManifest.to_json``
  with ``serialized``; a receiver compares it with the descriptors it
  adopted, ``transport.inbound.manifest_from_descriptors``)."""
  return ',"layers":[' + ",".join(layer_texts) + '],"state_arrays":' + state_arrays_text + "}"


@dataclasses.dataclass(frozen=True)
class ChunkEntry:
  """One stored object: a zarr3 chunk or an array's ``zarr.json``.

  ``key`` is relative to the state's root, e.g. ``layers/3/k/c/0/0/0/0``.
  """

  key: str
  nbytes: int
  crc32c: int

  def to_dict(self) -> dict:
    return {"key": self.key, "nbytes": self.nbytes, "crc32c": self.crc32c}

  @classmethod
  def from_dict(cls, d: dict) -> "ChunkEntry":
    return _parsed(cls, key=str(d["key"]), nbytes=int(d["nbytes"]), crc32c=int(d["crc32c"]))


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
  """One zarr3 array of the state.

  Attributes:
    name: pytree path of the leaf joined by "/", also the array's folder,
      e.g. ``layers/3/k``; a quantization scale is ``<name>@scale``.
    role: "data" or "scale".
    dtype: dtype of the leaf in the state (what restore returns).
    shape: shape of the leaf at the sender (full capacity).
    stored_dtype, stored_shape: what is in the zarr3 array. For trimmed
      caches the token axis holds only the live tokens; for a scale, the token
      axis is gone.
    token_axis, head_axis: axes of the leaf, or None.
    trim: "none", "prefix" (positions [0, n) of a growing cache) or "ring"
      (the first min(n, window) slots of a sliding-window ring buffer).
    quantization: "none", "int8" or "fp8" for role "data".
    chunk_shape: zarr3 regular chunk grid.
    chunks: every stored object of the array, including ``zarr.json``. Chunks
      whose content equals the fill value (0) are not stored and not listed.
    source_sharding: how the sender held the leaf when it spread over several
      devices, ``{"mesh": {axis: size}, "spec": [per axis: None, an axis name
      or a list of names]}`` (a ``NamedSharding``): each device's shard was
      encoded from its own buffer, in chunks that lie inside one shard. None
      for a leaf on one device or on the host (then not serialized). Readers
      re-lay the array in their own sharding; the coordinates are global.
  """

  name: str
  role: str
  dtype: str
  shape: tuple[int, ...]
  stored_dtype: str
  stored_shape: tuple[int, ...]
  token_axis: int | None
  head_axis: int | None
  trim: str
  quantization: str
  chunk_shape: tuple[int, ...]
  chunks: tuple[ChunkEntry, ...] = ()
  source_sharding: dict | None = None

  @functools.cached_property
  def nbytes(self) -> int:
    # Cached: a sender asks for it per layer and per frame (the entry is frozen).
    return sum(c.nbytes for c in self.chunks)

  @property
  def logical_nbytes(self) -> int:
    """Bytes of the live part of the leaf in its own dtype (the analytic size)."""
    if self.role != "data":
      return 0
    return int(np.prod(self.stored_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

  @property
  def metadata_key(self) -> str:
    return f"{self.name}/zarr.json"

  def to_dict(self) -> dict:
    # Field by field from the names listed once: dataclasses.asdict deep-copies
    # every chunk entry and dataclasses.fields() rebuilds its tuple per call,
    # which together were most of a tiny transfer's descriptors and Commit.
    d = {name: getattr(self, name) for name in _ARRAY_FIELDS}
    d["chunks"] = [{"key": c.key, "nbytes": c.nbytes, "crc32c": c.crc32c} for c in self.chunks]
    if self.source_sharding is not None:
      d["source_sharding"] = self.source_sharding
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "ArrayEntry":
    token_axis, head_axis = d["token_axis"], d["head_axis"]
    return _parsed(
        cls, name=str(d["name"]), role=str(d["role"]), dtype=str(d["dtype"]),
        shape=tuple(map(int, d["shape"])), stored_dtype=str(d["stored_dtype"]),
        stored_shape=tuple(map(int, d["stored_shape"])),
        token_axis=None if token_axis is None else int(token_axis),
        head_axis=None if head_axis is None else int(head_axis),
        trim=str(d["trim"]), quantization=str(d["quantization"]),
        chunk_shape=tuple(map(int, d["chunk_shape"])),
        chunks=tuple([ChunkEntry.from_dict(c) for c in d.get("chunks", ())]),
        source_sharding=_source_sharding(d.get("source_sharding")))


_ARRAY_FIELDS = tuple(f.name for f in dataclasses.fields(ArrayEntry)
                      if f.name not in ("chunks", "source_sharding"))


def _parsed(cls, **fields):
  """An instance of the frozen dataclass ``cls`` holding ``fields`` (every
  field, converted by the caller), made without ``__init__``: a frozen
  dataclass's ``__init__`` sets each field through ``object.__setattr__``,
  which was half of parsing a layer descriptor (a receiver parses one per
  layer per transfer). ``cls`` must have no ``__post_init__``."""
  obj = object.__new__(cls)
  obj.__dict__.update(fields)
  return obj


def _source_sharding(d) -> dict | None:
  """``ArrayEntry.source_sharding`` from JSON (ValueError if malformed)."""
  if d is None:
    return None
  if (not isinstance(d, dict) or not isinstance(d.get("mesh"), dict)
      or not isinstance(d.get("spec"), list)):
    raise ValueError(f"malformed source_sharding {d!r}")
  mesh = {str(k): int(v) for k, v in d["mesh"].items()}
  spec = [None if e is None else (str(e) if isinstance(e, str) else [str(x) for x in e])
          for e in d["spec"]]
  named = {e for x in spec if x is not None for e in ([x] if isinstance(x, str) else x)}
  if not named <= set(mesh) or any(v < 1 for v in mesh.values()):
    raise ValueError(f"source_sharding {d!r} names axes outside its mesh")
  return {"mesh": mesh, "spec": spec}


@dataclasses.dataclass(frozen=True)
class LayerEntry:
  """The arrays of one layer (``index >= 0``) or of the state itself (``-1``).

  ``kind`` is the cache class name, e.g. ``AttentionCache``.
  """

  index: int
  kind: str
  arrays: tuple[ArrayEntry, ...]

  @functools.cached_property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays)

  @functools.cached_property
  def num_chunks(self) -> int:
    return sum(len(a.chunks) for a in self.arrays)

  @property
  def logical_nbytes(self) -> int:
    return sum(a.logical_nbytes for a in self.arrays)

  def chunks(self) -> Iterator[tuple[ArrayEntry, ChunkEntry]]:
    for array in self.arrays:
      for chunk in array.chunks:
        yield array, chunk

  def array(self, name: str) -> ArrayEntry:
    for a in self.arrays:
      if a.name == name:
        return a
    raise KeyError(f"layer {self.index} has no array {name!r}")

  def to_dict(self) -> dict:
    return {"index": self.index, "kind": self.kind,
            "arrays": [a.to_dict() for a in self.arrays]}

  def to_json(self) -> str:
    return dumps(self.to_dict())

  @classmethod
  def from_dict(cls, d: dict) -> "LayerEntry":
    return _parsed(cls, index=int(d["index"]), kind=str(d["kind"]),
                   arrays=tuple([ArrayEntry.from_dict(a) for a in d["arrays"]]))

  @classmethod
  def from_json(cls, s: str | bytes) -> "LayerEntry":
    return cls.from_dict(loads(s))


assert not any(hasattr(c, "__post_init__") for c in (ChunkEntry, ArrayEntry, LayerEntry)), (
    "_parsed skips __post_init__")


@dataclasses.dataclass(frozen=True)
class StateManifest:
  """Everything a reader needs to verify and restore one serialized state.

  Attributes:
    model_id: the model's registry name.
    config_fingerprint: ``ModelConfig.fingerprint()``; a reader refuses any
      other.
    token_count: live tokens (max of ``lengths``); attention caches hold only
      these positions.
    batch: requests in the state.
    codec: the options it was encoded with.
    layers: one entry per layer, in layer order.
    state_arrays: arrays outside ``layers`` (e.g. ``lengths``), index -1.
    placements: for a shard-to-shard transfer between multi-process regions,
      ``{"source": ..., "target": ...}`` (``shard_plan.StatePlacement.to_dict``:
      both meshes, with the process of each device, and each leaf's
      partition spec); None otherwise (and then not serialized).
  """

  model_id: str
  config_fingerprint: str
  token_count: int
  batch: int
  codec: CodecOptions
  layers: tuple[LayerEntry, ...]
  state_arrays: LayerEntry
  format: str = FORMAT
  version: int = FORMAT_VERSION
  placements: dict | None = None

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    return tuple(layer.kind for layer in self.layers)

  @property
  def groups(self) -> tuple[LayerEntry, ...]:
    """Layers followed by the state-level arrays."""
    return self.layers + (self.state_arrays,)

  @property
  def nbytes(self) -> int:
    """Serialized bytes: every stored object, metadata included (not the manifest)."""
    return sum(g.nbytes for g in self.groups)

  @property
  def logical_nbytes(self) -> int:
    """Bytes of the live state in its own dtypes (trimmed, unquantized)."""
    return sum(g.logical_nbytes for g in self.groups)

  @property
  def num_chunks(self) -> int:
    return sum(len(a.chunks) for g in self.groups for a in g.arrays)

  def group(self, index: int) -> LayerEntry:
    return self.state_arrays if index == GLOBAL_LAYER_INDEX else self.layers[index]

  def chunk_index(self) -> dict[str, tuple[LayerEntry, ArrayEntry, ChunkEntry]]:
    """Every stored object by key, with the layer and array it belongs to."""
    out = {}
    for g in self.groups:
      for array, chunk in g.chunks():
        out[chunk.key] = (g, array, chunk)
    return out

  def to_dict(self) -> dict:
    return {**self._header(), "layers": [layer.to_dict() for layer in self.layers],
            "state_arrays": self.state_arrays.to_dict()}

  def _header(self) -> dict:
    d = {"format": self.format, "version": self.version, "model_id": self.model_id,
         "config_fingerprint": self.config_fingerprint, "token_count": self.token_count,
         "batch": self.batch, "codec": self.codec.to_dict()}
    if self.placements is not None:
      d["placements"] = self.placements
    return d

  def to_json(self, serialized: Mapping[int, tuple[LayerEntry, str]] | None = None) -> str:
    """The manifest as JSON.

    Args:
      serialized: groups already serialized (a sender's layer descriptors), by
        index: (entry, ``entry.to_json()``). When every group's entry is this
        manifest's own object, their texts are spliced in instead of encoding
        the groups again.
    """
    serialized = serialized or {}
    texts = []
    for group in self.groups:
      entry, text = serialized.get(group.index, (None, None))
      if entry is not group:
        return dumps(self.to_dict())
      texts.append(text)
    return dumps(self._header())[:-1] + splice_groups(texts[:-1], texts[-1])

  @classmethod
  def from_dict(cls, d: dict,
                known: Mapping[int, tuple[dict, LayerEntry]] | None = None) -> "StateManifest":
    """Args:
      d: ``to_dict`` of a manifest (parsed JSON).
      known: groups already parsed (a receiver's layer descriptors), by index:
        (their parsed JSON, entry). A group whose JSON equals it is that
        entry, not parsed again.
    """
    if d.get("format") != FORMAT:
      raise ValueError(f"not a paas-jax state manifest (format={d.get('format')!r})")
    if int(d.get("version", -1)) != FORMAT_VERSION:
      raise ValueError(f"unsupported state manifest version {d.get('version')!r}; "
                       f"this reader understands {FORMAT_VERSION}")
    known = known or {}

    def group(index: int, x: dict) -> LayerEntry:
      raw, entry = known.get(index, (None, None))
      return entry if raw is not None and raw == x else LayerEntry.from_dict(x)

    layers = tuple(group(i, x) for i, x in enumerate(d["layers"]))
    for i, layer in enumerate(layers):
      if layer.index != i:
        raise ValueError(f"manifest layer {i} carries index {layer.index}")
    return cls(model_id=str(d["model_id"]), config_fingerprint=str(d["config_fingerprint"]),
               token_count=int(d["token_count"]), batch=int(d["batch"]),
               codec=CodecOptions.from_dict(d["codec"]), layers=layers,
               state_arrays=group(GLOBAL_LAYER_INDEX, d["state_arrays"]),
               placements=d.get("placements"))

  @classmethod
  def from_json(cls, s: str | bytes,
                known: Mapping[int, tuple[dict, LayerEntry]] | None = None) -> "StateManifest":
    return cls.from_dict(loads(s), known)


def merge_manifests(parts: list[StateManifest]) -> StateManifest:
  """Merges the partial manifests that the processes of one sharded write produced.

  Every part describes the same arrays; each lists the objects its process
  wrote (``zarr.json`` by all of them). The merge is their union; an object
  listed by two processes with different content is an error.
  """
  if not parts:
    raise ValueError("no partial manifests to merge")
  first = parts[0]
  header = lambda m: (m.model_id, m.config_fingerprint, m.token_count, m.batch, m.codec,
                      len(m.layers))
  for m in parts[1:]:
    if header(m) != header(first):
      raise ValueError("partial manifests describe different states")

  def merge_group(groups: list[LayerEntry]) -> LayerEntry:
    arrays = []
    for i, array in enumerate(groups[0].arrays):
      chunks: dict[str, ChunkEntry] = {}
      for g in groups:
        other = g.arrays[i]
        if dataclasses.replace(other, chunks=()) != dataclasses.replace(array, chunks=()):
          raise ValueError(f"partial manifests disagree on array {array.name!r}")
        for c in other.chunks:
          if c.key in chunks and chunks[c.key] != c:
            raise ValueError(f"object {c.key!r} was written with different content by "
                             "two processes")
          chunks[c.key] = c
      arrays.append(dataclasses.replace(array, chunks=tuple(sorted(
          chunks.values(), key=lambda c: c.key))))
    return dataclasses.replace(groups[0], arrays=tuple(arrays))

  layers = tuple(merge_group([m.layers[i] for m in parts]) for i in range(len(first.layers)))
  return dataclasses.replace(first, layers=layers,
                             state_arrays=merge_group([m.state_arrays for m in parts]))
