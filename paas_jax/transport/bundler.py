"""The sending side of small states on the data plane: groups held back and
sent as one BUNDLE frame (``dataplane.bundle``), or, past the threshold, as
the usual DESCRIPTOR + CHUNK frames.

Why: a tiny state's fixed cost was per frame (63 frames for ~50 objects in
13 groups: the sender queued 13 groups before its first byte left, the
receiver parsed 13 descriptors and verified 50 chunks one by one). A state
whose frames add up to at most ``SenderOptions.bundle_bytes`` now goes as one
frame at ``finish``: the bytes are few, so holding them until then costs
less than the per-frame work it saves. The first group that would take the
held bytes past the threshold releases them, in order, as ordinary frames,
and the transfer streams from there on exactly as before: a large state
(whose first layer alone is past the threshold) is never held at all.

Also here: ``LaneCallbacks``, the rest of a ``Transfer``'s data-plane side
(its stream, what a sent frame means for its timeline and link gauges).
"""

from __future__ import annotations

import threading

from paas_jax.codec.encode import EncodedGroup
from paas_jax.codec.store import crc32c
from paas_jax.proto import transport_pb2
from paas_jax.transport.dataplane import bundle as bundle_lib, frames
from paas_jax.transport.dataplane.streams import LaneStream, Outgoing
from paas_jax.transport.errors import TransferError


class BundleItem(Outgoing):
  """A BUNDLE frame; ``groups``: (layer, object bytes, objects) per group, for
  the sender's timeline and link gauges."""

  __slots__ = ("groups",)

  def __init__(self, payload: bytes, label: str, groups: list[tuple[int, int, int]]):
    super().__init__(frames.BUNDLE, -1, label, crc32c(payload), payload, is_chunk=False)
    self.groups = groups


def group_frames(group: EncodedGroup, text: str) -> list[Outgoing]:
  """One group as ordinary frames: its DESCRIPTOR, then a CHUNK per object."""
  entry = group.entry
  return ([Outgoing(frames.DESCRIPTOR, entry.index, "", 0, text.encode(), is_chunk=False)]
          + [Outgoing(frames.CHUNK, entry.index, chunk.key, chunk.crc32c,
                      group.blobs[chunk.key], is_chunk=True)
             for _, chunk in entry.chunks()])


class Bundler:
  """Groups of one transfer held for a BUNDLE.

  Args:
    limit: largest BUNDLE payload (bytes: table, descriptors and objects).
  """

  def __init__(self, limit: int):
    self.limit = limit
    self._held: list[tuple[EncodedGroup, str]] = []
    self._size = bundle_lib.COUNT.size
    self._open = limit > 0

  def hold(self, group: EncodedGroup, text: str) -> list[Outgoing] | None:
    """None: ``group`` (with its descriptor ``text``) is held for the bundle.
    Otherwise the frames to send now: whatever was held, then ``group``'s own,
    in order; from then on nothing is held."""
    if self._open:
      size = self._size + bundle_lib.ROW.size + len(text) + group.entry.nbytes
      if size <= self.limit:
        self._held.append((group, text))
        self._size = size
        return None
    self._open = False
    held, self._held = self._held, []
    out = [item for g, t in held for item in group_frames(g, t)]
    return out + group_frames(group, text)

  def take(self) -> BundleItem | None:
    """The held groups as one BUNDLE (None if nothing is held); nothing is
    held after it."""
    self._open = False
    held, self._held = self._held, []
    if not held:
      return None
    payload = bundle_lib.pack([(g.entry, t, [g.blobs[c.key] for _, c in g.entry.chunks()])
                               for g, t in held])
    groups = [(g.entry.index, g.entry.nbytes, g.entry.num_chunks)
              for g, _ in held]
    return BundleItem(payload, bundle_lib.label([g for g, _, _ in groups]), groups)


class LaneCallbacks:
  """The data-plane side of ``Transfer`` (a mixin: it relies on the transfer's
  ``_stream``, ``_pool``, ``_begin_frame``, ``_options``, ``_deadline``,
  ``_recorder``, ``_link``, ``_error``, ``_done`` and ``_abort``)."""

  def _begin_reply(self) -> None:
    """The pipelined BEGIN's RESULT (long there once the frames are drained)."""
    body = self._stream.reply(self._begin_frame, timeout_s=self._options.rpc_timeout_s)
    response = transport_pb2.BeginResponse.FromString(body)
    if response.max_frame_bytes:
      self._pool.announced_max_frame_bytes = int(response.max_frame_bytes)

  def _plane_commit(self, request: transport_pb2.CommitRequest,
                    bundle: BundleItem | None) -> transport_pb2.CommitResponse | None:
    """Sends COMMIT on the data plane; its answer, or None where Commit must
    be asked again (``Transfer._commit_with_retries`` does). Behind a BUNDLE,
    which holds the whole state, COMMIT follows it on its connection at once
    (one round trip less); else it leaves from the lane that reads the last
    acknowledgement (armed), so no thread has to wake up in between."""
    payload = request.SerializeToString()
    if bundle is not None:
      armed = self._stream.call_after(frames.COMMIT, payload, after=bundle)
      self._stream.write_through()
    else:
      armed = self._stream.call_when_drained(frames.COMMIT, payload)
    try:
      body = self._stream.reply(armed, timeout_s=self._options.commit_timeout_s)
    finally:
      self._recorder.queue_peak(self._stream.peak_bytes)
    first = transport_pb2.CommitResponse.FromString(body)
    if self._begin_frame is not None:
      self._begin_reply()  # answered before the frames behind it
    if bundle is not None and not first.complete:
      # The BUNDLE was rejected and is being resent whole: let it land, then
      # ask again, rather than resending its objects one by one.
      self._stream.drain()
      return None
    return first

  def _open_lane_stream(self) -> LaneStream:
    return LaneStream(self._pool, self.transfer_id, lanes=self._options.lanes,
                      max_queued_bytes=self._options.max_inflight_bytes,
                      deadline=self._deadline, on_sent=self._plane_sent,
                      on_error=self._plane_error)

  def _plane_sent(self, item: Outgoing, resend: bool) -> None:
    if isinstance(item, BundleItem):
      for layer, nbytes, count in item.groups:
        self._recorder.frame_sent(layer, nbytes, True, resend, chunks=count)
      self._link.sent_bytes(sum(nbytes for _, nbytes, _ in item.groups))
      return
    nbytes = item.nbytes if item.is_chunk else 0
    self._recorder.frame_sent(item.layer, nbytes, item.is_chunk, resend)
    if nbytes:
      self._link.sent_bytes(nbytes)

  def _plane_error(self, err: TransferError) -> None:
    if self._error is None and not self._done:
      # Not inline: this runs on a lane thread, which must not block on the Abort RPC.
      threading.Thread(target=self._abort, args=(err,), daemon=True).start()


__all__ = ["BundleItem", "Bundler", "LaneCallbacks", "group_frames"]
