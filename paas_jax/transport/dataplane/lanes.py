"""Long-lived data-plane connections from one sender to one receiver.

A ``LanePool`` keeps the connections to one receiver's data-plane port open
between transfers (so a transfer pays no TCP or TLS handshake), hands them to
one transfer at a time (``checkout``/``checkin``) and replaces dead ones.

Each ``Lane`` runs two threads for its whole life: a writer that takes the
attached stream's next frames (a batch, ``BATCH_BYTES``) and writes their
headers and payloads with one ``sendmsg`` over memoryviews of the encoded
buffers (no user-space copy; on TLS, ``send`` of the same views), and a
reader that matches the receiver's in-order replies (one ACKS per run of
stored frames, NACK, RESULT, ERROR) to the frames outstanding. Both go
through one ``sockio.LaneSocket``, which serialises the TLS calls (OpenSSL
connections are not thread-safe) and closes the socket only once both
threads ended. At most ``window_bytes`` are outstanding per lane: that, not
the socket buffer, bounds what a receiver that stops reading can make the
sender hold. A lane with frames outstanding and no reply for
``stall_timeout_s``, or whose socket fails, dies: its outstanding frames go
back to their stream for the other lanes.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import threading
import time

import grpc

from paas_jax.transport.dataplane import frames, sockio, tuning as tuning_lib
from paas_jax.transport.dataplane.streams import Outgoing
from paas_jax.transport.errors import TransferError

log = logging.getLogger(__name__)
Code = grpc.StatusCode


# Frames queued together leave in one write (plain: one sendmsg of all their
# views) up to these bounds; the head frame always goes, whatever its size.
# Plain TCP batches a few ~1 MiB chunks per write: fewer takes, syscalls and
# wakeups (measured on loopback, 100 MB: ~15% less sender CPU than one chunk
# per write). TLS joins a batch into one record, a copy, so only small frames
# share a write there; ``write_now`` runs on a caller's or a reader's thread,
# which should not stay long in a write, and takes small batches too.
BATCH_FRAMES = 64
BATCH_BYTES = 4 << 20
SMALL_BATCH_BYTES = 256 << 10


class LaneDead(Exception):
  pass


class Lane:
  """One connection; see the module docstring."""

  def __init__(self, sock: socket.socket, *, index: int, window_bytes: int,
               tuning: tuning_lib.Tuning, fault_hook=None):
    self.sock = sock
    self.index = index
    self.io = sockio.LaneSocket(sock, tuning.io_timeout_s)
    self.tls = self.io.tls
    self._window = max(int(window_bytes), 1)
    self._tuning = tuning
    self._fault_hook = fault_hook
    self._cv = threading.Condition()
    # Held around each write (sequence numbers in wire order): the writer
    # thread writes, and so does the reader for a frame it released
    # (``write_now``).
    self._wlock = threading.Lock()
    self._seq = 0
    self._unacked: collections.OrderedDict[int, Outgoing] = collections.OrderedDict()
    self._unacked_bytes = 0
    self._stream = None
    self._last_progress = time.monotonic()
    self.dead: BaseException | None = None
    self.frames_sent = 0
    self.bytes_sent = 0
    self._threads_running = 2  # the last one to end closes the socket
    self._writer = threading.Thread(target=self._run, args=(self._write_loop,), daemon=True,
                                    name=f"dp-lane{index}-tx")
    self._reader = threading.Thread(target=self._run, args=(self._read_loop,), daemon=True,
                                    name=f"dp-lane{index}-rx")
    self._writer.start()
    self._reader.start()

  @property
  def alive(self) -> bool:
    return self.dead is None

  @property
  def idle(self) -> bool:
    with self._cv:
      return self._stream is None

  def attach(self, stream) -> None:
    with self._cv:
      dead = self.dead
      if dead is None:
        self._stream = stream
        self._cv.notify_all()
    if dead is not None:
      # Died between checkout and attach (e.g. the receiver refused the peer
      # right after the handshake): the stream must hear of it.
      stream.lane_died(self, [], _describe(dead))

  def detach(self, stream) -> None:
    with self._cv:
      if self._stream is stream:
        self._stream = None
      self._cv.notify_all()

  def tcp_info(self) -> tuning_lib.TcpInfo | None:
    return tuning_lib.tcp_info(self.sock)

  def close(self, why: str = "closed") -> None:
    self._die(LaneDead(why))

  def _run(self, loop) -> None:
    try:
      loop()
    except BaseException as e:  # a bug: the lane must still die and free its socket
      self._die(e)
      raise
    finally:
      with self._cv:
        self._threads_running -= 1
        last = self._threads_running == 0
      if last:
        # Both threads only end once the lane is dead; now no thread can be
        # inside a call on the descriptor, so its number may be reused.
        self.io.close()

  # -- writer ----------------------------------------------------------------------------

  def _write_loop(self) -> None:
    while self.dead is None:
      with self._cv:
        while self._stream is None and self.dead is None:
          self._cv.wait()
        stream = self._stream
      if stream is None:
        return
      while self.dead is None:
        if not stream.wait_for_frames(self):
          break
        try:
          self._write_queued(stream)
        except LaneDead:
          return
        except (OSError, ValueError) as e:
          self._writer_failed(e)
          return
      with self._cv:  # wait to be detached (or attached to the next stream)
        while self._stream is stream and self.dead is None:
          self._cv.wait(0.5)

  def _write_queued(self, stream) -> None:
    """Takes what ``stream`` has queued for this lane and writes it, both
    under the write lock: whichever thread writes next (``write_now``) takes
    the frames after these, so frames leave in queue order."""
    with self._wlock:
      with self._cv:
        room = self._window - self._unacked_bytes
      items = stream.take(self, room, BATCH_FRAMES,
                          SMALL_BATCH_BYTES if self.tls else BATCH_BYTES)
      if items:
        self._send(items)

  def _send(self, items: list[Outgoing]) -> None:
    """Writes ``items`` (one stream's, within the window unless it is one
    frame, which may wait for room) with one write."""
    stream = items[0].stream
    size = sum(item.nbytes for item in items)
    with self._cv:
      while (self.dead is None and self._unacked
             and self._unacked_bytes + size > self._window):
        self._cv.wait(self._tuning.io_timeout_s)
        self._check_stall_locked()
      dead = self.dead
      if dead is None:
        if not self._unacked:
          self._last_progress = time.monotonic()
        seqs = []
        for item in items:
          self._seq = (self._seq + 1) & 0xFFFFFFFF
          seqs.append(self._seq)
          self._unacked[self._seq] = item
        self._unacked_bytes += size
    if dead is not None:
      stream.lane_died(self, items, dead)
      raise LaneDead()
    # Whether each write is a resend, as of now: a NACK read while it is being
    # written marks the item for the next write, not this one.
    resends = [item.resend for item in items]
    views = []
    for item, seq in zip(items, seqs):
      views.append(memoryview(frames.pack_header(item.kind, seq, stream.tid, item.layer,
                                                 item.key.encode(), item.crc, item.nbytes,
                                                 item.attempt)))
      payload = item.payload
      if self._fault_hook is not None:
        payload = self._fault_hook(self, item, payload)
      views.append(payload)
    if self.tls and len(items) > 1:
      # TLS writes one view per call: small frames go as one record instead.
      views = [memoryview(b"".join(views))]
    self._write(views, stream)
    self.frames_sent += len(items)
    self.bytes_sent += size
    for item, resend in zip(items, resends):
      stream.sent(item, resend)

  def _write(self, views: list[memoryview], stream) -> None:
    """Writes every byte of ``views`` (retrying partial writes and timeouts)."""
    views = [v for v in views if len(v)]
    while views:
      n = self.io.send(views)
      if self.dead is not None:
        raise LaneDead()
      if n == 0:
        with self._cv:
          self._check_stall_locked()
        if stream.error is not None:
          # A frame cut short would desynchronise the connection.
          self._die(LaneDead("transfer failed while a frame was half written"))
          raise LaneDead()
        continue
      while n and views:
        if n >= len(views[0]):
          n -= len(views[0])
          views.pop(0)
        else:
          views[0] = views[0][n:]
          n = 0

  def write_now(self, stream) -> None:
    """Writes what ``stream`` has queued for this lane from the calling
    thread (the lane's reader, for an armed COMMIT released by the last
    acknowledgement; the transfer's caller, ``LaneStream.write_through``):
    the writer thread need not wake up. Frames are taken under the write
    lock, so none overtakes another; if the writer is busy, or the head
    frame does not fit the window, the writer sends them."""
    if not self._wlock.acquire(blocking=False):
      return
    try:
      if self.dead is not None:
        return
      with self._cv:
        room = self._window - self._unacked_bytes
      items = stream.take(self, room, BATCH_FRAMES, SMALL_BATCH_BYTES, fit_room=True)
      if items:
        self._send(items)
    except LaneDead:
      pass
    except (OSError, ValueError) as e:
      self._die(e)  # not _writer_failed: that waits for this very thread to read a reply
    finally:
      self._wlock.release()

  def _writer_failed(self, exc: BaseException) -> None:
    # The receiver may have refused the connection with a reply (ERROR) just
    # before closing it: let the reader find that reply, so the transfer
    # fails with the receiver's reason rather than "broken pipe".
    self.io.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + 2.0
    with self._cv:
      while self.dead is None and time.monotonic() < deadline:
        self._cv.wait(0.05)
    self._die(exc)

  # -- reader ----------------------------------------------------------------------------

  def _recv(self, view: memoryview) -> None:
    n = 0
    while n < len(view):
      got = self.io.recv_into(view[n:])
      if got is None:  # nothing within io_timeout_s
        if self.dead is not None:
          raise LaneDead()
        with self._cv:
          self._check_stall_locked()
        continue
      if got == 0:
        raise frames.PeerClosed("receiver closed the data-plane connection")
      n += got

  def _read_loop(self) -> None:
    head = bytearray(frames.REPLY.size)
    try:
      while self.dead is None:
        self._recv(memoryview(head))
        magic, seq, code, kind, _, msg_len = frames.REPLY.unpack(head)
        if (magic != frames.REPLY_MAGIC or kind not in frames.REPLY_KINDS
            or msg_len > frames.reply_body_limit(kind)):
          raise frames.ProtocolError(Code.INTERNAL, "malformed reply from the receiver")
        body = bytearray(msg_len)
        if msg_len:
          self._recv(memoryview(body))
        if kind == frames.ACKS:
          for item in self._pop_through(seq):
            item.stream.acked(item, self)
          continue
        message = "" if kind == frames.RESULT else body.decode("utf-8", "replace")
        status = frames.status_code(code)
        with self._cv:
          item = self._unacked.pop(seq, None)
          if item is not None:
            self._unacked_bytes -= item.nbytes
          self._last_progress = time.monotonic()
          self._cv.notify_all()
        if item is None:
          # Only a connection-level refusal (bad TLS peer, bad header) has no frame.
          raise frames.ProtocolError(status, message or f"reply to unknown frame {seq}")
        stream = item.stream
        if kind == frames.ACK:
          stream.acked(item, self)
        elif kind == frames.NACK:
          stream.nacked(item, message)
        elif kind == frames.RESULT:
          stream.result(item, bytes(body), self)
        else:
          stream.fail(TransferError(status, message, stream.transfer_id))
    except LaneDead:
      return
    except frames.ProtocolError as e:
      self._die(e)
    except (OSError, ValueError, frames.PeerClosed) as e:
      self._die(e)

  def _pop_through(self, seq: int) -> list[Outgoing]:
    """The outstanding frames up to and including ``seq`` (an ACKS reply), oldest first."""
    with self._cv:
      if seq not in self._unacked:
        raise frames.ProtocolError(Code.INTERNAL, f"receiver acknowledged frame {seq}, which "
                                   "is not outstanding on this connection")
      out = []
      while True:
        got, item = self._unacked.popitem(last=False)
        self._unacked_bytes -= item.nbytes
        out.append(item)
        if got == seq:
          break
      self._last_progress = time.monotonic()
      self._cv.notify_all()
    return out

  # -- death -----------------------------------------------------------------------------

  def _check_stall_locked(self) -> None:
    if (self.dead is None and self._unacked
        and time.monotonic() - self._last_progress > self._tuning.stall_timeout_s):
      threading.Thread(target=self._die, daemon=True, args=(TimeoutError(
          f"no reply from the receiver for {self._tuning.stall_timeout_s:g} s with "
          f"{self._unacked_bytes} bytes outstanding"),)).start()
      self._cv.wait(0.05)

  def _die(self, exc: BaseException) -> None:
    with self._cv:
      if self.dead is not None:
        return
      self.dead = exc
      items = list(self._unacked.values())
      self._unacked.clear()
      self._unacked_bytes = 0
      stream = self._stream
      self._stream = None
      self._cv.notify_all()
    # Wakes both threads; the last one to end closes the socket (see _run).
    self.io.shutdown(socket.SHUT_RDWR)
    by_stream: dict[int, tuple] = {}
    for item in items:
      by_stream.setdefault(id(item.stream), (item.stream, []))[1].append(item)
    if stream is not None and id(stream) not in by_stream:
      by_stream[id(stream)] = (stream, [])
    if not isinstance(exc, LaneDead) or by_stream:
      log.info("data-plane lane %d closed: %s", self.index, exc)
    for s, its in by_stream.values():
      s.lane_died(self, its, _describe(exc))


def _describe(exc: BaseException) -> BaseException:
  if isinstance(exc, frames.ProtocolError):
    return exc
  return ConnectionError(f"{type(exc).__name__}: {exc}")


class LanePool:
  """Connections to one receiver's data-plane port, kept between transfers.

  Args:
    host, port: the receiver's data plane.
    ssl_context: client context (``dataplane.tls.client_context``); None:
      plaintext (only when the deployment runs --insecure).
    window_bytes: unacknowledged bytes allowed per connection.
    tuning: socket settings.
  """

  def __init__(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None,
               window_bytes: int, tuning: tuning_lib.Tuning):
    self.host, self.port = host, port
    self.ssl_context = ssl_context
    self.window_bytes = window_bytes
    self.tuning = tuning
    self.fault_hook = None  # tests: f(lane, item, payload) -> the payload actually written
    # BeginResponse.max_frame_bytes of the receiver's last Begin (0: none yet).
    self.announced_max_frame_bytes = 0
    self._lock = threading.Lock()
    self._idle: list[Lane] = []
    self._all: list[Lane] = []
    self._opened = 0
    self._closed = False

  def _connect(self, transfer_id: str) -> Lane:
    try:
      raw = socket.create_connection((self.host, self.port),
                                     timeout=self.tuning.connect_timeout_s)
    except OSError as e:
      raise TransferError(Code.UNAVAILABLE, f"data plane {self.host}:{self.port} "
                          f"unreachable: {e}", transfer_id) from None
    tuning_lib.apply(raw, self.tuning)
    sock = raw
    if self.ssl_context is not None:
      try:
        sock = self.ssl_context.wrap_socket(raw, server_hostname=self.host)
      except (ssl.SSLError, OSError) as e:
        raw.close()
        raise TransferError(Code.UNAVAILABLE, f"data plane {self.host}:{self.port}: TLS "
                            f"handshake failed: {e}", transfer_id) from None
    with self._lock:
      self._opened += 1
      index = self._opened
    lane = Lane(sock, index=index, window_bytes=self.window_bytes, tuning=self.tuning,
                fault_hook=self.fault_hook)
    with self._lock:
      self._all.append(lane)
    return lane

  def checkout(self, n: int, transfer_id: str, fresh: bool = False) -> list[Lane]:
    """``n`` connections for one transfer: idle live ones first, then new ones."""
    out: list[Lane] = []
    with self._lock:
      if self._closed:
        raise TransferError(Code.CANCELLED, "sender closed", transfer_id)
      self._idle = [l for l in self._idle if l.alive]
      while self._idle and len(out) < n and not fresh:
        out.append(self._idle.pop())
    try:
      while len(out) < n:
        out.append(self._connect(transfer_id))
    except TransferError:
      self.checkin(out)
      raise
    return out

  def checkin(self, lanes) -> None:
    with self._lock:
      for lane in lanes:
        if lane.alive and not self._closed:
          self._idle.append(lane)
      self._all = [l for l in self._all if l.alive]

  def lanes(self) -> list[Lane]:
    with self._lock:
      return [l for l in self._all if l.alive]

  def warm(self) -> bool:
    """Whether an idle live connection is waiting (a transfer may then send its
    Begin over it instead of over gRPC: its receiver was reachable just now)."""
    with self._lock:
      return any(l.alive for l in self._idle)

  def retransmits(self) -> int:
    """TCP retransmissions over the live connections (Linux TCP_INFO)."""
    total = 0
    for lane in self.lanes():
      info = lane.tcp_info()
      if info is not None:
        total += info.total_retrans
    return total

  def close(self) -> None:
    with self._lock:
      self._closed = True
      lanes, self._all, self._idle = self._all, [], []
    for lane in lanes:
      lane.close("sender closed")
