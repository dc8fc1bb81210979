"""A gRPC StateTransfer receiver refuses what it must not take: damaged,
misplaced or unlisted chunks, another model, a repeated transfer id, a transfer
over its byte budget; nothing of a refused transfer is kept."""

from __future__ import annotations

import grpc
import pytest

from paas_jax import codec
from paas_jax.codec.testing import random_state
from paas_jax.proto import transport_pb2
from paas_jax.transport import StateSender, TransferError
from tests.transport.grpc_rig import (N, begin, chunk_frame, encoded_layers, raw_begin, raw_stub,
                                      wait_for, with_end)


@pytest.fixture(scope="module")
def state(config):
  return random_state(config, [N], capacity=64, seed=1)


def test_receiver_rejects_bad_chunks_and_lists_missing(config, state, make_rx):
  rx = make_rx()
  channel, stub = raw_stub(rx.target)
  tid = "raw-1"
  raw_begin(stub, config, tid)
  group = encoded_layers(state)[0]
  key, data = next((k, v) for k, v in group.blobs.items() if "/c/" in k)
  frames = [
      transport_pb2.Frame(layer=transport_pb2.LayerDescriptor(
          transfer_id=tid, layer_index=0, layer_json=group.entry.to_json())),
      chunk_frame(tid, 0, key, data[:-5], crc=codec.crc32c(data), nbytes=len(data)),
      chunk_frame(tid, 0, key.replace("layers/0", "layers/1"), data, ),
      chunk_frame(tid, 0, "layers/0/k/c/9/9/9/9", data),
  ]
  summary = stub.Push(iter(with_end(frames)), timeout=5)
  reasons = {r.key: r.reason for r in summary.rejected}
  assert reasons[key] == f"truncated: {len(data) - 5} of {len(data)} bytes"
  assert "not under layers/0/" in reasons[key.replace("layers/0", "layers/1")]
  assert reasons["layers/0/k/c/9/9/9/9"] == "not listed in the layer descriptor"
  assert summary.chunks == 0

  manifest = codec.build_manifest(
      [g.entry for g in encoded_layers(state)] + [codec.encode_state_arrays(
          [("lengths", state.lengths)]).entry],
      model_id=config.name, config_fingerprint=config.fingerprint(), token_count=N, batch=1,
      options=codec.CodecOptions())
  response = stub.Commit(transport_pb2.CommitRequest(transfer_id=tid,
                                                     manifest_json=manifest.to_json()),
                         timeout=5)
  assert not response.complete
  assert {m.key for m in response.missing} == set(manifest.chunk_index())
  assert rx.receiver.ready.empty()
  assert stub.Abort(transport_pb2.AbortRequest(transfer_id=tid), timeout=5).existed
  rx.assert_clean()
  with pytest.raises(grpc.RpcError) as info:
    stub.Commit(transport_pb2.CommitRequest(transfer_id=tid, manifest_json="{}"), timeout=5)
  assert info.value.code() == grpc.StatusCode.CANCELLED
  channel.close()


def test_model_identity_checks(config, state, make_rx):
  rx = make_rx()
  with StateSender(rx.target) as sender:
    with pytest.raises(TransferError) as info:
      sender.begin(model_id=config.name, config_fingerprint="0" * 16, num_layers=4,
                   lengths=[N])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert config.fingerprint() in info.value.message and "0" * 16 in info.value.message
    with pytest.raises(TransferError) as info:
      sender.begin(model_id="dense_100m", config_fingerprint=config.fingerprint(),
                   num_layers=4, lengths=[N])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(TransferError) as info:
      sender.begin(model_id=config.name, config_fingerprint=config.fingerprint(),
                   num_layers=7, lengths=[N])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
  rx.assert_clean()


def test_duplicate_transfer_id(config, make_rx):
  rx = make_rx()
  channel, stub = raw_stub(rx.target)
  raw_begin(stub, config, "dup")
  with pytest.raises(grpc.RpcError) as info:
    raw_begin(stub, config, "dup")
  assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
  channel.close()


def test_byte_budget(config, state, make_rx):
  rx = make_rx(byte_budget=20_000)
  with StateSender(rx.target) as sender:
    with pytest.raises(TransferError) as info:
      begin(sender, config, reserve_bytes=50_000)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    rx.assert_clean()
    # No reservation: the budget runs out while chunks arrive (the state is ~30 kB).
    with pytest.raises(TransferError) as info:
      with begin(sender, config) as tx:
        tx.send_layers(enumerate(state.layers))
        tx.finish()
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "budget" in info.value.message
  assert wait_for(lambda: rx.failures)
  assert rx.failures[0][1] == grpc.StatusCode.RESOURCE_EXHAUSTED
  rx.assert_clean()
