"""Receive buffers of the data plane (paas_jax.transport.dataplane.buffers):
payloads read piece by piece with the crc32c computed as they arrive, into
uninitialised memory, over real sockets and a real StateReceiver."""

from __future__ import annotations

import os
import socket
import threading

import grpc
import pytest

from paas_jax import codec
from paas_jax.codec.store import crc32c
from paas_jax.codec.testing import assert_states_match, random_state
from paas_jax.state import abstract_state
from paas_jax.transport import (ReceiverOptions, SenderOptions, StateReceiver, StateSender,
                                TransferError, serve_receiver)
from paas_jax.transport.dataplane import buffers, frames
from tests.transport.dataplane_rig import STREAMED

TOKENS = 4000
CAPACITY = 4096
# Receiver pieces in these tests (the default is larger than this state's
# objects): chunks of 512 KiB are then each read in two pieces.
PIECE_BYTES = 256 << 10
BIG_CHUNKS = codec.CodecOptions(chunk_bytes=1 << 20)


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
  monkeypatch.setattr(buffers, "CRC_PIECE_BYTES", PIECE_BYTES)


def _pair_send(payload: bytes, sizes):
  """A socketpair whose writer thread sends ``payload`` in writes of ``sizes``
  (cycled), then closes; returns the reading end."""
  reader, writer = socket.socketpair()

  def write():
    with writer:
      i = n = 0
      while n < len(payload):
        step = sizes[i % len(sizes)]
        writer.sendall(payload[n:n + step])
        n += step
        i += 1

  threading.Thread(target=write, daemon=True).start()
  return reader


@pytest.mark.parametrize("waitall", [True, False])
@pytest.mark.parametrize("nbytes", [1, PIECE_BYTES, 3 * PIECE_BYTES + 7])
def test_recv_payload_fills_the_buffer_and_returns_its_crc(nbytes, waitall):
  payload = os.urandom(nbytes)
  with _pair_send(payload, [1000, 70001, 3]) as reader:
    data = buffers.payload_buffer(nbytes)
    got = buffers.recv_payload(reader, memoryview(data), waitall)
  assert bytes(data) == payload
  assert got == crc32c(payload)
  # Negative control: the same check on a payload damaged in its last piece.
  damaged = bytearray(payload)
  damaged[-1] ^= 0x01
  assert crc32c(damaged) != got


def test_recv_payload_eof_names_how_far_it_got():
  with _pair_send(os.urandom(1000), [1000]) as reader:
    with pytest.raises(frames.PeerClosed, match="after 1000 of 5000 bytes"):
      buffers.recv_payload(reader, memoryview(bytearray(5000)), True)


def test_payload_buffers_small_ones_stay_bytearray():
  small = buffers.payload_buffer(buffers.LARGE_PAYLOAD_BYTES - 1)
  large = buffers.payload_buffer(buffers.LARGE_PAYLOAD_BYTES)
  assert isinstance(small, bytearray) and len(small) == buffers.LARGE_PAYLOAD_BYTES - 1
  assert isinstance(large, memoryview) and large.nbytes == buffers.LARGE_PAYLOAD_BYTES
  assert large.format == "B" and not large.readonly


def test_retain_freed_memory_is_idempotent():
  first = buffers.retain_freed_memory()
  assert buffers.retain_freed_memory() == first
  try:
    libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
  except (ValueError, OSError):
    libc = ""
  if libc.startswith("glibc"):
    assert first


@pytest.fixture(scope="module")
def state(config):
  return random_state(config, [TOKENS], capacity=CAPACITY, seed=11)


@pytest.fixture
def rx(config):
  receiver = StateReceiver(models={config.name: config.fingerprint()},
                           template=lambda info: (abstract_state(config, 1, CAPACITY), None),
                           options=ReceiverOptions())
  server = serve_receiver(receiver, data_plane=True)
  yield server
  server.stop(0)


def _send(sender, config, state, options):
  return sender.send_state(state, model_id=config.name, config_fingerprint=config.fingerprint(),
                           codec=options)


@pytest.mark.parametrize("streamed", [True, False], ids=["frames", "bundle"])
@pytest.mark.parametrize("options", [BIG_CHUNKS,
                                     codec.CodecOptions(chunk_bytes=1 << 20, compression="zstd")],
                         ids=["raw", "zstd"])
def test_large_objects_restore_exactly(config, state, rx, options, streamed):
  """Objects past LARGE_PAYLOAD_BYTES land in the uninitialised buffers (one
  per object, or one per BUNDLE whose objects are views of it); zstd sends
  them through TensorStore, which takes bytes (store._ts_value)."""
  kw = STREAMED if streamed else {"bundle_bytes": 6 << 20}  # this state: ~1 MB
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=2, **kw)) as sender:
    result = _send(sender, config, state, options)
  sizes = [c.nbytes for g in result.manifest.groups for _, c in g.chunks()]
  assert max(sizes) > buffers.CRC_PIECE_BYTES
  # The bundle variant really was one frame (the per-frame path: one per object).
  assert (rx.data_plane.frames_total == 1) != streamed
  received = rx.receiver.ready.get(timeout=30)
  assert_states_match(state, received.state, TOKENS)
  received.release()


def test_damage_in_a_later_piece_is_caught_and_resent(config, state, rx):
  """The crc is extended over every piece: one flipped byte past the first
  piece of a large object is a crc32c mismatch (resent once, then restored
  exactly); flipped on every attempt it fails the transfer with DATA_LOSS."""
  damaged = []

  def flip(always):
    def hook(lane, item, payload):
      if item.is_chunk and item.nbytes > buffers.CRC_PIECE_BYTES and (always or not damaged):
        damaged.append(item.key)
        bad = bytearray(payload)
        bad[buffers.CRC_PIECE_BYTES + 5] ^= 0xFF
        return memoryview(bad)
      return payload
    return hook

  # The per-frame path (this state is small enough to go as one BUNDLE otherwise).
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1, **STREAMED)) as sender:
    _send(sender, config, state, BIG_CHUNKS)  # opens the connection to hook
    rx.receiver.ready.get(timeout=30).release()
    for pool in sender.data_planes:
      for lane in pool.lanes():
        lane._fault_hook = flip(always=False)
    result = _send(sender, config, state, BIG_CHUNKS)
    assert len(damaged) == 1 and result.timeline.resent_chunks == 1
    received = rx.receiver.ready.get(timeout=30)
    assert received.timeline.rejected_chunks == 1
    assert_states_match(state, received.state, TOKENS)
    received.release()

    for pool in sender.data_planes:
      for lane in pool.lanes():
        lane._fault_hook = flip(always=True)
    with pytest.raises(TransferError) as e:
      _send(sender, config, state, BIG_CHUNKS)
  assert e.value.code == grpc.StatusCode.DATA_LOSS
  assert "crc32c" in e.value.message
  assert any(f"chunk '{key}'" in e.value.message for key in damaged)
  assert rx.receiver.ready.empty()
