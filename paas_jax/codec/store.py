"""TensorStore key-value stores: opening by URL, and private in-memory stores.

The memory kvstore is reachable only through the ``ts.Context`` it was opened
with (opening ``memory://`` again gives a new, empty store), so every
in-memory staging area here owns its context and dies with it: dropping a
``MemoryStore`` frees all of its bytes.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Mapping

import google_crc32c
import numpy as np
import tensorstore as ts

KvStoreLike = Any  # str URL | dict spec | ts.KvStore | MemoryStore


def crc32c(data) -> int:
  """CRC-32C (Castagnoli) of ``data`` (bytes or any C-contiguous buffer such as a
  memoryview or ndarray, read in place without a copy), hardware-accelerated
  via google-crc32c."""
  return int(google_crc32c.value(_uint8(data)))


def crc32c_extend(crc: int, data) -> int:
  """The CRC-32C of the bytes that gave ``crc`` followed by ``data``."""
  return int(google_crc32c.extend(crc, _uint8(data)))


def _uint8(data):
  if isinstance(data, bytes):
    return data
  view = memoryview(data)
  if not view.c_contiguous:
    raise ValueError("crc32c needs a C-contiguous buffer")
  # google-crc32c refuses memoryviews and bytearrays but reads ndarrays in
  # place: a uint8 view of the same memory, not a copy.
  return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view,
                       np.uint8)


def _ts_value(value):
  """``value`` as TensorStore's kvstore takes it (bytes or bytearray; the data
  plane's receive buffers are other buffer types)."""
  return value if value is None or isinstance(value, (bytes, bytearray)) else bytes(value)


@functools.lru_cache(maxsize=64)
def zeros_crc32c(nbytes: int) -> int:
  """CRC-32C of ``nbytes`` zero bytes (lets a caller that already has a
  buffer's crc tell for free that it is not all zeros)."""
  return crc32c(bytes(nbytes))


def _with_trailing_slash(url: str) -> str:
  # Keys are appended to the kvstore path without a separator; a URL naming a
  # folder must end with "/" or "manifest.json" becomes a sibling file.
  if url.endswith("/") or url.rstrip("/").endswith(":"):
    return url
  return url + "/"


class _Done:
  """An already completed future."""

  __slots__ = ("_value",)

  def __init__(self, value):
    self._value = value

  def result(self):
    return self._value


class _ReadResult:
  __slots__ = ("state", "value")

  def __init__(self, state: str, value: bytes):
    self.state = state
    self.value = value


class MemoryStore:
  """A private in-memory kvstore that holds encoded objects.

  Objects live in a Python dict (``put_many`` / ``get`` cost no TensorStore
  round trip and no copy) until the TensorStore side is first needed: reading
  ``context`` or ``kvstore`` moves every object into a TensorStore memory
  kvstore once, and from then on that kvstore is the only copy and every
  method goes through it. Either way the store holds the same objects.

  Attributes:
    context: the TensorStore context that owns the bytes; zarr3 arrays inside
      are opened with ``{"driver": "memory", "path": ...}`` and this context.
    kvstore: the memory kvstore itself.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._blobs: dict[str, bytes] | None = {}  # None once moved into TensorStore.
    self._context: ts.Context | None = None
    self._kvstore: ts.KvStore | None = None
    self._closed = False
    self.nbytes = 0

  def _materialize(self) -> None:
    with self._lock:
      if self._blobs is None or self._closed:
        return
      self._context = ts.Context()
      self._kvstore = ts.KvStore.open({"driver": "memory"}, context=self._context).result()
      futures = [self._kvstore.write(k, _ts_value(v)) for k, v in self._blobs.items()]
      for f in futures:
        f.result()
      self._blobs = None

  @property
  def context(self) -> ts.Context | None:
    self._materialize()
    return self._context

  @context.setter
  def context(self, value) -> None:
    self._materialize()
    self._context = value

  @property
  def kvstore(self) -> ts.KvStore | None:
    self._materialize()
    return self._kvstore

  @kvstore.setter
  def kvstore(self, value) -> None:
    self._materialize()
    self._kvstore = value

  @property
  def in_tensorstore(self) -> bool:
    """Whether the objects have moved into the TensorStore memory kvstore."""
    return self._blobs is None

  def put_many(self, blobs: Mapping[str, bytes]) -> None:
    with self._lock:
      if self._blobs is not None:
        self._blobs.update(blobs)
        self.nbytes += sum(len(v) for v in blobs.values())
        return
    futures = [self.kvstore.write(key, _ts_value(value)) for key, value in blobs.items()]
    for f in futures:
      f.result()
    self.nbytes += sum(len(v) for v in blobs.values())

  def get(self, key: str) -> bytes | None:
    """One object's bytes, or None if the store has no such key."""
    blobs = self._blobs
    if blobs is not None:
      value = blobs.get(key)
      if value is not None or self._blobs is not None:
        return value
    result = self.kvstore.read(key).result()
    return result.value if result.state == "value" else None

  def read_all(self) -> dict[str, bytes]:
    with self._lock:
      if self._blobs is not None:
        return dict(sorted(self._blobs.items()))
    keys = self.kvstore.list().result()
    futures = {k.decode(): self.kvstore.read(k) for k in keys}
    return {k: f.result().value for k, f in futures.items()}

  # -- the subset of the ts.KvStore API the codec uses (write / read / list /
  # url), so that encode_state and decode_state into and out of a MemoryStore
  # need no TensorStore round trip while the objects are still in the dict.

  @property
  def url(self) -> str:
    return "memory://"

  def write(self, key: str, value: bytes | None) -> "_Done":
    """Writes (or with None deletes) one object; returns a completed future."""
    with self._lock:
      if self._blobs is not None:
        old = self._blobs.pop(key, None)
        self.nbytes -= 0 if old is None else len(old)
        if value is not None:
          self._blobs[key] = value
          self.nbytes += len(value)
        return _Done(None)
    self.kvstore.write(key, _ts_value(value)).result()
    return _Done(None)

  def read(self, key: str | bytes) -> "_Done":
    """Reads one object; the future's result has ``state`` and ``value`` like
    TensorStore's ``ReadResult``."""
    key = key.decode() if isinstance(key, bytes) else key
    value = self.get(key)
    return _Done(_ReadResult("missing" if value is None else "value",
                             b"" if value is None else value))

  def list(self, range: Any = None) -> "_Done":  # noqa: A002 (ts.KvStore's name)
    """Keys (as bytes) in ``range`` (a ``ts.KvStore.KeyRange``) or all."""
    with self._lock:
      keys = None if self._blobs is None else sorted(self._blobs)
    if keys is None:
      return _Done(self.kvstore.list(range).result() if range is not None
                   else self.kvstore.list().result())
    if range is not None:
      lo, hi = range.inclusive_min, range.exclusive_max
      keys = [k for k in keys if k >= lo and (not hi or k < hi)]
    return _Done([k.encode() for k in keys])

  def zarr_spec(self, array_name: str) -> dict:
    return {"driver": "zarr3",
            "kvstore": {"driver": "memory", "path": f"{array_name}/"}}

  def close(self) -> None:
    """Drops the bytes now rather than when the last reference goes away."""
    with self._lock:
      self._closed = True
      self._blobs = None
      self._kvstore = None
      self._context = None
      self.nbytes = 0


def codec_kvstore(where: KvStoreLike):
  """What the codec reads and writes through: ``where`` itself for a
  ``MemoryStore`` (which speaks the write / read / list subset of the
  ``ts.KvStore`` API without a TensorStore round trip), else ``open_kvstore``."""
  if isinstance(where, MemoryStore):
    return where
  return open_kvstore(where)


def open_kvstore(where: KvStoreLike) -> ts.KvStore:
  """Opens any TensorStore kvstore: URL (file://, memory://, gs://, s3://...),
  JSON spec, ``ts.KvStore`` or ``MemoryStore``.

  A ``memory://`` URL opens a fresh, empty store each time; to read back what
  was written, pass the same ``ts.KvStore`` (or ``MemoryStore``) object.
  """
  if isinstance(where, MemoryStore):
    return where.kvstore
  if isinstance(where, ts.KvStore):
    return where
  if isinstance(where, str):
    return ts.KvStore.open(_with_trailing_slash(where)).result()
  if isinstance(where, dict):
    return ts.KvStore.open(where).result()
  raise TypeError(f"not a kvstore, URL or spec: {type(where).__name__}")
