"""One frame on its way out of a data-plane sender (``streams.LaneStream``
queues them, ``lanes.Lane`` writes them)."""

from __future__ import annotations


class Outgoing:
  """One frame to send: header fields and a memoryview of the payload."""

  __slots__ = ("kind", "layer", "key", "crc", "payload", "attempt", "is_chunk", "stream",
               "resend", "reply", "sent_at", "taken_by", "follows")

  def __init__(self, kind: int, layer: int, key: str, crc: int, payload, is_chunk: bool,
               attempt: int = 0, resend: bool = False):
    self.kind, self.layer, self.key, self.crc = kind, layer, key, crc
    self.payload = memoryview(payload).cast("B") if not isinstance(payload, memoryview) else (
        payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B"))
    self.attempt = attempt
    self.is_chunk = is_chunk
    self.resend = resend
    self.stream = None  # the ``LaneStream`` that queued it
    self.reply: list[bytes] | None = None  # control frames: [RESULT body] once answered
    self.sent_at: float | None = None  # monotonic, once its last byte was written
    self.taken_by = None  # the lane that took it last (to write it)
    # A frame this one must follow on the same connection (``call_after``):
    # only the lane that took that one may take this.
    self.follows: "Outgoing | None" = None

  @property
  def nbytes(self) -> int:
    return len(self.payload)
