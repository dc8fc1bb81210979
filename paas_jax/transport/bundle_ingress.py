"""A BUNDLE frame (a small state's descriptors and objects in one frame, see
``dataplane.bundle``) adopted by a ``StateReceiver`` in one call.

Why a path of its own: through the per-frame entry points a tiny state cost
one JSON parse and one adoption per descriptor and, per object, the checks
of ``_accept_chunk`` with two locks and a layer-completion check; at ~13
groups and ~50 objects that was about half of the receiver's share of a
transfer's fixed cost. Here the whole bundle is verified first (the frame's
crc32c, then each object against its descriptor), and only then adopted,
under the transfer's lock once, with one budget reservation, each layer
moved into the store and its restore started at once (every object of it is
in). A bundle that fails verification is rejected as a whole (NACK: nothing
of it is kept, the sender resends it); one that is malformed although its
crc32c matched fails the transfer (INVALID_ARGUMENT: the sender built it
so). A bundle whose layers partly arrived already (a resend after a lost
connection, or frames of the same layers sent separately) takes the
per-frame path, object by object, so every case the old path handles is
handled the same way.
"""

from __future__ import annotations

import time

import grpc

from paas_jax.codec import layout
from paas_jax.codec.manifest import LayerEntry
from paas_jax.codec.store import crc32c
from paas_jax.transport.dataplane import bundle as bundle_lib
from paas_jax.transport.inbound import (Inbound, TransferFailed, check_descriptor, location,
                                        restore_layer)

Code = grpc.StatusCode


def verify(payload, label: str, crc: int, data_crc: int):
  """(entries with their (parsed JSON, text), objects as (layer, key, crc32c,
  view)) of an intact bundle, or the reason it is rejected (a str).

  Raises:
    TransferFailed: INVALID_ARGUMENT, a malformed bundle.
  """
  reason = frame_failure(crc, data_crc)
  if reason is not None:
    return reason
  try:
    rows, offset = bundle_lib.parse(payload)
    entries = [(LayerEntry.from_dict(d), (d, text), layer) for layer, d, text in rows]
  except (ValueError, KeyError, TypeError) as e:
    raise TransferFailed(Code.INVALID_ARGUMENT, f"{label}: malformed: {e}") from None
  view = memoryview(payload)
  objects, pos, seen = [], offset, set()
  for entry, _, layer in entries:
    if entry.index != layer:
      raise TransferFailed(Code.INVALID_ARGUMENT, f"{label}: descriptor of layer "
                           f"{entry.index} listed as layer {layer}")
    if layer in seen:
      raise TransferFailed(Code.INVALID_ARGUMENT, f"{label}: layer {layer} twice")
    seen.add(layer)
    prefix = layout.layer_prefix(layer) + "/" if layer >= 0 else None
    for _, c in entry.chunks():
      if (prefix is not None and not c.key.startswith(prefix)) or (
          prefix is None and c.key.startswith("layers/")):
        raise TransferFailed(Code.INVALID_ARGUMENT, f"{label}: {location(layer, c.key)} is "
                             "not a key of its group")
      objects.append((layer, c.key, c.crc32c, view[pos:pos + c.nbytes]))
      pos += c.nbytes
  if pos != len(view):
    raise TransferFailed(Code.INVALID_ARGUMENT, f"{label}: its descriptors list "
                         f"{pos - offset} object bytes, it carries {len(view) - offset}")
  if len({key for _, key, _, _ in objects}) != len(objects):
    raise TransferFailed(Code.INVALID_ARGUMENT, f"{label}: an object key listed twice")
  reason = objects_failure(objects)
  if reason is not None:
    return reason
  return [(entry, raw) for entry, raw, _ in entries], objects


def frame_failure(crc: int, data_crc: int) -> str | None:
  """Why the payload is not what the sender sent (its crc32c, computed as the
  bytes arrived, differs from the header's), or None. Checked before the
  table is parsed: a damaged table is resent, not taken for a malformed one."""
  if data_crc != crc:
    return f"crc32c mismatch: data has 0x{data_crc:08x}, frame says 0x{crc:08x}"
  return None


def objects_failure(objects) -> str | None:
  """Why an object differs from its descriptor (its crc32c), or None: as a
  CHUNK frame's object is checked, whatever the frame's own crc32c says."""
  for layer, key, want, data in objects:
    got = crc32c(data)
    if got != want:
      return (f"{location(layer, key)}: crc32c mismatch: data has 0x{got:08x}, its "
              f"descriptor says 0x{want:08x}")
  return None


def accept_bundle(rx, t: Inbound, label: str, crc: int, payload, data_crc: int) -> str | None:
  """Verifies and adopts one bundle for ``rx`` (a ``StateReceiver``); returns
  why it was rejected (the sender resends it), or None once it is kept.

  Raises:
    TransferFailed: malformed, failed verification ``max_chunk_attempts``
      times, descriptors that do not fit the transfer, budget, or the
      transfer failed meanwhile.
  """
  verified = verify(payload, label, crc, data_crc)
  if isinstance(verified, str):
    with t.lock:
      t.attempts[label] += 1
      t.rejected += 1
      n = t.attempts[label]
    if n >= rx.options.max_chunk_attempts:
      raise TransferFailed(Code.DATA_LOSS, f"{label} failed verification {n} times; last: "
                           f"{verified}")
    return f"{label}: {verified}"
  entries, objects = verified
  like_layers = layout.split_state(t.template[0])[0] if t.template is not None else None
  for entry, _ in entries:
    check_descriptor(t, entry, entry.index, like_layers)
  with t.lock:
    fresh = (t.status == "open" and t.store is not None
             and not any(entry.index in t.descriptors for entry, _ in entries)
             and not any(key in t.verified for _, key, _, _ in objects))
    if fresh:
      _adopt_locked(rx, t, entries, objects)
      return None
  # Some of it is here already: object by object, as separate frames would be.
  for entry, raw in entries:
    rx._adopt_descriptor(t, entry, raw, entry.index)
  reasons = []
  for layer, key, want, data in objects:
    reason, _ = rx._accept_chunk(t, layer, key, want, len(data), data, want)
    if reason is not None:
      reasons.append(f"{location(layer, key)}: {reason}")
  return "; ".join(reasons) or None


def _adopt_locked(rx, t: Inbound, entries, objects) -> None:
  """Adopts a verified bundle none of whose layers is here yet (``t.lock`` held)."""
  nbytes = sum(len(data) for _, _, _, data in objects)
  rx._reserve(t, nbytes)
  now = time.time()
  for entry, raw in entries:
    t.descriptors[entry.index] = entry
    t.descriptor_json[entry.index] = raw
    t.expected[entry.index] = {c.key: c.crc32c for _, c in entry.chunks()}
  for layer, key, want, _ in objects:
    t.verified[key] = (layer, want)
  # Every object of every layer in it is here: each layer goes into the store
  # (and starts restoring) now, not via a per-layer completion check.
  t.store.put_many({key: data for _, key, _, data in objects})
  t.first_byte = t.first_byte or now
  t.last_byte = now
  t.bytes_received += nbytes
  t.chunks_received += len(objects)
  for entry, _ in entries:
    t.flushed.add(entry.index)
    t.layers_complete[entry.index] = now
    if t.template is not None:
      like, shardings = t.template
      t.restores[entry.index] = rx._pool.submit(restore_layer, t, t.store, entry, like,
                                                shardings)


__all__ = ["accept_bundle", "frame_failure", "objects_failure", "verify"]
