"""Chunk-pipelined transfer through the real servers (conftest's cluster: region A,
region B, the WAN relay and the broker as processes, prefix cache on in both
regions): every prefill chunk of a remote request reaches the decode server as
a segment, the decode server assembles the commit points, the broker learns the
last one, and the tokens equal single-process generation, also when region A's
prefix cache supplies the first chunks (cached blocks are sent as a segment)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.proto import serving_pb2, serving_pb2_grpc

PROMPT = 300  # chunks of 128: [0,128) [128,256) [256,300); commit every 2 -> 256, 300


def _prompt(length: int, salt: int) -> tuple[int, ...]:
  rng = np.random.default_rng(5000 + salt)
  return tuple(int(t) for t in rng.integers(0, 256, length))


def _decode_stats(cluster) -> dict:
  with grpc.insecure_channel(cluster.decode_address) as ch:
    r = serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(), timeout=10)
  return dict(r.gauges)


@pytest.fixture(scope="module")
def client(cluster):
  with BrokerClient(cluster.broker_address, timeout_s=120) as c:
    yield c


def test_remote_prefill_streams_every_chunk_and_is_token_exact(cluster, client, reference):
  prompt = _prompt(PROMPT, 1)
  before = _decode_stats(cluster)
  out = client.generate(prompt_ids=prompt, max_new_tokens=10, route="remote", seed=3,
                        temperature=0.8)
  assert out.route == "prfaas"
  assert out.tokens == reference(prompt, 10, 0.8, 0, 1.0, 3)
  assert out.summary["commit_point"] == PROMPT  # the broker learnt the last commit point
  after = _decode_stats(cluster)
  # Three chunks -> three segments, assembled into one state.
  assert after["segments_in"] - before["segments_in"] == 3
  assert after["transfers_in"] - before["transfers_in"] == 1
  assert after["segment_requests"] == 0  # nothing left behind once the state is in

  # Same first 256 tokens, another tail: region A's prefix cache holds them (its
  # chunk ends 128 and 256 went in), so they are restored, not recomputed, and
  # travel as one segment ahead of the computed chunk.
  prompt2 = prompt[:256] + _prompt(PROMPT - 256, 2)
  out2 = client.generate(prompt_ids=prompt2, max_new_tokens=10, route="remote")
  assert out2.route == "prfaas"
  assert out2.summary["cached_tokens"] == 256
  assert out2.tokens == reference(prompt2, 10)
  assert out2.summary["commit_point"] == PROMPT
  after2 = _decode_stats(cluster)
  assert after2["segments_in"] - after["segments_in"] == 2
  # Negative control: the reference of the other prompt differs, so the
  # equality above can fail.
  assert reference(prompt2, 10) != reference(prompt, 10)


def test_prefix_the_decode_node_holds_is_not_sent(cluster, client, reference, assert_logprobs):
  # The decode node prefilled a prompt locally (PD-P): its own prefix cache holds
  # the prompt's blocks. A remote request sharing that prefix registers with its
  # prompt, the decode node sets the prefix aside (held_tokens) and region A
  # sends only the rest; tokens and logprobs are those of single-process
  # generation. A remote request with a prefix nobody holds sends everything.
  prompt = _prompt(PROMPT, 11)
  out = client.generate(prompt_ids=prompt, max_new_tokens=2, route="local")
  assert out.route == "pdp"
  shared = prompt[:256] + _prompt(PROMPT - 256, 12)
  before = _decode_stats(cluster)
  out = client.generate(prompt_ids=shared, max_new_tokens=8, route="remote", logprobs=True,
                        top_logprobs=2)
  after = _decode_stats(cluster)
  held = after["held_tokens"] - before["held_tokens"]
  assert out.route == "prfaas" and out.summary["commit_point"] == PROMPT
  assert held >= 128 and held % 64 == 0, held
  assert after["held_requests"] - before["held_requests"] == 1
  assert out.tokens == reference(shared, 8)
  assert_logprobs(shared, out)
  # Only the chunks past the held prefix travelled as segments.
  assert after["segments_in"] - before["segments_in"] == -(-(PROMPT - held) // 128)

  # Negative control: a prompt whose prefix the decode node does not hold.
  fresh = _prompt(PROMPT, 13)
  out_fresh = client.generate(prompt_ids=fresh, max_new_tokens=8, route="remote")
  after2 = _decode_stats(cluster)
  assert after2["held_tokens"] == after["held_tokens"]
  assert after2["segments_in"] - after["segments_in"] == 3
  assert out_fresh.tokens == reference(fresh, 8)
  sent, sent_fresh = int(out.summary["link_bytes"]), int(out_fresh.summary["link_bytes"])
  bytes_in = after["transfer_bytes_in"] - before["transfer_bytes_in"]
  bytes_in_fresh = after2["transfer_bytes_in"] - after["transfer_bytes_in"]
  print(f"held={held} link_bytes held={sent} fresh={sent_fresh} "
        f"received held={bytes_in} fresh={bytes_in_fresh}")
  assert sent < 0.6 * sent_fresh, (sent, sent_fresh)
  assert bytes_in < 0.6 * bytes_in_fresh, (bytes_in, bytes_in_fresh)


def test_held_tokens_and_prompt_length_are_checked(cluster):
  prompt = list(_prompt(20, 14))
  with grpc.insecure_channel(cluster.decode_address) as ch:
    bad_len = serving_pb2.DecodeRequest(request_id="bad-len", model="tiny_gdn_gqa",
                                        prompt_ids=prompt, remote_prefill=True,
                                        prompt_len=len(prompt) + 1, max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
      next(serving_pb2_grpc.DecodeStub(ch).Decode(bad_len, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_len" in e.value.details()
    # The node's Prefill service (PD-P): a held prefix must lie inside the prompt.
    for held in (-1, len(prompt)):
      req = serving_pb2.PrefillRequest(request_id=f"bad-held{held}", model="tiny_gdn_gqa",
                                       prompt_ids=prompt, decode_target="127.0.0.1:1",
                                       decode_held_tokens=held)
      with pytest.raises(grpc.RpcError) as e:
        next(serving_pb2_grpc.PrefillStub(ch).Prefill(req, timeout=10))
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
      assert "decode_held_tokens" in e.value.details()
