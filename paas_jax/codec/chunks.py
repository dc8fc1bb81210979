"""Raw zarr3 chunks built and read directly, without a TensorStore round trip.

With the ``raw`` codec (a lone ``bytes`` codec, little endian) a zarr3 chunk
is exactly the C-order bytes of the chunk's box of the array, edge chunks
padded with the fill value (0) to the full chunk shape, and a chunk whose
bytes all equal the fill value is not stored at all. That is what TensorStore
writes and reads (``tests/codec/test_chunks.py`` checks both directions
object by object), so these objects are ordinary zarr3 arrays; building them
here skips, per array, opening a TensorStore array, writing into its memory
kvstore and reading every object back out of it, and on restore, copying
every object into a TensorStore memory kvstore and reading it back through a
zarr3 driver.

``zarr.json`` itself is always TensorStore's own: it is produced once per
distinct (shape, dtype, chunk grid, codecs, dimension names) by creating the
array with TensorStore, and cached.

Anything else (compressed codecs, a shard layout whose chunks are not each
inside one local shard, metadata this module does not recognise) goes through
TensorStore as before: the callers ask ``*_fast_path`` first.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import sys
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

from paas_jax.codec.store import crc32c, zeros_crc32c

_RAW_CODECS = ({"name": "bytes"},
               {"name": "bytes", "configuration": {"endian": "little"}})
_LITTLE_ENDIAN = sys.byteorder == "little"


@functools.lru_cache(maxsize=1024)
def _metadata_json(shape: tuple, data_type: str, chunk: tuple, codecs_json: str,
                   dim_names: tuple) -> bytes:
  context = ts.Context()
  kv = ts.KvStore.open({"driver": "memory"}, context=context).result()
  ts.open({"driver": "zarr3", "kvstore": {"driver": "memory", "path": "a/"},
           "metadata": {"shape": list(shape), "data_type": data_type,
                        "chunk_grid": {"name": "regular",
                                       "configuration": {"chunk_shape": list(chunk)}},
                        "codecs": json.loads(codecs_json),
                        "dimension_names": list(dim_names)},
           "create": True}, context=context).result()
  value = kv.read("a/zarr.json").result().value
  if not value:
    raise RuntimeError("TensorStore wrote no zarr.json")
  return bytes(value)


def metadata_json(shape: Sequence[int], dtype: np.dtype, chunk: Sequence[int],
                  codecs: list[dict], dim_names: Sequence[Any]) -> bytes:
  """The ``zarr.json`` TensorStore writes when it creates this zarr3 array."""
  return _metadata_json(tuple(int(s) for s in shape), np.dtype(dtype).name,
                        tuple(int(c) for c in chunk), json.dumps(codecs, sort_keys=True),
                        tuple(dim_names))


def chunk_key(array_name: str, cell: Sequence[int]) -> str:
  """Key of one chunk: zarr3 ``default`` chunk key encoding, "/" separator."""
  if not cell:
    return f"{array_name}/c"
  return f"{array_name}/c/" + "/".join(str(i) for i in cell)


def _is_raw_dtype(dtype: np.dtype) -> bool:
  # The bytes codec writes little endian; a native little-endian (or
  # single-byte) dtype is already laid out that way.
  return dtype.byteorder in "|<" or (dtype.byteorder == "=" and _LITTLE_ENDIAN)


def _cells(extent: Sequence[tuple[int, int]], chunk: Sequence[int]):
  ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(extent, chunk)]
  return itertools.product(*ranges)


def encode_raw_chunks(name: str, shards: Sequence[tuple[list[tuple[int, int]], Any]],
                      stored_shape: Sequence[int], chunk: Sequence[int],
                      dtype: np.dtype) -> dict[str, tuple[bytes, int]] | None:
  """Raw-codec chunk objects of one array: key -> (bytes, crc32c).

  Args:
    shards: (global box, host array) of each local shard, as written by
      ``encode._write_shards``; boxes may extend past ``stored_shape`` (the
      trimmed token axis) and are clipped to it.
    stored_shape, chunk: the zarr3 array's shape and regular chunk shape.

  Returns:
    None when the layout is not one this fast path handles (a chunk crosses
    a shard boundary, or a big-endian dtype); the caller then writes the
    array through TensorStore.
  """
  dtype = np.dtype(dtype)
  if not _is_raw_dtype(dtype):
    return None
  ndim = len(stored_shape)
  chunk = tuple(int(c) for c in chunk)
  itemsize = dtype.itemsize
  chunk_nbytes = math.prod(chunk) * itemsize
  zero_crc = zeros_crc32c(chunk_nbytes)
  out: dict[str, tuple[bytes, int]] = {}
  for box, shard in shards:
    clipped = [(lo, min(hi, int(n))) for (lo, hi), n in zip(box, stored_shape)]
    if any(hi <= lo for lo, hi in clipped):
      continue
    # Every chunk touching this shard must lie inside it (as chunk_shape
    # arranges); otherwise two writes would meet inside one chunk.
    for (lo, hi), c, n in zip(clipped, chunk, stored_shape):
      if lo % c or (hi % c and hi != n):
        return None
    host = np.asarray(shard)
    if np.dtype(host.dtype) != dtype:
      return None
    for cell in _cells(clipped, chunk) if ndim else [()]:
      src = tuple(slice(i * c - lo, min((i + 1) * c, n) - lo)
                  for i, c, (lo, _), n in zip(cell, chunk, clipped, stored_shape))
      view = host[src]
      if view.shape == chunk:
        data = view.tobytes()
      else:  # Edge chunk: padded with the fill value to the full chunk shape.
        padded = np.zeros(chunk, dtype)
        padded[tuple(slice(0, s) for s in view.shape)] = view
        data = padded.tobytes()
      crc = crc32c(data)
      # All fill value: zarr3 (and TensorStore) stores no object.
      if crc == zero_crc and data.count(0) == len(data):
        continue
      key = chunk_key(name, cell)
      if key in out:
        return None  # Overlapping shards: leave it to TensorStore.
      out[key] = (data, crc)
  return out


@functools.lru_cache(maxsize=1024)
def _parse_raw_metadata(data: bytes) -> tuple | None:
  """(shape, numpy dtype, chunk shape) of a raw-codec zarr3 array, else None."""
  try:
    d = json.loads(data)
  except (ValueError, UnicodeDecodeError):
    return None
  if not isinstance(d, dict):
    return None
  allowed = {"zarr_format", "node_type", "shape", "data_type", "chunk_grid",
             "chunk_key_encoding", "codecs", "fill_value", "dimension_names", "attributes"}
  if set(d) - allowed:
    return None
  if d.get("zarr_format") != 3 or d.get("node_type") != "array":
    return None
  if d.get("codecs") not in [list(_RAW_CODECS[:1]), list(_RAW_CODECS[1:])]:
    return None
  if d.get("chunk_key_encoding") not in ({"name": "default"},
                                         {"name": "default",
                                          "configuration": {"separator": "/"}}):
    return None
  grid = d.get("chunk_grid")
  if not (isinstance(grid, dict) and grid.get("name") == "regular"
          and set(grid) == {"name", "configuration"}
          and isinstance(grid["configuration"], dict)
          and set(grid["configuration"]) == {"chunk_shape"}):
    return None
  shape, chunk = d.get("shape"), grid["configuration"]["chunk_shape"]
  if not (isinstance(shape, list) and isinstance(chunk, list) and len(shape) == len(chunk)
          and all(type(s) is int and s >= 0 for s in shape)
          and all(type(c) is int and c >= 1 for c in chunk)):
    return None
  fill = d.get("fill_value")
  if type(fill) not in (int, float) or fill != 0 or math.copysign(1.0, fill) < 0:
    return None
  try:
    dtype = np.dtype(ts.dtype(d["data_type"]).numpy_dtype)
  except (ValueError, TypeError, KeyError):
    return None
  if not _is_raw_dtype(dtype) or dtype.kind not in "biufV":
    return None
  return tuple(shape), dtype, tuple(chunk)


def raw_layout(metadata: bytes | None, stored_shape: Sequence[int],
               stored_dtype: str) -> tuple[np.dtype, tuple[int, ...]] | None:
  """(dtype, chunk shape) if ``metadata`` is a raw-codec zarr3 array of exactly
  this shape and dtype, which ``read_raw_box`` can read; else None."""
  if metadata is None:
    return None
  parsed = _parse_raw_metadata(bytes(metadata))
  if parsed is None:
    return None
  shape, dtype, chunk = parsed
  if shape != tuple(int(s) for s in stored_shape) or dtype.name != stored_dtype:
    return None
  return dtype, chunk


class BadChunkError(ValueError):
  """A stored object is not a raw chunk of the array's chunk shape."""


def read_raw_box(get, name: str, stored_shape: Sequence[int], dtype: np.dtype,
                 chunk: Sequence[int], src: Sequence[slice], out: np.ndarray) -> None:
  """Copies box ``src`` of a raw-codec zarr3 array into ``out[:box shape]``.

  Args:
    get: key -> bytes, or None for an object that is not stored (all fill
      value: that part of ``out`` is set to 0).
    src: slices with explicit start/stop inside ``stored_shape``.
    out: destination whose leading corner receives the box.
  """
  chunk = tuple(int(c) for c in chunk)
  ndim = len(stored_shape)
  extent = [(s.start, s.stop) for s in src]
  if any(hi <= lo for lo, hi in extent):
    return
  chunk_nbytes = math.prod(chunk) * dtype.itemsize
  for cell in _cells(extent, chunk) if ndim else [()]:
    key = chunk_key(name, cell)
    # The part of this chunk inside the box, in chunk and in output coordinates.
    in_chunk, in_out = [], []
    for i, c, (lo, hi) in zip(cell, chunk, extent):
      a, b = max(lo, i * c), min(hi, (i + 1) * c)
      in_chunk.append(slice(a - i * c, b - i * c))
      in_out.append(slice(a - lo, b - lo))
    in_chunk, in_out = tuple(in_chunk), tuple(in_out)
    data = get(key)
    if data is None:
      out[in_out] = 0
      continue
    if len(data) != chunk_nbytes:
      raise BadChunkError(f"{key}: {len(data)} bytes, a raw chunk of shape {chunk} "
                          f"and dtype {dtype.name} has {chunk_nbytes}")
    out[in_out] = np.frombuffer(data, dtype).reshape(chunk)[in_chunk]
