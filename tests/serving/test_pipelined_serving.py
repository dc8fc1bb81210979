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
