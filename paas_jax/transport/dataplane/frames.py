"""Wire format of the TCP data plane: length-prefixed frames and replies.

Sender -> receiver, one frame::

  FRAME header (40 bytes, little endian)
    magic  b"PJDP"    version u8   kind u8 (CHUNK | DESCRIPTOR | BEGIN | COMMIT | BUNDLE)
    tid_len u16
    seq    u32        (per connection; echoed by the reply)
    layer  i32        (-1: state-level arrays)
    crc32c u32        (of the payload; 0 for descriptors)
    key_len u32       length u64 (payload bytes)   attempt u32
  transfer id (tid_len bytes, utf-8) | object key (key_len bytes, utf-8) | payload

A CHUNK's payload is one stored object (a zarr3 chunk or metadata blob); a
DESCRIPTOR's is the layer's ``LayerEntry`` JSON. BEGIN and COMMIT carry the
serialized ``BeginRequest`` / ``CommitRequest`` of the gRPC control protocol
(crc32c of the payload in the header), so that a sender holding long-lived
connections opens and commits a transfer without a gRPC round trip; only a
receiver that announced ``BeginResponse.data_plane_control`` accepts them.
A BUNDLE carries several groups at once, descriptors and objects (a small
state in one frame; payload layout in ``bundle.py``, crc32c of the payload in
the header, key: what it holds, for messages); it is acknowledged, NACKed and
resent as one frame.
Receiver -> sender, in frame order::

  REPLY header (16 bytes): magic b"PJDR" | seq u32 | code u16 | kind u8 | pad u8 |
                           msg_len u32, then msg_len bytes

``code`` is a gRPC status code value; kind
  ACKS   every frame up to and including ``seq`` is stored (or already held):
         one cumulative reply for a run of frames (the receiver sends it when
         its input runs dry or ``ACK_EVERY_*`` is reached);
  ACK    that one frame is stored;
  NACK   the frame was read but rejected (e.g. a crc32c mismatch: ``msg``
         names the layer and chunk; resend it);
  RESULT the control frame succeeded; ``msg`` is the serialized
         ``BeginResponse`` / ``CommitResponse`` (binary, up to MAX_RESULT_BYTES);
  ERROR  ``code`` says why (utf-8 ``msg``): the transfer failed, or the
         connection broke the protocol and is closed after the reply.
"""

from __future__ import annotations

import socket
import struct

import grpc

MAGIC = b"PJDP"
REPLY_MAGIC = b"PJDR"
VERSION = 2  # 2: BEGIN / COMMIT frames, ACKS and RESULT replies

CHUNK = 1
DESCRIPTOR = 2
BEGIN = 3
COMMIT = 4
BUNDLE = 5  # receivers before it refuse the kind (INVALID_ARGUMENT): SenderOptions.bundle_bytes=0
KINDS = (CHUNK, DESCRIPTOR, BEGIN, COMMIT, BUNDLE)
CONTROL_KINDS = (BEGIN, COMMIT)

ACK = 1
NACK = 2
ERROR = 3
RESULT = 4
ACKS = 5
REPLY_KINDS = (ACK, NACK, ERROR, RESULT, ACKS)

# The receiver acknowledges a run of frames with one ACKS reply when its input
# runs dry, or after this many frames / payload bytes (so that the sender's
# window keeps sliding while frames stream in back to back).
ACK_EVERY_FRAMES = 64
ACK_EVERY_BYTES = 256 << 10

HEADER = struct.Struct("<4sBBHIiIIQI")
REPLY = struct.Struct("<4sIHBBI")
MAX_TID_BYTES = 256
MAX_KEY_BYTES = 4096
MAX_REPLY_MESSAGE = 64 << 10
MAX_RESULT_BYTES = 16 << 20

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
  return _CODES.get(int(value), grpc.StatusCode.UNKNOWN)


class ProtocolError(Exception):
  """The peer broke the wire format; ``code`` is the gRPC status to report."""

  def __init__(self, code: grpc.StatusCode, message: str):
    self.code, self.message = code, message
    super().__init__(f"{code.name}: {message}")


class PeerClosed(ConnectionError):
  """The connection ended (EOF) before a whole header or payload arrived."""


def pack_header(kind: int, seq: int, tid: bytes, layer: int, key: bytes, crc: int,
                length: int, attempt: int = 0) -> bytes:
  """The header plus transfer id and key: one small buffer before the payload."""
  return HEADER.pack(MAGIC, VERSION, kind, len(tid), seq, layer, crc, len(key), length,
                     attempt) + tid + key


def parse_header(raw) -> tuple[int, int, int, int, int, int, int, int]:
  """(kind, seq, tid_len, layer, crc, key_len, length, attempt) of a header.

  Raises:
    ProtocolError: wrong magic or version, unknown kind, oversize id or key.
  """
  magic, version, kind, tid_len, seq, layer, crc, key_len, length, attempt = HEADER.unpack(raw)
  if magic != MAGIC:
    raise ProtocolError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"not a data-plane frame (magic {bytes(magic)!r})")
  if version != VERSION:
    raise ProtocolError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"data-plane version {version}, this receiver speaks {VERSION}")
  if kind not in KINDS:
    raise ProtocolError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {kind}")
  if not 0 < tid_len <= MAX_TID_BYTES or key_len > MAX_KEY_BYTES:
    raise ProtocolError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"frame header: transfer id of {tid_len} bytes or key of {key_len} "
                        f"bytes (limits {MAX_TID_BYTES}, {MAX_KEY_BYTES})")
  return kind, seq, tid_len, layer, crc, key_len, length, attempt


def pack_reply(seq: int, kind: int, code: grpc.StatusCode = grpc.StatusCode.OK,
               message: str = "") -> bytes:
  text = message.encode("utf-8", "replace")[:MAX_REPLY_MESSAGE]
  return REPLY.pack(REPLY_MAGIC, seq, code.value[0], kind, 0, len(text)) + text


def pack_result(seq: int, body: bytes) -> bytes:
  """A RESULT reply: ``body`` is a serialized response message."""
  if len(body) > MAX_RESULT_BYTES:
    raise ValueError(f"control result of {len(body)} bytes exceeds {MAX_RESULT_BYTES}")
  return REPLY.pack(REPLY_MAGIC, seq, grpc.StatusCode.OK.value[0], RESULT, 0, len(body)) + body


def reply_body_limit(kind: int) -> int:
  return MAX_RESULT_BYTES if kind == RESULT else MAX_REPLY_MESSAGE


def recv_exact(sock: socket.socket, view: memoryview, waitall: bool) -> None:
  """Fills ``view`` from ``sock`` (``recv_into``, no intermediate buffer).

  ``waitall``: plain sockets take MSG_WAITALL (one syscall for a whole
  payload); TLS sockets do not support flags and loop.

  Raises:
    PeerClosed: EOF first.
  """
  n, total = 0, len(view)
  flags = socket.MSG_WAITALL if waitall else 0
  while n < total:
    got = sock.recv_into(view[n:], total - n, flags) if flags else sock.recv_into(view[n:])
    if got == 0:
      raise PeerClosed(f"connection closed after {n} of {total} bytes")
    n += got


def read_reply(sock: socket.socket, waitall: bool) -> tuple[int, int, grpc.StatusCode, str]:
  """(seq, kind, code, message) of the next reply."""
  raw = bytearray(REPLY.size)
  recv_exact(sock, memoryview(raw), waitall)
  magic, seq, code, kind, _, msg_len = REPLY.unpack(raw)
  if magic != REPLY_MAGIC or kind not in REPLY_KINDS or msg_len > reply_body_limit(kind):
    raise ProtocolError(grpc.StatusCode.INTERNAL, "malformed reply from the data-plane receiver")
  text = bytearray(msg_len)
  if msg_len:
    recv_exact(sock, memoryview(text), waitall)
  return seq, kind, status_code(code), text.decode("utf-8", "replace")
