"""The payload of a BUNDLE frame: a small state's layer descriptors and stored
objects in one frame.

Why: a tiny state (a few tokens: ~50 objects of 0.3-4 KiB in 13 groups) cost
63 frames, and each frame cost Python work on both sides (a header, a lane
hand-off, a descriptor parse, a chunk verification under the transfer's
lock). One frame per state costs one header, one read, one crc32c over the
whole payload, one JSON parse for every descriptor together, and one
adoption under one lock (``transport.bundle_ingress``).

Layout (little endian)::

  count u32                                  groups in the bundle
  count x (layer i32, text_len u32)          the table
  count descriptor texts, back to back       each a ``LayerEntry.to_json()``
  objects, back to back                      each group's objects in
                                             ``LayerEntry.chunks()`` order

The objects carry no header of their own: their keys, sizes and crc32c are
in the descriptors, so the receiver slices them out by the sizes listed
there (a payload whose length is not exactly what the descriptors add up to
is malformed). The frame header's crc32c covers the whole payload (the
table and the descriptors included); each object is also checked against
its descriptor's crc32c, as a CHUNK frame is.
"""

from __future__ import annotations

import struct
from typing import Sequence

from paas_jax.codec import manifest as manifest_lib
from paas_jax.codec.manifest import LayerEntry

COUNT = struct.Struct("<I")
ROW = struct.Struct("<iI")
# More groups than any model has layers: a count beyond it is a broken table,
# not a state (and must not make the receiver allocate for it).
MAX_GROUPS = 1 << 16


class BundleMalformed(ValueError):
  """The payload is not a bundle (its crc32c matched: the sender built it so)."""


def label(layers: Sequence[int]) -> str:
  """What a bundle holds, for the frame's key field and error messages."""
  if not layers:
    return "bundle of no layers"
  return f"bundle of layers {min(layers)}..{max(layers)} ({len(layers)} groups)"


def pack(groups: Sequence[tuple[LayerEntry, str, Sequence]]) -> bytes:
  """The payload for ``groups``: (entry, its ``to_json()`` text, its objects in
  ``entry.chunks()`` order)."""
  texts = [text.encode() for _, text, _ in groups]
  parts = [COUNT.pack(len(groups))]
  parts += [ROW.pack(entry.index, len(t)) for (entry, _, _), t in zip(groups, texts)]
  parts += texts
  for _, _, blobs in groups:
    parts += blobs
  return b"".join(parts)


def parse(payload) -> tuple[list[tuple[int, dict, str]], int]:
  """([(layer, parsed descriptor, its text)], offset of the first object).

  One parse for every descriptor of the bundle together.

  Raises:
    BundleMalformed: a table or descriptor that does not parse.
  """
  view = memoryview(payload)
  if len(view) < COUNT.size:
    raise BundleMalformed(f"{len(view)} bytes: shorter than its table")
  (count,) = COUNT.unpack_from(view, 0)
  table_end = COUNT.size + count * ROW.size
  if not 0 < count <= MAX_GROUPS or table_end > len(view):
    raise BundleMalformed(f"table of {count} groups does not fit {len(view)} bytes")
  rows = [ROW.unpack_from(view, COUNT.size + i * ROW.size) for i in range(count)]
  end = table_end + sum(n for _, n in rows)
  if end > len(view):
    raise BundleMalformed(f"descriptors of {end - table_end} bytes do not fit "
                          f"{len(view)} bytes")
  try:
    # The descriptors are ASCII JSON (``manifest.dumps`` escapes anything else), so
    # the table's byte lengths are also character offsets.
    blob = str(view[table_end:end], "ascii")
  except UnicodeDecodeError:
    raise BundleMalformed("descriptors are not ASCII JSON") from None
  texts, pos = [], 0
  for _, n in rows:
    texts.append(blob[pos:pos + n])
    pos += n
  try:
    parsed = manifest_lib.loads("[" + ",".join(texts) + "]")
  except ValueError as e:
    raise BundleMalformed(f"descriptors do not parse: {e}") from None
  if len(parsed) != count or not all(isinstance(d, dict) for d in parsed):
    raise BundleMalformed(f"{count} descriptors listed, {len(parsed)} objects parsed")
  return [(layer, d, t) for (layer, _), d, t in zip(rows, parsed, texts)], end


__all__ = ["BundleMalformed", "MAX_GROUPS", "label", "pack", "parse"]
