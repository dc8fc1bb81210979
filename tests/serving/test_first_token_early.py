"""First token early: a remote request's first token streams at its Handoff,
before its state lands; the handoff logit probe still gates token 2 onwards.

Real gRPC servers in this process (decode server, prefill server, broker), the
tiny model. The decode-server tests play region A themselves (prefill, probe,
Handoff, then the state over the real transport), so the order is explicit:
the first token is read before a single byte of state was sent. A state
damaged behind the transport's checks (the ``corrupt_state`` fault hook) gets
token 1 out (region A computed it: correct by construction) and then
DATA_LOSS, never a token 2; through the broker the request is then
re-prefilled and the client gets exactly the reference tokens, token 1 once.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc
import jax
import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.models import api
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security.faults import FaultPlan
from paas_jax.serving import broker, common, decode_server, handoff_probe, prefill_server
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.prefill_engine import PrefillInput
from paas_jax.serving.routing import StaticThresholdPolicy
from paas_jax.serving.validation import RequestParams
from paas_jax.transport import SenderOptions, StateSender

MAX_NEW = 6
LONG = 60  # threshold 32: remote (PrfaaS) route


def _prompt(salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(1500 + salt).integers(1, 256, LONG)]


@pytest.fixture(scope="module")
def stack():
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model("tiny_gdn_gqa", 0)
  ec = EngineConfig(n_slots=2, max_ctx=128, prefill_buckets=(64,), prefill_max_batch=1)
  damage = handoff_probe.fault_hook(FaultPlan(corrupt_states=1 << 30), model.config)
  armed = {"damage": 0}

  def corrupt(request_id, state):
    if armed["damage"] > 0:
      armed["damage"] -= 1
      return damage(request_id, state)
    return state
  d = decode_server.start(model, ec, max_queue=4, corrupt_state=corrupt)
  p = prefill_server.start(model, ec)
  b = broker.start(model.config, StaticThresholdPolicy(32), prefill_targets=[p.address],
                   decode_targets=[broker.DecodeTarget(d.address, d.transfer_address)],
                   health_interval_s=0.3)
  client = BrokerClient(b.address, timeout_s=120)
  channel = grpc.insecure_channel(d.address)
  yield {"model": model, "decode": d, "prefill": p, "broker": b, "client": client,
         "armed": armed, "stub": serving_pb2_grpc.DecodeStub(channel),
         "reference": lambda prompt: api.generate(model, prompt, MAX_NEW).tokens}
  channel.close()
  client.close()
  b.stop()
  p.stop()
  d.stop()


class RegionA:
  """Plays the prefill side of one request against the decode server."""

  def __init__(self, stack, rid: str, prompt: list[int]):
    self.stack, self.rid, self.prompt = stack, rid, prompt
    model = stack["model"]
    self.out = stack["prefill"].servicer.engine.prefill(
        [PrefillInput(rid, tuple(prompt), RequestParams())])[0]
    self.probe = handoff_probe.make(model, self.out)
    self.events: queue.Queue = queue.Queue()
    self.call = stack["stub"].Decode(serving_pb2.DecodeRequest(
        request_id=rid, model=model.config.name, remote_prefill=True,
        prompt_len=len(prompt), max_new_tokens=MAX_NEW), timeout=120)
    assert next(self.call).accepted
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    try:
      for ev in self.call:
        if ev.token_ids or ev.finished:
          self.events.put(("tokens", list(ev.token_ids), ev.finished))
    except grpc.RpcError as e:
      self.events.put(("error", e.code(), e.details()))
    self.events.put(("end",))

  def handoff(self):
    self.stack["stub"].Handoff(serving_pb2.HandoffRequest(
        request_id=self.rid, first_token=self.out.first_token, probe=self.probe), timeout=30)

  def send_state(self):
    cfg = self.stack["model"].config
    d = self.stack["decode"]
    with StateSender(d.transfer_address, options=SenderOptions(num_streams=1)) as sender:
      tx = sender.begin(model_id=cfg.name, config_fingerprint=cfg.fingerprint(),
                        num_layers=cfg.n_layers, lengths=[len(self.prompt)],
                        transfer_id=self.rid, token_count=len(self.prompt))
      for i, cache in enumerate(jax.tree_util.tree_map(np.asarray, self.out.state).layers):
        tx.send_layer(i, cache)
      tx.finish()

  def drain(self) -> tuple[list[int], tuple | None]:
    """Tokens until the stream ends, and its error (code, details) if any."""
    tokens, error = [], None
    while True:
      ev = self.events.get(timeout=60)
      if ev[0] == "end":
        return tokens, error
      if ev[0] == "error":
        error = ev[1:]
      else:
        tokens.extend(ev[1])


def test_first_token_streams_before_any_state_byte_is_sent(stack):
  prompt = _prompt(0)
  want = stack["reference"](prompt)
  a = RegionA(stack, "early-ok", prompt)
  a.handoff()
  kind, tokens, finished = a.events.get(timeout=30)  # no state was sent yet
  assert kind == "tokens" and tokens == [a.out.first_token] == want[:1] and not finished
  a.send_state()
  rest, error = a.drain()
  assert error is None
  assert tokens + rest == want  # token 1 once, then the decode from the checked state
  assert stack["decode"].servicer.verifier.counters["ok"] >= 1


def test_negative_control_gated_first_token_waits_for_the_state(stack):
  """With first_token_early off the same sequence streams nothing before the
  state: the test above observes the early token, not an artefact."""
  servicer = stack["decode"].servicer
  servicer.first_token_early = False
  try:
    prompt = _prompt(1)
    a = RegionA(stack, "gated", prompt)
    a.handoff()
    with pytest.raises(queue.Empty):
      a.events.get(timeout=2.0)
    a.send_state()
    tokens, error = a.drain()
  finally:
    servicer.first_token_early = True
  assert error is None and tokens == stack["reference"](prompt)


def test_damaged_state_gets_token_1_out_and_withholds_tokens_2_on(stack):
  prompt = _prompt(2)
  want = stack["reference"](prompt)
  verifier = stack["decode"].servicer.verifier
  mismatches = verifier.counters["mismatch"]
  a = RegionA(stack, "early-damaged", prompt)
  a.handoff()
  kind, tokens, _ = a.events.get(timeout=30)
  assert kind == "tokens" and tokens == want[:1]
  stack["armed"]["damage"] = 1
  a.send_state()
  rest, error = a.drain()
  assert rest == []  # never a token 2 from the damaged state
  assert error is not None and error[0] == grpc.StatusCode.DATA_LOSS
  assert "logit probe" in error[1]
  assert verifier.counters["mismatch"] == mismatches + 1


def test_through_the_broker_a_damaged_handoff_is_reprefilled_token_1_once(stack):
  """The client has token 1 when the probe fails; the broker still re-prefills
  (token 1 came from region A's own state), checks the regenerated token 1
  against it and streams only what follows."""
  client = stack["client"]
  counters = stack["broker"].servicer.counters
  early = stack["decode"].servicer.scheduler.counters["first_tokens_early"]
  prompt = _prompt(3)
  tokens, summary = [], None
  for chunk in client.stream(prompt_ids=prompt, max_new_tokens=MAX_NEW):
    tokens.extend(chunk.token_ids)
    summary = chunk.summary if chunk.finished else summary
  assert summary["route"] == "prfaas" and tokens == stack["reference"](prompt)
  assert stack["decode"].servicer.scheduler.counters["first_tokens_early"] == early + 1

  fallbacks = counters["fallback_pdp"]
  stack["armed"]["damage"] = 1
  prompt = _prompt(4)
  tokens, summary = [], None
  for chunk in client.stream(prompt_ids=prompt, max_new_tokens=MAX_NEW):
    tokens.extend(chunk.token_ids)
    summary = chunk.summary if chunk.finished else summary
  assert tokens == stack["reference"](prompt)  # zero wrong tokens, token 1 once
  assert summary["route"] == "pdp" and "DATA_LOSS" in summary["route_reason"]
  assert counters["fallback_pdp"] == fallbacks + 1
  assert stack["decode"].servicer.scheduler.counters["first_tokens_early"] == early + 2


def _phases_logged(caplog, rid: str) -> list[str]:
  """The phases entered by ``rid`` as the lifecycle logger logged them."""
  return [r.phase for r in caplog.records
          if r.name == "paas_jax.serving.lifecycle" and getattr(r, "request_id", "") == rid
          and hasattr(r, "phase")]


def _recent(client, rid: str) -> dict:
  return next(r for r in client.stats()["recent"] if r["request_id"] == rid)


def test_offloaded_request_waits_for_its_remote_state_between_handoff_and_decode(stack, caplog):
  """The phases of a PrfaaS request through the real servers, as the broker
  logged them (with the request id) and reports them (GetStats recent
  ``phases``): transferring -> waiting_for_state -> decoding. Negative
  control: a state damaged behind the transport fails in waiting_for_state
  (the probe at the handoff), never reaching decoding on that attempt."""
  caplog.set_level(logging.DEBUG, logger="paas_jax.serving.lifecycle")
  client = stack["client"]
  prompt = _prompt(5)
  out = client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, request_id="phases-ok")
  assert out.tokens == stack["reference"](prompt)
  want = ["received", "routed", "prefilling", "transferring", "waiting_for_state",
          "decoding", "finished"]
  rec = _recent(client, "phases-ok")
  assert rec["route"] == "prfaas" and rec["phases"] == want
  assert ["received"] + _phases_logged(caplog, "phases-ok") == want

  stack["armed"]["damage"] = 1
  prompt = _prompt(6)
  out = client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, request_id="phases-bad")
  assert out.tokens == stack["reference"](prompt)
  want = ["received", "routed", "prefilling", "transferring", "waiting_for_state",
          "rerouted", "prefilling", "decoding", "finished"]
  assert _recent(client, "phases-bad")["phases"] == want
  assert ["received"] + _phases_logged(caplog, "phases-bad") == want


def test_a_single_process_prefill_server_refuses_a_decode_slice(stack):
  # A slice takes per-process shard parts (a prefill pod's), never a whole state.
  prompt = _prompt(40)
  request = serving_pb2.PrefillRequest(
      request_id="to-slice", model=stack["model"].config.name, prompt_ids=prompt,
      decode_target=stack["decode"].transfer_address,
      decode_slice=serving_pb2.DecodeSlice(
          transfer_targets=[stack["decode"].transfer_address, "127.0.0.1:1"],
          devices_per_process=1))
  with grpc.insecure_channel(stack["prefill"].address) as ch:
    with pytest.raises(grpc.RpcError) as e:
      list(serving_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=60))
  assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
  assert "prefill pod" in e.value.details()
