"""End-to-end tests against real server processes on 127.0.0.1 (see conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paas_jax.client import BrokerClient, GenerationError
from paas_jax.proto import serving_pb2, serving_pb2_grpc

from tests.serving.conftest import LONG, MAX_CTX, N_SLOTS, SHORT, THRESHOLD


def _prompt(length: int, salt: int) -> tuple[int, ...]:
  rng = np.random.default_rng(1000 + salt)
  return tuple(int(t) for t in rng.integers(0, 256, length))


def decode_stats(cluster) -> dict:
  with grpc.insecure_channel(cluster.decode_address) as ch:
    r = serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(), timeout=10)
  return dict(r.gauges)


def wait_idle(cluster, timeout_s: float = 20.0) -> dict:
  """Waits until no decode slot is busy and nothing waits; returns the stats."""
  deadline = time.monotonic() + timeout_s
  while True:
    s = decode_stats(cluster)
    if s["slots_busy"] == 0 and s["waiting"] == 0 and s["slots_free"] == N_SLOTS:
      return s
    if time.monotonic() > deadline:
      raise AssertionError(f"decode pool not idle after {timeout_s} s: {s}")
    time.sleep(0.05)


@pytest.fixture(scope="module")
def client(cluster):
  with BrokerClient(cluster.broker_address, timeout_s=120) as c:
    yield c


def test_all_servers_healthy(cluster):
  for name in ("prefill", "decode", "broker"):
    port = cluster.procs[name].info["port"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
      r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING, name


def test_servers_froze_their_startup_heap(cluster):
  # common.freeze_startup_heap: no full collection walks the model and jax again.
  for name in ("prefill", "decode", "broker"):
    assert cluster.procs[name].info["gc_frozen_objects"] > 10_000, name


CASES = [
    # (length, route, temperature, top_k, top_p, seed, expected route)
    (SHORT, "auto", 0.0, 0, 1.0, 0, "pdp"),
    (LONG, "auto", 0.0, 0, 1.0, 0, "prfaas"),
    (SHORT, "auto", 0.9, 40, 0.95, 11, "pdp"),
    (LONG, "auto", 1.0, 0, 1.0, 12, "prfaas"),
    (SHORT, "remote", 0.8, 0, 0.9, 13, "prfaas"),
    (LONG, "local", 0.7, 20, 1.0, 14, "pdp"),
]


@pytest.mark.parametrize("length,route,temperature,top_k,top_p,seed,expected", CASES)
def test_tokens_match_single_process_generation(client, reference, length, route, temperature,
                                                top_k, top_p, seed, expected):
  prompt = _prompt(length, seed)
  out = client.generate(prompt_ids=prompt, max_new_tokens=12, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, route=route)
  assert out.route == expected
  assert out.tokens == reference(prompt, 12, temperature, top_k, top_p, seed)
  assert out.finish_reason == "max_tokens"
  s = out.summary
  assert s["prompt_tokens"] == length
  assert s["generated_tokens"] == 12
  if expected == "prfaas":
    assert int(s["link_bytes"]) > 0 and float(s["transfer_s"]) > 0
    assert int(s["state_bytes"]) > 0
  else:
    assert int(s["link_bytes"]) == 0
  if route == "auto":
    assert f"t={THRESHOLD}" in s["route_reason"]
    assert s["route_rule"] == ("static:long" if expected == "prfaas" else "static:short")
  else:
    assert s["route_rule"] == {"local": "forced:local", "remote": "forced:remote"}[route]
  assert 0 < out.ttft_s <= out.total_s


def test_stop_token_ends_generation(client, reference):
  prompt = _prompt(SHORT, 21)
  full = reference(prompt, 12, 1.0, 0, 1.0, 21)
  stop = full[4]
  out = client.generate(prompt_ids=prompt, max_new_tokens=12, temperature=1.0, seed=21,
                        stop_tokens=[stop])
  assert out.finish_reason == "stop_token"
  assert out.tokens == full[:full.index(stop) + 1]


def test_text_prompt_byte_level(client, reference):
  out = client.generate(prompt="Prefill here, decode there.", max_new_tokens=6, seed=3,
                        temperature=0.5)
  prompt = tuple("Prefill here, decode there.".encode())
  assert out.tokens == reference(prompt, 6, 0.5, 0, 1.0, 3)


def test_sixteen_concurrent_requests(cluster, client, reference):
  n = 16
  specs = [(LONG if i % 2 else SHORT, 100 + i, 0.0 if i % 3 == 0 else 0.8) for i in range(n)]
  # Warm the reference first so that it does not compete with the requests.
  expected = [reference(_prompt(l, s), 24, t, 0, 1.0, s) for l, s, t in specs]
  results: list = [None] * n
  spans: list = [None] * n
  barrier = threading.Barrier(n)

  def run(i):
    length, seed, temperature = specs[i]
    barrier.wait()
    t0 = time.monotonic()
    try:
      results[i] = client.generate(prompt_ids=_prompt(length, seed), max_new_tokens=24,
                                   temperature=temperature, seed=seed)
    except Exception as e:  # pylint: disable=broad-except
      results[i] = e
    spans[i] = (t0, time.monotonic())

  threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  errors = [r for r in results if isinstance(r, Exception)]
  assert not errors, errors
  for i, r in enumerate(results):
    assert r.tokens == expected[i], f"request {i} ({r.route})"
  assert {r.route for r in results} == {"pdp", "prfaas"}
  # All 16 were in flight at the same moment.
  assert max(s[0] for s in spans) < min(s[1] for s in spans)
  wait_idle(cluster)


@pytest.mark.parametrize("route", ["local", "remote"])
def test_client_cancellation_frees_the_decode_slot(cluster, client, route):
  wait_idle(cluster)
  before = decode_stats(cluster)
  stream = client.stream(prompt_ids=_prompt(SHORT, 31), max_new_tokens=MAX_CTX - SHORT - 1,
                         temperature=0.8, seed=31, route=route)
  got = 0
  for chunk in stream:
    got += len(chunk.token_ids)
    if got >= 3:
      break
  assert decode_stats(cluster)["slots_busy"] == 1
  stream.cancel()
  after = wait_idle(cluster, 10.0)
  assert after["cancelled"] >= before["cancelled"] + 1
  assert after["pages_free"] == after["pages_total"]
  assert after["tokens_generated"] < before["tokens_generated"] + MAX_CTX - SHORT - 1


BAD = [
    ({"prompt_ids": []}, "empty"),
    ({"prompt_ids": [1, 2, 256]}, "vocabulary"),
    ({"prompt_ids": [1, -1, 2]}, "vocabulary"),
    ({"prompt_ids": [1] * 1100}, "context"),
    ({"prompt_ids": [1] * 500, "max_new_tokens": 32}, "context"),  # over the decode slot
    ({"prompt_ids": [1, 2], "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt_ids": [1, 2], "max_new_tokens": -5}, "max_new_tokens"),
    ({"prompt_ids": [1, 2], "model": "no_such_model"}, "unknown model"),
    ({"prompt_ids": [1, 2], "top_p": 1.5}, "top_p"),
    ({"prompt_ids": [1, 2], "temperature": -1.0}, "temperature"),
    ({"prompt_ids": [1, 2], "prompt": "x"}, "not both"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[n for _, n in BAD])
def test_bad_input_is_invalid_argument(client, kwargs, needle):
  kwargs = dict(kwargs)
  kwargs.setdefault("max_new_tokens", 4)
  with pytest.raises(GenerationError) as e:
    client.generate(**kwargs)
  assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
  assert needle in e.value.message


def test_full_pool_queues_or_refuses_and_drops_nothing(cluster, client):
  wait_idle(cluster)
  n, new = 30, 240
  results: list = [None] * n
  barrier = threading.Barrier(n)

  def run(i):
    barrier.wait()
    try:
      results[i] = client.generate(prompt_ids=_prompt(SHORT, 200 + i), max_new_tokens=new,
                                   temperature=0.8, seed=i, route="local")
    except GenerationError as e:
      results[i] = e

  threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(180)
  refused = [r for r in results if isinstance(r, GenerationError)]
  served = [r for r in results if not isinstance(r, GenerationError)]
  assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused), refused
  assert refused and all("decode pool full" in e.message for e in refused)
  # Every accepted request ran to its end: none was dropped.
  assert len(served) >= N_SLOTS
  assert all(len(r.tokens) == new and r.finish_reason == "max_tokens" for r in served)
  # Some of them waited in the queue for a slot.
  assert max(float(r.summary["decode_queue_s"]) for r in served) > 0.05
  s = wait_idle(cluster)
  assert s["rejected_queue_full"] >= len(refused)


def test_stats_track_lifecycle(cluster, client):
  client.generate(prompt_ids=_prompt(LONG, 61), max_new_tokens=3)
  stream = client.stream(prompt_ids=_prompt(SHORT, 62), max_new_tokens=300)
  next(iter(stream))
  stream.cancel()
  wait_idle(cluster)
  deadline = time.monotonic() + 10
  while client.stats()["inflight"] and time.monotonic() < deadline:
    time.sleep(0.05)
  stats = client.stats()
  recent = stats["recent"]
  assert recent and stats["inflight"] == []
  phases = {r["phase"] for r in recent}
  assert "finished" in phases and "cancelled" in phases
  assert stats["route_pdp"] > 0 and stats["route_prfaas"] > 0
  d = decode_stats(cluster)
  # Nothing of finished transfers is left on the decode side.
  assert d["receiver_bytes_in_use"] == 0 and d["receiver_active_transfers"] == 0
  assert d["orphans"] == 0
  # A broker serving a checkpoint learns the model from the decode server.
  from paas_jax.models import load_config
  from paas_jax.serving.broker import model_config_from_decode
  assert model_config_from_decode(cluster.decode_address) == load_config("tiny_gdn_gqa")


def test_client_command_line(cluster):
  cmd = [sys.executable, "-m", "paas_jax.client", f"--broker={cluster.broker_address}",
         "--prompt_ids=" + ",".join(str(t) for t in _prompt(LONG, 41)),
         "--max_new_tokens=5", "--seed=41"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "TTFT" in out.stdout and "remotely in the PrfaaS region" in out.stdout
  assert "link" in out.stdout
  out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120)
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert len(report["tokens"]) == 5 and report["route"] == "prfaas"
  bad = subprocess.run([sys.executable, "-m", "paas_jax.client",
                        f"--broker={cluster.broker_address}", "--prompt_ids=999"],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


def test_remote_route_falls_back_to_pdp_when_region_a_is_down(cluster, reference):
  """A broker whose prefill region is unreachable serves long prompts locally."""
  import socket
  from paas_jax.models import load_config
  from paas_jax.serving import broker
  from paas_jax.serving.routing import StaticThresholdPolicy
  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
  decode_info = cluster.procs["decode"].info
  b = broker.start(load_config("tiny_gdn_gqa"), StaticThresholdPolicy(THRESHOLD),
                   prefill_targets=[dead],
                   decode_targets=[broker.DecodeTarget(
                       cluster.decode_address, f"127.0.0.1:{decode_info['transfer_port']}")])
  try:
    with BrokerClient(b.address, timeout_s=60) as c:
      prompt = _prompt(LONG, 51)
      out = c.generate(prompt_ids=prompt, max_new_tokens=6, seed=51, temperature=0.9)
      assert out.route == "pdp" and "fallback" in out.summary["route_reason"]
      assert out.tokens == reference(prompt, 6, 0.9, 0, 1.0, 51)
      assert c.stats()["fallback_pdp"] == 1
  finally:
    b.stop()
  wait_idle(cluster)
