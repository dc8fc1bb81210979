"""Faults and security end to end, on a real secured deployment in this process.

Broker, prefill server (region A) and decode server (region B) run with
mutual TLS between them (certificates from a local CA), TLS plus a bearer
token at the broker's public API, and a FlakyLink as the WAN link in front
of the decode server's StateTransfer port. The prefill server carries a
FaultPlan that the tests arm (corrupted chunks, a slow prefill, a late first
token). Every completed request is checked token for token against
single-process ``api.generate``. (Killing server processes:
test_faults_processes.py.)
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from paas_jax.client import BrokerClient, GenerationError
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security import (ServiceSecurity, TLSConfig, TokenSet, channel_credentials,
                               generate_token, make_certs)
from paas_jax.security.faults import FaultPlan, FlakyLink

Code = grpc.StatusCode
MAX_NEW = 6
LONG, SHORT = 120, 20  # threshold 48: LONG goes to region A


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(500 + salt).integers(1, 256, n)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
  from paas_jax.models import api
  from paas_jax.observability import ServingMetrics
  from paas_jax.serving import broker, common, decode_server, prefill_server
  from paas_jax.serving.engine_config import EngineConfig
  from paas_jax.serving.routing import StaticThresholdPolicy
  from paas_jax.transport import SenderOptions
  certs = tmp_path_factory.mktemp("certs")
  files = make_certs(certs, ("broker", "prefill", "decode", "client"))
  token = generate_token()
  model, _ = common.load_model("tiny_gdn_gqa", 0)
  ec = EngineConfig(n_slots=4, max_ctx=256, prefill_buckets=(64,), prefill_max_batch=2)
  metrics = {r: ServingMetrics(r, process=False) for r in ("broker", "prefill", "decode")}
  sec = {r: ServiceSecurity(TLSConfig.from_files(files[r]), r) for r in ("prefill", "decode")}
  sec["broker"] = ServiceSecurity(TLSConfig.from_files(files["broker"]), "broker",
                                  tokens=TokenSet([("client", token)]))
  plan = FaultPlan(corrupt_chunks=1)
  d = decode_server.start(model, ec, max_queue=8, security=sec["decode"],
                          metrics=metrics["decode"])
  wan = FlakyLink(d.transfer_address).start()
  p = prefill_server.start(model, ec, security=sec["prefill"], metrics=metrics["prefill"],
                           faults=plan, sender_options=SenderOptions(
                               num_streams=2, rpc_timeout_s=5, commit_timeout_s=10))
  b = broker.start(model.config, StaticThresholdPolicy(48), prefill_targets=[p.address],
                   decode_targets=[broker.DecodeTarget(d.address, wan.address)],
                   security=sec["broker"], metrics=metrics["broker"], health_interval_s=0.3)
  client = BrokerClient(b.address, timeout_s=60,
                        credentials=channel_credentials(files["client"].ca, token=token))

  def reference(prompt, n=MAX_NEW, seed=0):
    return api.generate(model, prompt, n, seed=seed).tokens

  st = dict(broker=b, prefill=p, decode=d, wan=wan, plan=plan, files=files, token=token,
            metrics=metrics, client=client, reference=reference)
  yield st
  client.close()
  b.stop()
  p.stop()
  wan.stop()
  d.stop()


def wait_clean(stack, timeout_s: float = 10.0) -> dict:
  """Waits until region B holds nothing of finished / failed requests."""
  d = stack["decode"].servicer
  end = time.monotonic() + timeout_s
  while True:
    s = d.scheduler.stats()
    state = {"slots_busy": s["slots_busy"], "waiting": s["waiting"],
             "transfers": len(d.receiver.active_transfers()),
             "reserved": d.receiver.bytes_in_use,
             "prefill_queue": stack["prefill"].servicer.batcher.queue_depth,
             "broker_inflight": len(stack["broker"].servicer._inflight)}
    if not any(state.values()):
      return state
    if time.monotonic() > end:
      raise AssertionError(f"not clean after {timeout_s} s: {state}")
    time.sleep(0.05)


def metric(m, name: str, **labels) -> float:
  want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
  total = 0.0
  for line in m.text().splitlines():
    mm = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
    if mm and (not labels or ",".join(sorted(mm.group(1).split(","))) == want):
      total += float(mm.group(2))
  return total


# -- security -------------------------------------------------------------------------

def test_public_api_needs_a_valid_token(stack):
  b, files = stack["broker"], stack["files"]
  prompt = _prompt(LONG, 1)
  out = stack["client"].generate(prompt_ids=prompt, max_new_tokens=MAX_NEW)
  assert out.route == "prfaas" and out.tokens == stack["reference"](prompt)
  for token, code in ((None, Code.UNAUTHENTICATED), (generate_token(), Code.PERMISSION_DENIED)):
    with BrokerClient(b.address, credentials=channel_credentials(files["client"].ca,
                                                                 token=token)) as c:
      with pytest.raises(GenerationError) as e:
        c.generate(prompt_ids=prompt, max_new_tokens=2)
      assert e.value.code == code
  with BrokerClient(b.address) as c, pytest.raises(GenerationError) as e:  # plaintext
    c.generate(prompt_ids=prompt, max_new_tokens=2, timeout_s=3)
  assert e.value.code == Code.UNAVAILABLE


def test_regions_only_accept_their_peers(stack):
  from paas_jax.codec.testing import random_state
  from paas_jax.transport import SenderOptions, StateSender, TransferError
  files, d, p = stack["files"], stack["decode"], stack["prefill"]

  def creds(name):
    return channel_credentials(files[name].ca, files[name].cert, files[name].key)

  # A public client (certificate from our CA) may not ask region A to prefill...
  with grpc.secure_channel(p.address, creds("client")) as ch:
    call = serving_pb2_grpc.PrefillStub(ch).Prefill(serving_pb2.PrefillRequest(
        request_id="x", prompt_ids=[1, 2], decode_target=d.transfer_address), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
      list(call)
    assert e.value.code() == Code.PERMISSION_DENIED
  # ... nor can region A register requests at region B ...
  with grpc.secure_channel(d.address, creds("prefill")) as ch:
    call = serving_pb2_grpc.DecodeStub(ch).Decode(serving_pb2.DecodeRequest(
        request_id="x", prompt_ids=[1, 2], max_new_tokens=2), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
      list(call)
    assert e.value.code() == Code.PERMISSION_DENIED
  # ... and region B takes states only from region A.
  cfg = d.servicer.config
  state = random_state(cfg, [10], capacity=64)
  for who, code in (("broker", Code.PERMISSION_DENIED), ("client", Code.PERMISSION_DENIED),
                    (None, Code.UNAVAILABLE)):
    c = creds(who) if who else channel_credentials(files["client"].ca)
    with StateSender(d.transfer_address, options=SenderOptions(credentials=c,
                                                               rpc_timeout_s=5)) as s:
      with pytest.raises(TransferError) as e:
        s.send_state(state, model_id=cfg.name, config_fingerprint=cfg.fingerprint())
      assert e.value.code == code, who
  assert d.servicer.receiver.active_transfers() == []
  assert metric(stack["metrics"]["decode"], "paas_auth_refusals_total") >= 3
  assert metric(stack["metrics"]["prefill"], "paas_auth_refusals_total",
                check="peer", code="PERMISSION_DENIED") == 1


# -- faults on the link -----------------------------------------------------------------

def test_corrupted_chunks_are_detected_and_resent(stack):
  corrupter = stack["plan"].corrupter
  before = corrupter.corrupted
  retries_before = metric(stack["metrics"]["prefill"], "paas_link_chunk_retries_total")
  corrupter.times = corrupter.corrupted + 2
  prompt = _prompt(LONG, 2)
  out = stack["client"].generate(prompt_ids=prompt, max_new_tokens=MAX_NEW)
  assert out.route == "prfaas"
  assert out.tokens == stack["reference"](prompt)
  assert corrupter.corrupted == before + 2
  assert metric(stack["metrics"]["prefill"], "paas_link_chunk_retries_total") == (
      retries_before + 2)
  assert stack["prefill"].servicer.counters["resent_chunks"] >= 2
  wait_clean(stack)


def test_wan_cut_before_and_during_transfers_reroutes_with_the_same_tokens(stack):
  wan, plan, client = stack["wan"], stack["plan"], stack["client"]
  counters = stack["broker"].servicer.counters
  reroutes = counters["reroutes"]
  # Link down before the request: the transfer cannot begin; region B
  # prefills locally (PD-P) instead.
  wan.down()
  try:
    prompt = _prompt(LONG, 3)
    out = client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW)
    assert out.route == "pdp" and "fallback" in out.summary["route_reason"]
    assert out.tokens == stack["reference"](prompt)
  finally:
    wan.up()
  # Link cut in the middle of transfers: each layer takes 0.15 s to
  # "prefill", the link goes down for 1.5 s after 0.3 s.
  plan.layer_delay_s = 0.15
  results, prompts = {}, [_prompt(LONG, 10 + i) for i in range(3)]

  def run(i):
    try:
      results[i] = client.generate(prompt_ids=prompts[i], max_new_tokens=MAX_NEW)
    except GenerationError as e:
      results[i] = e
  threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
  try:
    for t in threads:
      t.start()
    time.sleep(0.3)
    wan.outage(1.5)
    for t in threads:
      t.join(60)
  finally:
    plan.layer_delay_s = 0.0
  for i, r in results.items():
    assert not isinstance(r, Exception), r
    assert r.tokens == stack["reference"](prompts[i])
  assert len(results) == 3
  assert counters["reroutes"] >= reroutes + 2  # the early request and >= 1 cut transfer
  assert wan.resets > 0
  wait_clean(stack)
  # The link is back and region A rejoined: long prompts go remote again.
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    out = client.generate(prompt_ids=_prompt(LONG, 20), max_new_tokens=2)
    if out.route == "prfaas":
      break
    time.sleep(0.3)
  assert out.route == "prfaas"


def test_wan_stall_delays_but_the_transfer_resumes(stack):
  wan, client = stack["wan"], stack["client"]
  prompt = _prompt(LONG, 4)
  reroutes = stack["broker"].servicer.counters["reroutes"]
  wan.outage(1.0, mode=FlakyLink.BLACKHOLE)
  started = time.monotonic()
  out = client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW)
  assert time.monotonic() - started >= 0.8
  assert out.route == "prfaas" and out.tokens == stack["reference"](prompt)
  assert stack["broker"].servicer.counters["reroutes"] == reroutes


# -- deadlines and cleanup --------------------------------------------------------------

def test_deadline_propagates_and_every_region_cleans_up(stack):
  plan, client = stack["plan"], stack["client"]
  plan.delay_first_token_s = 2.0
  try:
    started = time.monotonic()
    with pytest.raises(GenerationError) as e:
      client.generate(prompt_ids=_prompt(LONG, 5), max_new_tokens=MAX_NEW, timeout_s=0.8)
    assert e.value.code == Code.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2.0
    wait_clean(stack, timeout_s=10)
  finally:
    plan.delay_first_token_s = 0.0
  prompt = _prompt(SHORT, 6)
  assert client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW).tokens == (
      stack["reference"](prompt))


# -- observability ------------------------------------------------------------------------

def test_metrics_over_http_and_request_ids_across_regions(stack):
  buf = io.StringIO()
  handler = logging.StreamHandler(buf)
  from paas_jax.observability import JsonFormatter
  handler.setFormatter(JsonFormatter())
  serving_log = logging.getLogger("paas_jax.serving")
  old_level = serving_log.level
  serving_log.addHandler(handler)
  serving_log.setLevel(logging.INFO)
  try:
    for route, n in (("remote", LONG), ("local", SHORT)):
      stack["client"].generate(prompt_ids=_prompt(n, 7), max_new_tokens=MAX_NEW,
                               request_id=f"trace-{route}", route=route)
  finally:
    serving_log.removeHandler(handler)
    serving_log.setLevel(old_level)
  lines = [json.loads(l) for l in buf.getvalue().splitlines()]
  seen = {(l["logger"], l.get("request_id")) for l in lines}
  for logger in ("paas_jax.serving.broker", "paas_jax.serving.prefill",
                 "paas_jax.serving.decode"):
    assert (logger, "trace-remote") in seen, (logger, seen)
  assert ("paas_jax.serving.decode", "trace-local") in seen
  committed = next(l for l in lines if l["msg"] == "state transfer committed"
                   and l.get("request_id") == "trace-remote")
  assert committed["state_bytes"] > 0

  m = stack["metrics"]["broker"]
  port = m.serve(0)
  try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
      text = r.read().decode()
  finally:
    m.stop()
  assert 'paas_ttft_seconds_count{route="prfaas"}' in text
  assert 'paas_ttft_seconds_count{route="pdp"}' in text
  assert 'paas_tpot_seconds_count{route="prfaas"}' in text
  assert 'paas_routing_decisions_total{reason="forced",route="prfaas"}' in text
  assert 'paas_reroutes_total{' in text  # from the link faults above
  assert 'paas_auth_refusals_total{check="token",code="UNAUTHENTICATED"}' in text
  assert 'paas_queue_depth{queue="broker_inflight"}' in text
  assert metric(m, "paas_rpcs_total", method="Broker/Generate", code="OK") >= 5
  pm = stack["metrics"]["prefill"]
  assert metric(pm, "paas_link_goodput_bytes_total", link="A->B") > 0
  assert metric(pm, "paas_link_transfers_total", link="A->B", outcome="failed") >= 1
  assert 'paas_queue_depth{queue="decode_wait"}' in stack["metrics"]["decode"].text()


# -- servers that die and come back (last: they replace the stack's servers) ------------
# In-process "crashes": the server's gRPC ports stop at once (every open call and
# connection dropped) and its workers stop; test_faults_processes.py SIGKILLs
# real processes instead.

def _restart_prefill(stack, port: int):
  from paas_jax.serving import prefill_server
  from paas_jax.transport import SenderOptions
  old = stack["prefill"]
  p = prefill_server.start(old.servicer.model, old.servicer.engine.config,
                           port=port, security=ServiceSecurity(
                               TLSConfig.from_files(stack["files"]["prefill"]), "prefill"),
                           metrics=stack["metrics"]["prefill"], faults=stack["plan"],
                           sender_options=SenderOptions(num_streams=2, rpc_timeout_s=5))
  stack["prefill"] = p
  return p


def test_prefill_crash_mid_transfer_reprefills_and_the_server_rejoins(stack):
  p, plan, client = stack["prefill"], stack["plan"], stack["client"]
  port = p.control.port
  prompt = _prompt(LONG, 30)
  result = {}
  plan.layer_delay_s = 0.25  # the transfer spans ~1 s

  def run():
    try:
      result["out"] = client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW)
    except GenerationError as e:
      result["out"] = e
  t = threading.Thread(target=run)
  t.start()
  try:
    deadline = time.monotonic() + 10
    while not stack["decode"].servicer.receiver.active_transfers():
      assert time.monotonic() < deadline, "the transfer never started"
      time.sleep(0.01)
    time.sleep(0.2)
    p.control.server.stop(0)  # region A dies mid-transfer
    p.servicer.stop()
  finally:
    plan.layer_delay_s = 0.0
  t.join(30)
  out = result["out"]
  assert not isinstance(out, Exception), out
  assert out.tokens == stack["reference"](prompt)
  assert out.route == "pdp" and "fallback" in out.summary["route_reason"]
  wait_clean(stack)
  # While region A is down, long prompts are served locally without delay.
  b = stack["broker"].servicer
  assert not b.health.wait_healthy(p.address, 0.5)
  out = client.generate(prompt_ids=_prompt(LONG, 31), max_new_tokens=2)
  assert out.route == "pdp"
  # The restarted server rejoins through the health checks.
  p2 = _restart_prefill(stack, port)
  assert p2.address == p.address
  assert b.health.wait_healthy(p2.address, 10)
  prompt = _prompt(LONG, 32)
  out = client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW)
  assert out.route == "prfaas" and out.tokens == stack["reference"](prompt)


def test_decode_crash_fails_its_requests_cleanly_and_the_server_rejoins(stack):
  from paas_jax.serving import decode_server
  d, client = stack["decode"], stack["client"]
  results: dict = {}
  streaming = threading.Event()

  def run(i):
    try:
      got = []
      for chunk in client.stream(prompt_ids=_prompt(SHORT, 40 + i), max_new_tokens=200,
                                 timeout_s=60):
        got.extend(chunk.token_ids)
        if got:
          streaming.set()
      results[i] = got
    except GenerationError as e:
      results[i] = e
  threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
  for t in threads:
    t.start()
  assert streaming.wait(30)
  crashed = time.monotonic()
  d.control.server.stop(0)  # region B dies with requests streaming
  d.transfer.server.stop(0)
  d.servicer.stop()
  for t in threads:
    t.join(30)
  assert time.monotonic() - crashed < 10  # nothing hangs
  assert len(results) == 3
  for r in results.values():
    assert isinstance(r, GenerationError), "a request finished on a dead server?"
    assert r.code in (Code.UNAVAILABLE, Code.CANCELLED), r
  # No decode server left: new requests fail at once, with UNAVAILABLE.
  b = stack["broker"].servicer
  assert not b.health.is_healthy(d.address)
  started = time.monotonic()
  with pytest.raises(GenerationError) as e:
    client.generate(prompt_ids=_prompt(SHORT, 50), max_new_tokens=2, timeout_s=30)
  assert e.value.code == Code.UNAVAILABLE and time.monotonic() - started < 5
  # Restarted on the same ports, it rejoins.
  sec = ServiceSecurity(TLSConfig.from_files(stack["files"]["decode"]), "decode")
  d2 = decode_server.start(d.servicer.model, d.servicer.engine.config, port=d.control.port,
                           transfer_port=d.transfer.port, max_queue=8, security=sec,
                           metrics=stack["metrics"]["decode"])
  stack["decode"] = d2
  assert b.health.wait_healthy(d2.address, 10)
  for n in (SHORT, LONG):
    prompt = _prompt(n, 51)
    assert client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW).tokens == (
        stack["reference"](prompt))
