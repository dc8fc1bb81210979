"""Bearer tokens at the broker's public API, on a real broker servicer behind TLS."""

from __future__ import annotations

import logging

import grpc
import pytest

from paas_jax.models import load_config
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security import (BearerTokenInterceptor, SecurityConfigError, ServiceSecurity,
                               TokenSet, generate_token, read_token, tls, token_metadata)
from paas_jax.security.auth import TOKENS_ENV
from tests.security.conftest import health_check

ALICE = generate_token()
BOB = generate_token()


# -- the token set ----------------------------------------------------------------------

def test_token_file_and_env_parsing(tmp_path, monkeypatch):
  path = tmp_path / "tokens.txt"
  path.write_text(f"# accepted API tokens\nalice:{ALICE}\n\n{BOB}   # unnamed\n")
  tokens = TokenSet.from_file(path)
  assert len(tokens) == 2
  assert tokens.check_header([f"Bearer {ALICE}"]).principal == "alice"
  assert tokens.check_header([f"bearer {BOB}"]).principal == "token1"
  monkeypatch.setenv(TOKENS_ENV, f"alice:{ALICE}, {BOB}")
  assert len(TokenSet.load()) == 2
  assert len(TokenSet.load(path)) == 2
  (tmp_path / "empty.txt").write_text("# nothing\n")
  with pytest.raises(SecurityConfigError, match="no tokens"):
    TokenSet.from_file(tmp_path / "empty.txt")
  (tmp_path / "bad.txt").write_text("alice:short\n")
  with pytest.raises(SecurityConfigError, match="entry 1"):
    TokenSet.from_file(tmp_path / "bad.txt")
  with pytest.raises(SecurityConfigError, match="cannot read"):
    TokenSet.from_file(tmp_path / "missing.txt")
  monkeypatch.delenv(TOKENS_ENV)
  with pytest.raises(SecurityConfigError):
    TokenSet.from_env()
  with pytest.raises(SecurityConfigError):
    BearerTokenInterceptor(TokenSet())
  (tmp_path / "client.token").write_text(f"{ALICE}\n")
  assert read_token(tmp_path / "client.token") == ALICE
  monkeypatch.setenv("PAAS_JAX_API_TOKEN", BOB)
  assert read_token() == BOB


@pytest.mark.parametrize("values,code,reason", [
    ([], grpc.StatusCode.UNAUTHENTICATED, "missing"),
    ([f"Basic {ALICE}"], grpc.StatusCode.UNAUTHENTICATED, "malformed"),
    (["Bearer"], grpc.StatusCode.UNAUTHENTICATED, "malformed"),
    ([f"Bearer {ALICE} extra"], grpc.StatusCode.UNAUTHENTICATED, "malformed"),
    (["Bearer short"], grpc.StatusCode.UNAUTHENTICATED, "malformed"),
    (["Bearer " + "\u00e9" * 20], grpc.StatusCode.UNAUTHENTICATED, "malformed"),
    ([f"Bearer {ALICE}", f"Bearer {ALICE}"], grpc.StatusCode.UNAUTHENTICATED, "malformed"),
    ([f"Bearer {BOB}"], grpc.StatusCode.PERMISSION_DENIED, "wrong"),
    ([f"Bearer {ALICE[:-1]}"], grpc.StatusCode.PERMISSION_DENIED, "wrong"),
    ([f"Bearer {ALICE}"], None, "ok"),
])
def test_header_verdicts(values, code, reason):
  verdict = TokenSet([("alice", ALICE)]).check_header(values)
  assert (verdict.code, verdict.reason) == (code, reason)


def test_digests_only_are_kept():
  tokens = TokenSet([("alice", ALICE)])
  assert ALICE not in repr(vars(tokens))


# -- the broker's public API ----------------------------------------------------------

@pytest.fixture(scope="module")
def broker_config():
  return load_config("tiny_gdn_gqa")


@pytest.fixture
def broker(pki, serve, broker_config):
  """The real BrokerServicer behind server-only TLS and the token interceptor.
  Its regions point at a closed port: auth must decide before routing."""
  from paas_jax.serving.broker import BrokerServicer, DecodeTarget
  from paas_jax.serving.routing import StaticThresholdPolicy
  servicer = BrokerServicer(broker_config, StaticThresholdPolicy(128), prefill_targets=[],
                            decode_targets=[DecodeTarget("127.0.0.1:9", "127.0.0.1:9")])
  security = ServiceSecurity(tls=pki.tls("broker"), role="broker",
                             tokens=TokenSet([("alice", ALICE)]))
  assert security.interceptors()[0].__class__ is BearerTokenInterceptor
  # Public port: no client-cert rule for the API; only the operator method
  # (SetRoles) is guarded by a peer rule, which lets everything else through.
  extra = security.interceptors()[1:]
  assert [type(i).__name__ for i in extra] == ["PeerIdentityInterceptor"]
  assert extra[0].only_ruled and [p for p, _ in extra[0].rules] == [
      "/paas_jax.serving.v1.Broker/SetRoles"]
  return serve(lambda s: serving_pb2_grpc.add_BrokerServicer_to_server(servicer, s),
               credentials=security.server_credentials(),
               interceptors=security.interceptors())


def stats(channel, metadata=None):
  return serving_pb2_grpc.BrokerStub(channel).GetStats(serving_pb2.StatsRequest(), timeout=5,
                                                       metadata=metadata)


def test_valid_token_is_served(pki, broker):
  creds = tls.channel_credentials(pki.files["client"].ca, token=ALICE)
  with grpc.secure_channel(broker.target, creds) as ch:
    assert stats(ch).server == "broker"
    # Past auth the request reaches the broker's own validation.
    call = serving_pb2_grpc.BrokerStub(ch).Generate(
        serving_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=0), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
      list(call)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("metadata,code", [
    (None, grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Token abc"),), grpc.StatusCode.UNAUTHENTICATED),
    (token_metadata(BOB), grpc.StatusCode.PERMISSION_DENIED),
])
def test_missing_malformed_or_wrong_token_is_refused(pki, broker, metadata, code, caplog):
  with grpc.secure_channel(broker.target, tls.channel_credentials(pki.files["client"].ca)) as ch:
    with caplog.at_level(logging.WARNING, logger="paas_jax.security"):
      with pytest.raises(grpc.RpcError) as e:
        stats(ch, metadata)
      assert e.value.code() == code
      # Streaming calls are refused the same way, before the broker sees them.
      call = serving_pb2_grpc.BrokerStub(ch).Generate(
          serving_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=4), timeout=5,
          metadata=metadata)
      with pytest.raises(grpc.RpcError) as e:
        list(call)
      assert e.value.code() == code
    assert health_check(ch).status == 1  # probes need no token
  assert any("refused" in r.getMessage() for r in caplog.records)
  assert BOB not in caplog.text and ALICE not in caplog.text
