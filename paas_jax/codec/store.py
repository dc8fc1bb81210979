"""TensorStore key-value stores: opening by URL, and private in-memory stores.

The memory kvstore is reachable only through the ``ts.Context`` it was opened
with (opening ``memory://`` again gives a new, empty store), so every
in-memory staging area here owns its context and dies with it: dropping a
``MemoryStore`` frees all of its bytes.
"""

from __future__ import annotations

from typing import Any, Mapping

import google_crc32c
import tensorstore as ts

KvStoreLike = Any  # str URL | dict spec | ts.KvStore | MemoryStore


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of ``data``, hardware-accelerated via google-crc32c."""
  return int(google_crc32c.value(data))


def _with_trailing_slash(url: str) -> str:
  # Keys are appended to the kvstore path without a separator; a URL naming a
  # folder must end with "/" or "manifest.json" becomes a sibling file.
  if url.endswith("/") or url.rstrip("/").endswith(":"):
    return url
  return url + "/"


class MemoryStore:
  """A private in-memory kvstore that holds encoded objects.

  Attributes:
    context: the TensorStore context that owns the bytes; zarr3 arrays inside
      are opened with ``{"driver": "memory", "path": ...}`` and this context.
    kvstore: the memory kvstore itself.
  """

  def __init__(self):
    self.context = ts.Context()
    self.kvstore = ts.KvStore.open({"driver": "memory"}, context=self.context).result()
    self.nbytes = 0

  def put_many(self, blobs: Mapping[str, bytes]) -> None:
    futures = [self.kvstore.write(key, value) for key, value in blobs.items()]
    for f in futures:
      f.result()
    self.nbytes += sum(len(v) for v in blobs.values())

  def read_all(self) -> dict[str, bytes]:
    keys = self.kvstore.list().result()
    futures = {k.decode(): self.kvstore.read(k) for k in keys}
    return {k: f.result().value for k, f in futures.items()}

  def zarr_spec(self, array_name: str) -> dict:
    return {"driver": "zarr3",
            "kvstore": {"driver": "memory", "path": f"{array_name}/"}}

  def close(self) -> None:
    """Drops the bytes now rather than when the last reference goes away."""
    self.kvstore = None
    self.context = None
    self.nbytes = 0


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
