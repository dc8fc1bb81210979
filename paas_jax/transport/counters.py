"""What the senders of one link have outstanding on it, measured as they go.

A ``LinkCounters`` is shared by every ``StateSender`` whose transfers cross
the same link (region A's state senders and its prefix exporter share one).
Each ``Transfer`` reports into it:

* ``queued``: encoded chunk bytes handed to the streams (a layer once it is
  encoded, a resent chunk once it is queued again);
* ``sent``: chunk bytes gRPC has taken from the stream, counted when it asks
  for the next frame, i.e. once the previous one was written to the transport
  (gRPC's client stream waits for each write to complete before it pulls the
  next message), so at most one frame per stream is on its way in HTTP/2's
  window and not yet counted;
* the end of the transfer (committed or failed): its unsent bytes stop being
  pending (a failed transfer's are never sent).

Bytes are encoded payload bytes, the same unit as
``TransferTimeline.bytes_sent`` (chunk data, resends included; frame headers
and descriptors excluded), so for a committed transfer the bytes counted as
sent equal its ``bytes_sent``, i.e. the ``TransferDone.bytes_sent`` the broker
sees.

All methods are thread-safe and O(1) except ``transfers`` (O(active)); they
run on the encoder and gRPC threads of every transfer, so they only take one
short lock.
"""

from __future__ import annotations

import threading

# Transfers listed per GetStats answer at most (the largest pending first); the
# totals always cover all of them.
MAX_REPORTED_TRANSFERS = 256


class LinkTransfer:
  """One transfer's share of a ``LinkCounters`` (made by ``LinkCounters.begin``)."""

  __slots__ = ("transfer_id", "num_layers", "layers_encoded", "queued", "sent", "ended",
               "_owner")

  def __init__(self, owner: "LinkCounters", transfer_id: str, num_layers: int):
    self._owner = owner
    self.transfer_id = transfer_id
    self.num_layers = int(num_layers)
    self.layers_encoded = 0
    self.queued = 0  # bytes
    self.sent = 0    # bytes
    self.ended = False

  @property
  def pending(self) -> int:
    """Bytes queued for the link and not yet sent."""
    return max(self.queued - self.sent, 0)

  @property
  def encoded(self) -> bool:
    """Every layer is encoded: ``pending`` now covers all of the state still to go
    (bar the small state-level arrays and resends)."""
    return self.layers_encoded >= self.num_layers

  def queued_bytes(self, nbytes: int, *, layer_done: bool = False) -> None:
    """``nbytes`` of encoded chunks are handed to the streams; ``layer_done``:
    they complete one of the transfer's layers."""
    self._owner._queued(self, int(nbytes), layer_done)

  def sent_bytes(self, nbytes: int) -> None:
    """gRPC has taken ``nbytes`` of chunk data of this transfer."""
    self._owner._sent(self, int(nbytes))

  def end(self) -> None:
    """The transfer committed or failed (idempotent)."""
    self._owner._end(self)


class LinkCounters:
  """Thread-safe link gauges of a server's senders; see the module docstring.

  ``label`` names the link (e.g. "A->B") in ``report``.
  """

  def __init__(self, label: str = ""):
    self.label = label
    self._lock = threading.Lock()
    self._active: set[LinkTransfer] = set()
    self._pending = 0
    self.bytes_queued_total = 0
    self.bytes_sent_total = 0
    self.transfers_total = 0
    # Callables returning TCP retransmissions seen by a sender's data-plane
    # connections (Linux TCP_INFO); summed into link_tcp_retransmits_total.
    self._retransmit_sources: list = []

  def add_retransmit_source(self, source) -> None:
    """``source()`` -> retransmitted segments so far (monotonic per source)."""
    with self._lock:
      self._retransmit_sources.append(source)

  def retransmits(self) -> int:
    with self._lock:
      sources = list(self._retransmit_sources)
    total = 0
    for source in sources:
      try:
        total += int(source())
      except Exception:  # A closed sender must not break GetStats.
        pass
    return total

  def begin(self, transfer_id: str, num_layers: int) -> LinkTransfer:
    """A transfer opened (Begin accepted); it counts as active until ``end``."""
    t = LinkTransfer(self, transfer_id, num_layers)
    with self._lock:
      self._active.add(t)
      self.transfers_total += 1
    return t

  def _queued(self, t: LinkTransfer, nbytes: int, layer_done: bool) -> None:
    with self._lock:
      if t.ended:
        return
      t.queued += nbytes
      self._pending += nbytes
      self.bytes_queued_total += nbytes
      if layer_done:
        t.layers_encoded += 1

  def _sent(self, t: LinkTransfer, nbytes: int) -> None:
    with self._lock:
      # Sent bytes count even after the end (a frame taken as the stream
      # closed): they did cross the link. Pending never goes below zero.
      before = t.pending
      t.sent += nbytes
      self.bytes_sent_total += nbytes
      if not t.ended:
        self._pending -= before - t.pending

  def _end(self, t: LinkTransfer) -> None:
    with self._lock:
      if t.ended:
        return
      t.ended = True
      self._pending -= t.pending
      self._active.discard(t)

  @property
  def pending_bytes(self) -> int:
    with self._lock:
      return self._pending

  def gauges(self) -> dict[str, float]:
    """GetStats gauges: ``link_bytes_pending`` (bytes queued and not yet sent,
    transfers in flight), ``link_transfers_active``, and the monotonic
    ``link_bytes_sent_total``, ``link_bytes_queued_total`` (bytes) and
    ``link_transfers_total`` counters, and ``link_tcp_retransmits_total``
    (TCP retransmissions on the data-plane connections, from TCP_INFO)."""
    retransmits = float(self.retransmits())
    with self._lock:
      return {"link_tcp_retransmits_total": retransmits,"link_bytes_pending": float(self._pending),
              "link_transfers_active": float(len(self._active)),
              "link_bytes_sent_total": float(self.bytes_sent_total),
              "link_bytes_queued_total": float(self.bytes_queued_total),
              "link_transfers_total": float(self.transfers_total)}

  def transfers(self, limit: int = MAX_REPORTED_TRANSFERS) -> dict[str, dict]:
    """Active transfers by id: ``{"pending": bytes, "sent": bytes, "encoded":
    every layer encoded}``, at most ``limit`` (largest pending first). Two live
    transfers with one id are summed."""
    with self._lock:
      rows = [(t.transfer_id, t.pending, t.sent, t.encoded) for t in self._active]
    rows.sort(key=lambda r: -r[1])
    out: dict[str, dict] = {}
    for tid, pending, sent, encoded in rows:
      if tid in out:
        d = out[tid]
        d.update(pending=d["pending"] + pending, sent=d["sent"] + sent,
                 encoded=d["encoded"] and encoded)
      elif len(out) < limit:
        out[tid] = {"pending": pending, "sent": sent, "encoded": encoded}
    return out

  def report(self) -> dict:
    """The GetStats JSON entry: ``{"label", "transfers"}`` (see ``transfers``)."""
    return {"label": self.label, "transfers": self.transfers()}
