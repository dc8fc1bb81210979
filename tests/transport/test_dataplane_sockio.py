"""Plain data-plane sockets: blocking, with the kernel's timeouts (sockio).

A Python socket timeout makes the socket non-blocking underneath and polls
before every call; the lane's plain sockets instead block in the kernel, and
``SO_SNDTIMEO``/``SO_RCVTIMEO`` bound each call, so a large write is one
``sendmsg`` and a stalled peer still returns control every ``timeout_s``.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from paas_jax.transport.dataplane import sockio

TIMEOUT_S = 0.2
PAYLOAD_BYTES = 8 << 20


@pytest.fixture
def pair():
  a, b = socket.socketpair()
  # Small buffers: the payload cannot fit them, so a write must wait for the reader.
  for s in (a, b):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
  yield a, b
  a.close()
  b.close()


def _drain(sock: socket.socket, nbytes: int, out: list) -> threading.Thread:
  def run():
    got, buf = 0, bytearray(1 << 20)
    while got < nbytes:
      n = sock.recv_into(buf)
      if not n:
        break
      got += n
    out.append(got)
  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread


def test_a_large_write_is_one_call_while_the_reader_keeps_up(pair):
  writer, reader = pair
  io = sockio.LaneSocket(writer, TIMEOUT_S)
  assert writer.gettimeout() is None  # blocking: no poll before each call
  payload = memoryview(bytes(PAYLOAD_BYTES))
  got: list = []
  thread = _drain(reader, PAYLOAD_BYTES, got)
  assert io.send([payload[:1 << 20], payload[1 << 20:]]) == PAYLOAD_BYTES
  thread.join(10)
  assert got == [PAYLOAD_BYTES]


def test_negative_control_a_python_timeout_writes_a_buffer_at_a_time(pair):
  """What the kernel timeouts replace: with a Python timeout, one sendmsg
  returns after what the socket buffer took."""
  writer, reader = pair
  writer.settimeout(TIMEOUT_S)
  got: list = []
  thread = _drain(reader, PAYLOAD_BYTES, got)
  first = writer.sendmsg([memoryview(bytes(PAYLOAD_BYTES))])
  assert 0 < first < PAYLOAD_BYTES
  writer.sendall(memoryview(bytes(PAYLOAD_BYTES - first)))
  thread.join(10)


def test_a_stalled_peer_returns_control_every_timeout(pair):
  writer, reader = pair
  io = sockio.LaneSocket(writer, TIMEOUT_S)
  t0 = time.monotonic()
  assert io.recv_into(memoryview(bytearray(16))) is None  # nothing to read
  waited = time.monotonic() - t0
  assert TIMEOUT_S * 0.5 <= waited < TIMEOUT_S * 10
  # Nobody reads: the first call fills the buffers and returns a partial
  # count when the timeout ends it; the next one takes nothing (0).
  payload = memoryview(bytes(PAYLOAD_BYTES))
  sent = io.send([payload])
  assert 0 < sent < PAYLOAD_BYTES
  assert io.send([payload[sent:]]) == 0
  # And the bytes that went are intact and in order on the other side.
  reader.setblocking(False)
  drained = 0
  while True:
    try:
      n = len(reader.recv(1 << 20))
    except BlockingIOError:
      break
    drained += n
  assert drained == sent


def test_negative_control_without_the_kernel_timeout_a_read_blocks(pair):
  """The bound comes from SO_RCVTIMEO: a blocking socket without it is still
  waiting after many timeouts' worth of time."""
  writer, reader = pair
  done = threading.Event()

  def read():
    try:
      writer.recv(16)
    except OSError:
      pass
    done.set()

  threading.Thread(target=read, daemon=True).start()
  assert not done.wait(TIMEOUT_S * 5)
  sockio.shutdown(writer)  # releases the reader
  assert done.wait(5)
