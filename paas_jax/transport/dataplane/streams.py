"""One transfer's frames striped over the connections it has checked out.

A ``LaneStream`` is the sending side of one transfer (or one resend round) on
the data plane: the encoder ``put``s frames (blocking beyond a byte bound, so
a slow link stalls encoding instead of filling host memory), every lane
attached to the stream takes the next frame as soon as its window allows
(layers are thereby striped over the N connections in arrival order), and
``wait`` returns once every frame was acknowledged by the receiver.

A frame the receiver rejects (NACK: crc32c mismatch, truncated...) goes back
to the head of the queue with ``attempt + 1``; the frames a dead connection
had outstanding go back too, and the other connections carry them (a
replacement connection is opened when none is left, up to a budget). The
receiver's own per-chunk attempt limit turns a chunk that keeps failing into
DATA_LOSS; nothing here retries forever.

Control frames (BEGIN, COMMIT: ``call``) travel in the same queue and wait
for their RESULT; they are never resent (a lost connection or an ERROR fails
the stream). ``drain`` waits for every frame so far without giving the
connections back, so a transfer keeps them from Begin to Commit.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import grpc

from paas_jax.codec.store import crc32c
from paas_jax.transport.dataplane import frames
from paas_jax.transport.dataplane.outgoing import Outgoing
from paas_jax.transport.errors import TransferError

Code = grpc.StatusCode


def _control_frame(kind: int, payload: bytes) -> Outgoing:
  """A BEGIN / COMMIT frame, waiting for its RESULT (``LaneStream.reply``)."""
  if kind not in frames.CONTROL_KINDS:
    raise ValueError(f"frame kind {kind} is not a control frame")
  item = Outgoing(kind, -1, "", crc32c(payload), payload, is_chunk=False)
  item.reply = []
  return item


class LaneStream:
  """The data-plane side of one transfer; see the module docstring.

  Args:
    pool: the ``LanePool`` of the receiver's data plane.
    transfer_id: the transfer the frames belong to.
    lanes: connections to stripe over.
    max_queued_bytes: bound of frames queued and not yet written.
    deadline: monotonic time by which every frame must be acknowledged.
    on_sent: ``f(item, resend)`` after an item's last byte was written
      (``resend``: that write was a resend; ``item.resend`` may already say
      so of its next one).
    on_error: ``f(TransferError)`` once, when the stream fails.
  """

  def __init__(self, pool, transfer_id: str, *, lanes: int, max_queued_bytes: int,
               deadline: float, on_sent: Callable[[Outgoing, bool], None],
               on_error: Callable[[TransferError], None]):
    self.transfer_id = transfer_id
    self.tid = transfer_id.encode()
    self._pool = pool
    self._cv = threading.Condition()
    self._queue: collections.deque[Outgoing] = collections.deque()
    self._queued_bytes = 0
    self._max_queued = max(int(max_queued_bytes), 1)
    self._outstanding = 0
    self._closed = False
    self._error: TransferError | None = None
    self._deadline = deadline
    self._on_sent = on_sent
    self._on_error = on_error
    self.peak_bytes = 0
    self.resent = 0
    self.lanes_lost = 0
    self._replacements = lanes  # fresh connections allowed after deaths
    # While a BEGIN is unanswered, only the lane that took it takes frames: on
    # one connection the receiver reads them after BEGIN, never before.
    self._begin_pending = False
    self._begin_lane = None
    # A control frame to queue the moment nothing is outstanding (``call_when_drained``).
    self._armed: Outgoing | None = None
    self._lanes = pool.checkout(lanes, transfer_id)
    for lane in self._lanes:
      lane.attach(self)

  @property
  def error(self) -> TransferError | None:
    return self._error

  @property
  def num_lanes(self) -> int:
    return len(self._lanes)

  # -- producer ------------------------------------------------------------------------

  def put(self, item: Outgoing) -> None:
    self.put_many((item,))

  def put_many(self, items) -> None:
    """Queues ``items`` in order, waking the lanes once for as many as fit
    (so that they leave together in a lane's batched write); blocks while the
    queue is over its byte bound (a lone frame always fits an empty queue).

    Raises:
      TransferError: the stream failed (or its deadline passed while waiting).
    """
    self._check_deadline()
    pending = collections.deque(items)
    while pending:
      with self._cv:
        while pending:
          if self._error is not None:
            raise self._error
          if self._closed:
            raise RuntimeError("put() on a closed stream")
          item = pending[0]
          if self._queue and self._queued_bytes + item.nbytes > self._max_queued:
            break
          pending.popleft()
          item.stream = self
          self._queue.append(item)
          self._queued_bytes += item.nbytes
          self._outstanding += 1
        self.peak_bytes = max(self.peak_bytes, self._queued_bytes)
        self._cv.notify_all()
        while (pending and self._error is None and self._queue
               and self._queued_bytes + pending[0].nbytes > self._max_queued
               and time.monotonic() <= self._deadline):
          self._cv.wait(0.1)
      if pending:
        self._check_deadline()

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()

  def wait(self) -> None:
    """Until every frame is acknowledged; returns the lanes to the pool.

    Raises:
      TransferError: the stream failed (the receiver's status, a lost link,
        DEADLINE_EXCEEDED).
    """
    try:
      with self._cv:
        while self._error is None and not (self._closed and self._outstanding == 0):
          if time.monotonic() > self._deadline:
            break
          self._cv.wait(0.1)
      self._check_deadline()
      with self._cv:
        if self._error is not None:
          raise self._error
    finally:
      self._release_lanes()

  def abort(self, err: TransferError) -> None:
    self._fail(err)
    self._release_lanes()

  def drain(self) -> None:
    """Until every frame put so far is acknowledged; keeps the connections.

    Raises:
      TransferError: as ``wait``.
    """
    with self._cv:
      while self._error is None and self._outstanding:
        if time.monotonic() > self._deadline:
          break
        self._cv.wait(0.1)
    self._check_deadline()
    with self._cv:
      if self._error is not None:
        raise self._error

  def call(self, kind: int, payload: bytes, timeout_s: float) -> bytes:
    """Sends a control frame (BEGIN / COMMIT) and returns its RESULT body.

    Raises:
      TransferError: the receiver's status (ERROR), a lost connection
        (UNAVAILABLE), DEADLINE_EXCEEDED; the stream has failed.
    """
    return self.reply(self.call_async(kind, payload), timeout_s)

  def call_async(self, kind: int, payload: bytes) -> Outgoing:
    """Queues a control frame; ``reply`` waits for its RESULT. Frames queued
    after a BEGIN wait for its RESULT unless they can follow it on its own
    connection (pipelined: no round trip before the first frame leaves)."""
    item = _control_frame(kind, payload)
    if kind == frames.BEGIN:
      with self._cv:
        self._begin_pending = True
        self._begin_lane = None
    self.put(item)
    return item

  def call_when_drained(self, kind: int, payload: bytes) -> Outgoing:
    """Like ``call_async``, but the frame is queued only once every frame put
    so far is acknowledged (at once if they are): COMMIT, which the receiver
    must not see before the state is complete. The lane thread that reads
    the last acknowledgement writes it at once (``Lane.write_now``), so
    neither the caller's thread nor the lane's writer has to wake up between
    the last acknowledgement and COMMIT. ``reply`` waits for its RESULT."""
    item = _control_frame(kind, payload)
    with self._cv:
      if self._error is not None:
        raise self._error
      if self._armed is not None:
        raise RuntimeError("a frame is already armed on this stream")
      if self._outstanding:
        self._armed = item
        return item
    self.put(item)
    return item

  def call_after(self, kind: int, payload: bytes, after: Outgoing) -> Outgoing:
    """Like ``call_async``, but the frame goes on the connection that takes
    ``after`` (queued before it), right behind it: the receiver reads one
    connection in order, so it handles ``after`` first. For COMMIT behind a
    BUNDLE that holds the whole state (no acknowledgement to wait for; if the
    receiver rejects the bundle, the resent one is taken again, and COMMIT
    follows wherever it goes or, already written, is answered with what is
    missing). ``reply`` waits for the RESULT."""
    item = _control_frame(kind, payload)
    item.follows = after
    self.put(item)
    return item

  def _release_armed_locked(self) -> Outgoing | None:
    """Queues the armed frame once nothing is outstanding (caller holds the
    lock); returns it, to be written by the caller's lane."""
    item = self._armed
    if item is None or self._outstanding or self._error is not None:
      return None
    self._armed = None
    item.stream = self
    self._queue.append(item)
    self._queued_bytes += item.nbytes
    self._outstanding += 1
    self._cv.notify_all()
    return item

  def reply(self, item: Outgoing, timeout_s: float) -> bytes:
    """The RESULT body of a control frame from ``call_async``.

    Raises:
      TransferError: as ``call``.
    """
    with self._cv:
      while self._error is None and not item.reply:
        # ``timeout_s`` counts from the frame's write (an armed frame waits
        # for the frames before it first); the transfer deadline bounds all.
        end = self._deadline
        if item.sent_at is not None:
          end = min(end, item.sent_at + timeout_s)
        if time.monotonic() >= end:
          break
        self._cv.wait(0.1)
      if item.reply:
        return item.reply[0]
    if self._error is None:
      what = "BEGIN" if item.kind == frames.BEGIN else "COMMIT"
      self._fail(TransferError(Code.DEADLINE_EXCEEDED, f"no reply to {what} on the data "
                               f"plane within {timeout_s:g} s", self.transfer_id))
    raise self._error

  # -- lanes ---------------------------------------------------------------------------

  def wait_for_frames(self, lane) -> bool:
    """Until a frame is queued that ``lane`` may take (True), or the stream
    is done or failed or no longer has ``lane`` (False). Takes nothing: the
    lane takes with ``take`` under its write lock, so that frames leave in
    queue order whichever thread writes them."""
    with self._cv:
      while True:
        if self._error is not None or lane not in self._lanes:
          return False
        if self._queue and self._may_take(lane):
          return True
        if self._closed and self._outstanding == 0:
          return False
        self._cv.wait(0.1)

  def take(self, lane, room: int, max_frames: int, max_bytes: int,
           fit_room: bool = False) -> list[Outgoing]:
    """The queued frames ``lane`` may write now, without waiting: the head
    frame (only if it fits ``room``, the lane's free window, with
    ``fit_room``; else the caller's write waits for room), then more while
    the batch stays within ``max_frames``, ``max_bytes`` and ``room`` (small
    frames leave in one write). [] if there is none."""
    with self._cv:
      if (self._error is not None or lane not in self._lanes or not self._queue
          or (fit_room and self._queue[0].nbytes > room)):
        return []
      out, total = [], 0
      limit = min(max_bytes, room)
      # Behind an unanswered BEGIN only its own lane writes, so a batch may
      # carry BEGIN and the frames after it.
      while self._queue and len(out) < max_frames and self._may_take(lane):
        item = self._queue[0]
        if out and total + item.nbytes > limit:
          break
        self._queue.popleft()
        self._queued_bytes -= item.nbytes
        item.taken_by = lane
        if item.kind == frames.BEGIN:
          self._begin_lane = lane
        out.append(item)
        total += item.nbytes
      self._cv.notify_all()
    return out

  def _may_take(self, lane) -> bool:
    """Whether ``lane`` may take the head of the (non-empty) queue (lock held)."""
    if self._begin_pending and self._begin_lane not in (None, lane):
      return False
    follows = self._queue[0].follows
    return follows is None or follows.taken_by is lane

  def write_through(self) -> None:
    """Writes what is queued from the calling thread, on each lane whose
    write lock is free (``Lane.write_now``): for a caller that queued small frames (BEGIN, a
    BUNDLE) and goes on with other work, so that they need not wait for a
    lane's writer thread to get the interpreter."""
    with self._cv:
      lanes = list(self._lanes)
    for lane in lanes:
      if not self._queue:
        return
      lane.write_now(self)

  def sent(self, item: Outgoing, resend: bool) -> None:
    """``item``'s last byte was written; ``resend``: that write was a resend."""
    item.sent_at = time.monotonic()
    self._on_sent(item, resend)

  def acked(self, item: Outgoing, lane=None) -> None:
    """``item`` is stored at the receiver. ``lane``: the connection whose
    reader saw it, which writes an armed frame released by it."""
    with self._cv:
      self._outstanding -= 1
      released = self._release_armed_locked()  # notifies if it queued a frame
      if not self._outstanding:
        # Only waiters for "nothing outstanding" (wait, drain, a writer of a
        # closed stream) care about an acknowledgement; waking the producer
        # and the writers for each one cost a thread switch per chunk.
        self._cv.notify_all()
    if released is not None and lane is not None:
      lane.write_now(self)

  def result(self, item: Outgoing, body: bytes, lane=None) -> None:
    """A control frame's RESULT (``lane``: as in ``acked``)."""
    with self._cv:
      if item.reply is None:
        fail = TransferError(Code.INTERNAL, "data-plane receiver answered a "
                             f"{'chunk' if item.is_chunk else 'descriptor'} with a RESULT",
                             self.transfer_id)
      else:
        fail = None
        item.reply.append(body)
        if item.kind == frames.BEGIN:
          self._begin_pending = False
      self._outstanding -= 1
      released = self._release_armed_locked() if fail is None else None
      self._cv.notify_all()
    if fail is not None:
      self._fail(fail)
    elif released is not None and lane is not None:
      lane.write_now(self)

  def nacked(self, item: Outgoing, reason: str) -> None:
    """The receiver read the frame and rejected it: send it again, first."""
    with self._cv:
      if self._error is not None:
        return
      item.attempt += 1
      item.resend = True
      self.resent += 1
      self._queue.appendleft(item)
      self._queued_bytes += item.nbytes
      self._cv.notify_all()

  def fail(self, err: TransferError) -> None:
    self._fail(err)

  def lane_died(self, lane, items: list[Outgoing], exc: BaseException) -> None:
    """``lane`` broke with ``items`` unacknowledged: they go to the other lanes."""
    if isinstance(exc, frames.ProtocolError):
      # The receiver refused the connection itself (peer role, bad header):
      # other connections would be refused alike.
      with self._cv:
        if lane in self._lanes:
          self._lanes.remove(lane)
      self._fail(TransferError(exc.code, f"data plane refused the connection: "
                               f"{exc.message}", self.transfer_id))
      return
    if any(i.kind == frames.COMMIT for i in items):
      # The receiver may have run it: a resend could commit twice.
      with self._cv:
        if lane in self._lanes:
          self._lanes.remove(lane)
          self.lanes_lost += 1
      self._fail(TransferError(Code.UNAVAILABLE, "data-plane connection lost while COMMIT "
                               f"was unanswered: {exc}", self.transfer_id))
      return
    replace = False
    with self._cv:
      if lane in self._lanes:
        self._lanes.remove(lane)
        self.lanes_lost += 1
      if self._error is not None:
        return
      for item in self._queue:
        if item.follows is not None and item.follows.taken_by is lane:
          # What it follows is either back in the queue (below; taken again,
          # the pin holds) or acknowledged: any lane may take it now.
          item.follows = None
      for item in reversed(items):
        item.resend = True
        self.resent += 1
        self._queue.appendleft(item)
        self._queued_bytes += item.nbytes
        if item.kind == frames.BEGIN:
          # Sent again first, with the frames that followed it, on whichever
          # lane takes it (gated as before); attempt > 0 tells the receiver
          # it may have run it already, and it answers as it did then.
          item.attempt += 1
          self._begin_pending = True
          self._begin_lane = None
      self._cv.notify_all()
      if not self._lanes:
        if self._replacements <= 0:
          err = TransferError(Code.UNAVAILABLE, "every data-plane connection of this transfer "
                              f"failed; last: {exc}", self.transfer_id)
        else:
          self._replacements -= 1
          replace = True
    if replace:
      try:
        fresh = self._pool.checkout(1, self.transfer_id, fresh=True)
      except TransferError as e:
        self._fail(TransferError(e.code, f"{e.message} (after losing every connection; "
                                 f"last: {exc})", self.transfer_id))
        return
      with self._cv:
        self._lanes.extend(fresh)
      for f in fresh:
        f.attach(self)
    elif not self._lanes:
      self._fail(err)

  # -- internals -------------------------------------------------------------------------

  def _check_deadline(self) -> None:
    if self._error is None and time.monotonic() > self._deadline:
      self._fail(TransferError(Code.DEADLINE_EXCEEDED, "transfer deadline passed with "
                               f"{self._outstanding} frame(s) unacknowledged",
                               self.transfer_id))

  def _fail(self, err: TransferError) -> None:
    with self._cv:
      if self._error is not None:
        return
      self._error = err
      self._queue.clear()
      self._queued_bytes = 0
      self._cv.notify_all()
    self._on_error(err)

  def _release_lanes(self) -> None:
    with self._cv:
      lanes, self._lanes = self._lanes, []
      self._cv.notify_all()
    for lane in lanes:
      lane.detach(self)
    self._pool.checkin(lanes)
