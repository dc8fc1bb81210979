"""Peer roles on a real decode-side StateReceiver behind mutual TLS: only prefill
servers may push states; everyone else is refused before any state is taken."""

from __future__ import annotations

import grpc
import pytest

from paas_jax import codec
from paas_jax.codec.testing import assert_states_match, random_state
from paas_jax.models import load_config
from paas_jax.proto import serving_pb2, serving_pb2_grpc, transport_pb2_grpc
from paas_jax.security import PeerIdentityInterceptor, service_rules, tls
from paas_jax.state import abstract_state
from paas_jax.transport import SenderOptions, StateReceiver, StateSender, TransferError
from tests.security.conftest import health_check

N = 24


@pytest.fixture(scope="module")
def config():
  return load_config("tiny_gdn_gqa")


@pytest.fixture
def decode_rx(config, pki, serve):
  """A StateReceiver on an mTLS port with the decode role's peer rules."""
  refusals = []
  receiver = StateReceiver(models={config.name: config.fingerprint()},
                           template=lambda info: (abstract_state(config, 1, 64), None))
  peers = PeerIdentityInterceptor(service_rules("decode"),
                                  on_result=lambda m, ok, names: refusals.append((ok, names)))
  s = serve(lambda srv: transport_pb2_grpc.add_StateTransferServicer_to_server(receiver, srv),
            credentials=pki.tls("decode-0").server(), interceptors=[peers])
  s.receiver, s.refusals = receiver, refusals
  yield s
  receiver.close()


def send(config, target, creds, state):
  options = SenderOptions(num_streams=2, credentials=creds, rpc_timeout_s=5)
  with StateSender(target, options=options) as sender:
    return sender.send_state(state, model_id=config.name, config_fingerprint=config.fingerprint(),
                             codec=codec.CodecOptions(chunk_bytes=4096))


def test_prefill_server_pushes_a_state_over_mtls(config, pki, decode_rx):
  state = random_state(config, [N], capacity=64, seed=3)
  result = send(config, decode_rx.target, pki.tls("prefill-0").client(), state)
  received = decode_rx.receiver.ready.get(timeout=10)
  assert received.info.transfer_id == result.transfer_id
  assert_states_match(state, received.state, N)
  assert all(ok for ok, _ in decode_rx.refusals)
  assert "prefill-0" in decode_rx.refusals[0][1]


@pytest.mark.parametrize("who,code", [
    ("broker", grpc.StatusCode.PERMISSION_DENIED),   # our CA, wrong role
    ("client", grpc.StatusCode.PERMISSION_DENIED),
    ("rogue", grpc.StatusCode.UNAVAILABLE),          # another CA: TLS handshake fails
    ("no_cert", grpc.StatusCode.UNAVAILABLE),
])
def test_decode_refuses_states_from_peers_that_do_not_belong(config, pki, decode_rx, who, code):
  if who == "rogue":
    f = pki.rogue["prefill-0"]
    creds = tls.channel_credentials(pki.files["client"].ca, f.cert, f.key)
  elif who == "no_cert":
    creds = tls.channel_credentials(pki.files["client"].ca)
  else:
    creds = pki.tls(who).client()
  state = random_state(config, [N], capacity=64, seed=4)
  with pytest.raises(TransferError) as e:
    send(config, decode_rx.target, creds, state)
  assert e.value.code == code
  assert decode_rx.receiver.active_transfers() == []
  assert decode_rx.receiver.bytes_in_use == 0
  assert decode_rx.receiver.ready.empty()
  if code == grpc.StatusCode.PERMISSION_DENIED:
    assert decode_rx.refusals == [(False, [who, who])]  # CN and URI SAN
  else:
    assert decode_rx.refusals == []  # never reached the application


def test_plaintext_port_with_peer_rules_is_unauthenticated(config, serve):
  receiver = StateReceiver(models={config.name: config.fingerprint()})
  s = serve(lambda srv: transport_pb2_grpc.add_StateTransferServicer_to_server(receiver, srv),
            interceptors=[PeerIdentityInterceptor(service_rules("decode"))])
  try:
    with pytest.raises(TransferError) as e:
      send(config, s.target, None, random_state(config, [N], capacity=64))
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert receiver.active_transfers() == []
    with grpc.insecure_channel(s.target) as ch:
      assert health_check(ch).status == 1  # health stays open for probes
  finally:
    receiver.close()


class _Decode(serving_pb2_grpc.DecodeServicer):

  def GetStats(self, request, context):
    return serving_pb2.StatsResponse(server="decode")


def test_rules_pick_the_longest_prefix_and_cover_control_calls(pki, serve):
  rules = service_rules("decode")
  interceptor = PeerIdentityInterceptor(rules, default=[])
  assert interceptor.patterns_for("/paas_jax.serving.v1.Decode/GetStats") == ("broker*",)
  assert interceptor.patterns_for("/some.Other/Method") == ()
  s = serve(lambda srv: serving_pb2_grpc.add_DecodeServicer_to_server(_Decode(), srv),
            credentials=pki.tls("decode-0").server(), interceptors=[interceptor])
  for who, ok in (("broker", True), ("prefill-0", False)):
    with grpc.secure_channel(s.target, pki.tls(who).client()) as ch:
      stub = serving_pb2_grpc.DecodeStub(ch)
      if ok:
        assert stub.GetStats(serving_pb2.StatsRequest(), timeout=5).server == "decode"
      else:
        with pytest.raises(grpc.RpcError) as e:
          stub.GetStats(serving_pb2.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "prefill-0" in e.value.details()
  with pytest.raises(ValueError):
    service_rules("gateway")
