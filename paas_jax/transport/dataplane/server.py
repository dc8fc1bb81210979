"""Receiving side of the TCP data plane: a listener beside the gRPC port.

Every accepted connection gets a thread that reads frames and answers them
in order: stored frames with one cumulative ACKS per run (sent when the
input runs dry or every ``frames.ACK_EVERY_*``), a rejected one with NACK and
the reason, a failed transfer with ERROR and its gRPC status code. BEGIN and
COMMIT frames (when ``control``) run the receiver's Begin / Commit and are
answered with the serialized response (RESULT). A BUNDLE (a small state's
descriptors and objects in one frame) is read into one buffer, its crc32c
computed as it arrives, and handed to the sink in one call
(``plane_bundle``), which verifies and adopts it whole.
A chunk's payload is read with ``recv_into`` straight into the buffer that
the decode side keeps (no copy between the socket and the restore), and its
crc32c is computed as it arrives (``buffers``). The
connection outlives transfers: the sender reuses it for the next one.

Refused with a clear status and nothing kept: a frame for an unknown or
failed transfer (its payload is read and dropped, ERROR NOT_FOUND /
the failure's code; the connection stays usable), a frame larger than
``max_frame_bytes`` or a malformed header (ERROR INVALID_ARGUMENT /
RESOURCE_EXHAUSTED, then the connection is closed: its byte stream cannot
be trusted any more), and with TLS a peer whose certificate is not from the
CA (handshake fails) or names a role the patterns do not allow (ERROR
PERMISSION_DENIED).
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from typing import Sequence

import grpc

from paas_jax.codec.store import crc32c
from paas_jax.transport.dataplane import (buffers, framein, frames, sockio, tls as tls_lib,
                                          tuning as tuning_lib)
from paas_jax.transport.dataplane.interface import FrameSink, TransferRefused

log = logging.getLogger(__name__)
Code = grpc.StatusCode


class DataPlaneServer:
  """Listens on ``host:port`` (0: any free port) for data-plane connections.

  Args:
    sink: where frames go (a ``StateReceiver``).
    ssl_context: ``tls.server_context``; None: plaintext (--insecure only).
    peer_patterns: fnmatch patterns the sender's certificate names must
      match (TLS only; None: any peer with a certificate from the CA).
    tuning: socket settings.
    control: accept BEGIN / COMMIT frames (the sink's ``plane_begin`` /
      ``plane_commit``); False answers them UNIMPLEMENTED.
  """

  def __init__(self, sink: FrameSink, host: str = "127.0.0.1", port: int = 0, *,
               ssl_context: ssl.SSLContext | None = None,
               peer_patterns: Sequence[str] | None = None,
               tuning: tuning_lib.Tuning = tuning_lib.Tuning(), control: bool = True):
    self.sink = sink
    self.control = control
    self.ssl_context = ssl_context
    self.peer_patterns = None if peer_patterns is None else tuple(peer_patterns)
    self.tuning = tuning
    if tuning.retain_freed_memory:
      buffers.retain_freed_memory()
    self._listener = socket.create_server((host, port), backlog=128)
    self.host = host
    self.port = self._listener.getsockname()[1]
    self._lock = threading.Lock()
    self._conns: set[socket.socket] = set()
    self._closed = False
    self.refused = 0  # connections or frames refused (metrics, tests)
    self.connections_total = 0
    self.frames_total = 0  # frames read and replies written (tests: replies are batched)
    self.replies_total = 0
    self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                      name="dp-accept")
    self._accepter.start()

  @property
  def open_connections(self) -> int:
    with self._lock:
      return len(self._conns)

  def close(self) -> None:
    with self._lock:
      self._closed = True
      conns = list(self._conns)
    try:
      self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
    except OSError:
      pass
    try:
      self._listener.close()
    except OSError:
      pass
    for c in conns:
      # The kernel's shutdown only: each connection's own thread reads on
      # and closes it (SSLSocket.shutdown would drop its TLS state under it).
      sockio.shutdown(c)
    self._accepter.join(timeout=5)

  def _accept_loop(self) -> None:
    while True:
      try:
        sock, addr = self._listener.accept()
      except OSError:
        return
      with self._lock:
        if self._closed:
          sock.close()
          return
        self._conns.add(sock)
        self.connections_total += 1
      threading.Thread(target=self._serve, args=(sock, addr), daemon=True,
                       name=f"dp-conn-{addr[1]}").start()

  def _serve(self, raw: socket.socket, addr) -> None:
    sock = raw
    try:
      tuning_lib.apply(raw, self.tuning)
      if self.ssl_context is not None:
        raw.settimeout(self.tuning.connect_timeout_s)
        try:
          sock = self.ssl_context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError) as e:
          self.refused += 1
          log.warning("data plane: TLS handshake with %s failed: %s", addr, e)
          return
        names = tls_lib.peer_names(sock)
        if not tls_lib.allowed(names, self.peer_patterns):
          self.refused += 1
          raise frames.ProtocolError(
              Code.PERMISSION_DENIED, f"peer {names} may not push states here (allowed: "
              f"{list(self.peer_patterns or ())})")
        with self._lock:
          self._conns.discard(raw)
          self._conns.add(sock)
      sock.settimeout(None)
      self._frames(sock, waitall=not isinstance(sock, ssl.SSLSocket), peer=_peer(addr))
    except frames.ProtocolError as e:
      self.refused += 1
      log.warning("data plane: refusing %s: %s", addr, e)
      self._refuse(sock, e)
    except (frames.PeerClosed, OSError, ValueError):
      pass  # The sender went away; its transfers fail by their own deadlines/Abort.
    finally:
      with self._lock:
        self._conns.discard(sock)
        self._conns.discard(raw)
      try:
        sock.close()
      except OSError:
        pass

  def _refuse(self, sock, e: frames.ProtocolError, seq: int = 0) -> None:
    try:
      sock.sendall(frames.pack_reply(seq, frames.ERROR, e.code, e.message))
      # Half-close and let the sender read the reply before the connection
      # goes away (closing with unread input would reset it first).
      if not isinstance(sock, ssl.SSLSocket):
        sockio.shutdown(sock, socket.SHUT_WR)
      sock.settimeout(1.0)
      scratch = bytearray(64 << 10)
      end = time.monotonic() + 1.0
      while time.monotonic() < end and sock.recv_into(scratch):
        pass
    except (OSError, ValueError):
      pass

  def _frames(self, sock, waitall: bool, peer: str) -> None:
    sink = self.sink
    # Read ahead: the small frames of a state come out of one recv_into
    # (framein's docstring); large payloads still land in their own buffer.
    stream = framein.FrameInput(sock, waitall)
    header_size = frames.HEADER.size
    acks = _AckRun(self, sock)
    while True:
      if acks.frames and not stream.waiting(acks.poller):
        acks.flush()  # the sender has nothing more in flight right now
      try:
        head = stream.take(header_size)
      except frames.PeerClosed:
        acks.flush()
        return
      kind, seq, tid_len, layer, crc, key_len, length, attempt = frames.parse_header(head)
      self.frames_total += 1
      if length > sink.max_frame_bytes:
        raise frames.ProtocolError(
            Code.RESOURCE_EXHAUSTED, f"frame of {length} bytes exceeds this receiver's "
            f"{sink.max_frame_bytes}-byte limit (layer {layer})")
      names = stream.take(tid_len + key_len)
      try:
        tid = str(names[:tid_len], "utf-8")
        key = str(names[tid_len:], "utf-8")
      except UnicodeDecodeError:
        raise frames.ProtocolError(Code.INVALID_ARGUMENT, "frame header: id or key is not "
                                   "utf-8") from None
      if kind in frames.CONTROL_KINDS:
        data = bytearray(length)
        stream.read_into(memoryview(data))
        acks.flush()  # replies stay in frame order
        self._reply(sock, self._control(kind, seq, tid, crc, data, peer, attempt))
        continue
      try:
        handle = sink.plane_lookup(tid)
      except TransferRefused as e:
        self.refused += 1
        stream.skip(length)
        acks.flush()
        self._reply(sock, frames.pack_reply(seq, frames.ERROR, e.code, e.message))
        continue
      try:
        if kind == frames.DESCRIPTOR:
          data = bytearray(length)
          stream.read_into(memoryview(data))
          sink.plane_descriptor(handle, layer, data.decode("utf-8", "replace"))
          reason = None
        else:
          data = buffers.payload_buffer(length)
          arrived_crc = stream.read_payload(memoryview(data))
          reason = (sink.plane_chunk(handle, layer, key, crc, data, arrived_crc)
                    if kind == frames.CHUNK
                    else sink.plane_bundle(handle, key, crc, data, arrived_crc))
      except TransferRefused as e:
        acks.flush()
        self._reply(sock, frames.pack_reply(seq, frames.ERROR, e.code, e.message))
        continue
      if reason is None:
        acks.add(seq, length)
      else:
        acks.flush()
        self._reply(sock, frames.pack_reply(seq, frames.NACK, Code.DATA_LOSS, reason))

  def _control(self, kind: int, seq: int, tid: str, crc: int, data: bytearray,
               peer: str, attempt: int) -> bytes:
    """The reply to a BEGIN / COMMIT frame (the connection stays usable)."""
    what = "BEGIN" if kind == frames.BEGIN else "COMMIT"
    if not self.control:
      return frames.pack_reply(seq, frames.ERROR, Code.UNIMPLEMENTED,
                               f"this receiver takes {what} on gRPC only")
    got = crc32c(data)
    if got != crc:
      # Not resent like a chunk: the sender fails the transfer with this status.
      return frames.pack_reply(seq, frames.ERROR, Code.DATA_LOSS,
                               f"{what} frame of transfer {tid}: crc32c mismatch (data has "
                               f"0x{got:08x}, frame says 0x{crc:08x})")
    try:
      body = (self.sink.plane_begin(bytes(data), peer, repeated=attempt > 0)
              if kind == frames.BEGIN
              else self.sink.plane_commit(bytes(data)))
      return frames.pack_result(seq, body)
    except TransferRefused as e:
      return frames.pack_reply(seq, frames.ERROR, e.code, e.message)

  def _reply(self, sock, reply: bytes) -> None:
    sock.sendall(reply)
    self.replies_total += 1


class _AckRun:
  """Frames stored but not yet acknowledged on one connection: one ACKS reply
  covers them all (in order, so the highest sequence number says it all)."""

  def __init__(self, server: DataPlaneServer, sock):
    self.server, self.sock = server, sock
    self.poller = select.poll()
    self.poller.register(sock.fileno(), select.POLLIN)
    self.frames = 0
    self.nbytes = 0
    self.last_seq = 0

  def add(self, seq: int, nbytes: int) -> None:
    self.frames += 1
    self.nbytes += nbytes
    self.last_seq = seq
    if self.frames >= frames.ACK_EVERY_FRAMES or self.nbytes >= frames.ACK_EVERY_BYTES:
      self.flush()

  def flush(self) -> None:
    if self.frames:
      self.frames = self.nbytes = 0
      self.server._reply(self.sock, frames.pack_reply(self.last_seq, frames.ACKS))


def _peer(addr) -> str:
  """gRPC's peer notation for a data-plane sender (``TransferInfo.peer``)."""
  host, port = addr[0], addr[1]
  return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
