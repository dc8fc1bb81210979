"""TLS data-plane connections used by two threads (a lane's writer and reader):
OpenSSL calls are serialised, shutdown keeps the TLS state, sockets are closed
only once their threads ended. Real mTLS sockets throughout.

This was an intermittent CI failure ("malformed reply from the receiver") and,
when looped, a heap corruption, stolen bytes of gRPC connections and of files
the process opened (PEM files read back empty)."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import grpc
import pytest

from paas_jax.codec.testing import assert_states_match, random_state
from paas_jax.models import load_config
from paas_jax.security import ca as ca_lib
from paas_jax.security.tls import TLSConfig
from paas_jax.state import abstract_state
from paas_jax.transport import (SenderOptions, StateReceiver, StateSender, TransferError,
                                serve_receiver)
from paas_jax.transport.dataplane import frames, sockio, tls as dp_tls
from paas_jax.transport.dataplane.tuning import Tuning

N = 50


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
  files = ca_lib.make_certs(tmp_path_factory.mktemp("pki"), ("prefill-0", "decode-0",
                                                             "broker-0"))
  return {n: TLSConfig.from_files(f) for n, f in files.items()}


def _overlap_detector():
  """An SSLSocket class counting how many threads are inside send/recv_into of
  one connection at once (``peak``: the most over all its connections); each
  call lingers a little so that an overlap cannot slip through."""

  class Detecting(ssl.SSLSocket):
    peak = 0
    calls = 0
    guard = threading.Lock()
    inside: dict[int, int] = {}

    def _enter(self):
      cls = type(self)
      with cls.guard:
        now = cls.inside[id(self)] = cls.inside.get(id(self), 0) + 1
        cls.calls += 1
        cls.peak = max(cls.peak, now)
      time.sleep(0.0005)

    def _exit(self):
      with type(self).guard:
        type(self).inside[id(self)] -= 1

    def send(self, data, flags=0):
      self._enter()
      try:
        return super().send(data, flags)
      finally:
        self._exit()

    def recv_into(self, buffer, nbytes=None, flags=0):
      self._enter()
      try:
        return super().recv_into(buffer, nbytes, flags)
      finally:
        self._exit()

  return Detecting


def _tls_pair(tls_files, client_class=None):
  """(client SSLSocket, server SSLSocket) connected over loopback."""
  server_ctx = dp_tls.server_context(tls_files["decode-0"])
  client_ctx = dp_tls.client_context(tls_files["prefill-0"])
  if client_class is not None:
    client_ctx.sslsocket_class = client_class
  listener = socket.create_server(("127.0.0.1", 0))
  accepted = {}

  def accept():
    raw, _ = listener.accept()
    accepted["sock"] = server_ctx.wrap_socket(raw, server_side=True)

  t = threading.Thread(target=accept)
  t.start()
  raw = socket.create_connection(listener.getsockname(), timeout=5)
  client = client_ctx.wrap_socket(raw, server_hostname="127.0.0.1")
  t.join(5)
  listener.close()
  return client, accepted["sock"]


def _read_all(io: sockio.LaneSocket, n: int, timeout: float = 5.0) -> bytes:
  buf = bytearray(n)
  got, end = 0, time.monotonic() + timeout
  while got < n and time.monotonic() < end:
    r = io.recv_into(memoryview(buf)[got:])
    if r == 0:
      break
    got += r or 0
  return bytes(buf[:got])


def _echo_replies(server: ssl.SSLSocket, total: int) -> None:
  """Reads ``total`` bytes and answers every 64 KiB with one reply."""
  buf = bytearray(64 << 10)
  seen = 0
  while seen < total:
    n = server.recv_into(buf)
    if not n:
      return
    before, seen = seen, seen + n
    for _ in range(seen // len(buf) - before // len(buf)):
      server.sendall(frames.pack_reply(0, frames.ACK))


def _write_and_read_concurrently(send, recv_into, total: int, replies: int) -> None:
  payload = memoryview(bytearray(256 << 10))
  errors = []

  def write():
    try:
      left = total
      while left:
        view = payload[:min(left, len(payload))]
        while len(view):
          view = view[send(view):]
        left -= len(payload[:min(left, len(payload))])
    except Exception as e:  # reported below
      errors.append(e)

  writer = threading.Thread(target=write)
  writer.start()
  head = bytearray(frames.REPLY.size * replies)
  got = 0
  end = time.monotonic() + 30
  while got < len(head) and time.monotonic() < end:
    got += recv_into(memoryview(head)[got:]) or 0
  writer.join(30)
  assert not errors and got == len(head)
  for i in range(replies):
    assert head[i * frames.REPLY.size:][:4] == frames.REPLY_MAGIC


def test_tls_calls_are_serialised_between_writer_and_reader(tls_files):
  total = 4 << 20
  replies = total // (64 << 10)
  detecting = _overlap_detector()
  client, server = _tls_pair(tls_files, detecting)
  echo = threading.Thread(target=_echo_replies, args=(server, total))
  echo.start()
  io = sockio.LaneSocket(client, timeout_s=0.2)
  _write_and_read_concurrently(lambda v: io.send([v]), io.recv_into, total, replies)
  echo.join(10)
  assert detecting.calls > replies and detecting.peak == 1
  io.close()
  server.close()

  # Negative control: the same two threads calling the SSLSocket directly (as
  # the lanes did) are inside OpenSSL at the same time; the detector sees it.
  unsafe = _overlap_detector()
  client, server = _tls_pair(tls_files, unsafe)
  client.settimeout(0.2)
  echo = threading.Thread(target=_echo_replies, args=(server, total))
  echo.start()

  def recv_into(view):
    try:
      return client.recv_into(view)
    except socket.timeout:
      return 0

  _write_and_read_concurrently(client.send, recv_into, total, replies)
  echo.join(10)
  assert unsafe.peak == 2
  client.close()
  server.close()


def test_shutdown_keeps_tls_so_the_reply_is_still_read(tls_files):
  """A writer that fails half-closes so the reader can still find the receiver's
  reply (e.g. PERMISSION_DENIED): that reply must be decrypted, not raw."""
  reply = frames.pack_reply(0, frames.ERROR, grpc.StatusCode.PERMISSION_DENIED, "no")
  client, server = _tls_pair(tls_files)
  io = sockio.LaneSocket(client, timeout_s=0.2)
  server.sendall(reply)
  io.shutdown(socket.SHUT_WR)
  assert _read_all(io, len(reply)) == reply
  io.close()
  server.close()

  # Negative control: SSLSocket.shutdown drops the TLS state, and what is read
  # afterwards is ciphertext: the "malformed reply" of the flaky CI run.
  client, server = _tls_pair(tls_files)
  server.sendall(reply)
  time.sleep(0.2)
  client.shutdown(socket.SHUT_WR)
  raw = client.recv(len(reply))
  assert raw and raw[:4] != frames.REPLY_MAGIC
  client.close()
  server.close()


def test_tls_lanes_through_many_fresh_connections(config_and_state, tls_files):
  """The flaky test's sequence on fresh connections, many times: good sender,
  wrong-role sender; every outcome exact, every lane socket closed after."""
  config, state = config_and_state
  decode, prefill, broker = (tls_files[n] for n in ("decode-0", "prefill-0", "broker-0"))
  receiver = StateReceiver(models={config.name: config.fingerprint()},
                           template=lambda info: (abstract_state(config, 1, 128), None))
  server = serve_receiver(receiver, data_plane=True, credentials=decode.server(),
                          data_ssl=dp_tls.server_context(decode), data_peers=["prefill*"])
  detecting = _overlap_detector()

  def options(tls):
    ctx = dp_tls.client_context(tls)
    ctx.sslsocket_class = detecting
    return SenderOptions(plane="tcp", lanes=2, credentials=prefill.client(), data_ssl=ctx,
                         rpc_timeout_s=30, tuning=Tuning(connect_timeout_s=3))

  lanes = []
  try:
    for _ in range(12):
      with StateSender(server.target, options=options(prefill)) as sender:
        sender.send_state(state, model_id=config.name, config_fingerprint=config.fingerprint())
        lanes += [l for p in sender.data_planes for l in p.lanes()]
      assert_states_match(state, receiver.ready.get(timeout=10).state, N)
      with StateSender(server.target, options=options(broker)) as sender:
        with pytest.raises(TransferError) as e:
          sender.send_state(state, model_id=config.name,
                            config_fingerprint=config.fingerprint())
      assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "broker-0" in e.value.message
  finally:
    server.stop(0)
  assert detecting.calls > 0 and detecting.peak == 1
  # Closed only by the lane's last thread, and closed for sure.
  for lane in lanes:
    lane._writer.join(5)
    lane._reader.join(5)
    assert not lane._writer.is_alive() and not lane._reader.is_alive()
    assert lane.sock.fileno() == -1


@pytest.fixture(scope="module")
def config_and_state():
  config = load_config("tiny_gdn_gqa")
  return config, random_state(config, [N], capacity=64, seed=3)
