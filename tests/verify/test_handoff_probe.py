"""The fail-closed logit probe at the handoff, through real gRPC servers in this
process (broker, region A's prefill server, region B's decode server).

A state damaged on the decode side after the transport verified it (the
``corrupt_states`` fault) is caught before any token is streamed, the request
is re-prefilled locally and the client gets exactly the reference tokens. The
negative control turns the probe off: the same fault then delivers wrong
tokens, so the fault is real and the probe is what stops it.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security.faults import FaultPlan

MAX_NEW = 8
LONG = 60  # threshold 32: remote (PrfaaS) route


def _prompt(salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(900 + salt).integers(1, 256, LONG)]


@pytest.fixture(scope="module")
def stack():
  from paas_jax.models import api
  from paas_jax.observability import ServingMetrics
  from paas_jax.serving import broker, common, decode_server, handoff_probe, prefill_server
  from paas_jax.serving.engine_config import EngineConfig
  from paas_jax.serving.routing import StaticThresholdPolicy
  model, _ = common.load_model("tiny_gdn_gqa", 0)
  ec = EngineConfig(n_slots=2, max_ctx=128, prefill_buckets=(64,), prefill_max_batch=1)
  plan = FaultPlan()  # tests arm it: plan.corrupt_states
  damage = handoff_probe.fault_hook(FaultPlan(corrupt_states=1 << 30), model.config)

  def corrupt(request_id, state):
    return damage(request_id, state) if plan.take_state_corruption() else state
  metrics = ServingMetrics("decode", process=False)
  d = decode_server.start(model, ec, max_queue=4, metrics=metrics, corrupt_state=corrupt)
  p = prefill_server.start(model, ec)
  b = broker.start(model.config, StaticThresholdPolicy(32), prefill_targets=[p.address],
                   decode_targets=[broker.DecodeTarget(d.address, d.transfer_address)],
                   health_interval_s=0.3)
  client = BrokerClient(b.address, timeout_s=120)
  yield {"broker": b, "decode": d, "prefill": p, "plan": plan, "client": client,
         "metrics": metrics,
         "reference": lambda prompt: api.generate(model, prompt, MAX_NEW).tokens}
  client.close()
  b.stop()
  p.stop()
  d.stop()


def _run(stack, prompt):
  tokens, summary = [], None
  for chunk in stack["client"].stream(prompt_ids=prompt, max_new_tokens=MAX_NEW):
    tokens.extend(chunk.token_ids)
    if chunk.finished:
      summary = chunk.summary
  return tokens, summary


def _arm(stack, n):
  plan = stack["plan"]
  with plan._lock:  # pylint: disable=protected-access
    plan.corrupt_states = plan._states_corrupted + n  # pylint: disable=protected-access


def test_intact_state_passes_the_probe(stack):
  verifier = stack["decode"].servicer.verifier
  before = dict(verifier.counters)
  prompt = _prompt(0)
  tokens, summary = _run(stack, prompt)
  assert summary["route"] == "prfaas"
  assert tokens == stack["reference"](prompt)
  assert verifier.counters["ok"] == before.get("ok", 0) + 1
  assert verifier.counters["mismatch"] == before.get("mismatch", 0)
  assert stack["prefill"].servicer.counters["probes"] >= 1


def test_damaged_state_is_caught_and_reprefilled_locally(stack):
  verifier = stack["decode"].servicer.verifier
  counters = stack["broker"].servicer.counters
  before = (verifier.counters["mismatch"], counters["reroutes"], counters["fallback_pdp"])
  _arm(stack, 1)
  prompt = _prompt(1)
  tokens, summary = _run(stack, prompt)
  assert tokens == stack["reference"](prompt)  # zero wrong answers delivered
  assert verifier.counters["mismatch"] == before[0] + 1
  assert counters["reroutes"] == before[1] + 1 and counters["fallback_pdp"] == before[2] + 1
  assert summary["route"] == "pdp" and "fallback" in summary["route_reason"]
  metric = stack["metrics"].registry.get_sample_value("paas_handoff_probes_total",
                                                      {"outcome": "mismatch"})
  assert metric == verifier.counters["mismatch"]


def test_negative_control_without_the_probe_the_damage_reaches_the_client(stack):
  verifier = stack["decode"].servicer.verifier
  verifier.enabled = False
  try:
    _arm(stack, 1)
    prompt = _prompt(2)
    tokens, summary = _run(stack, prompt)
  finally:
    verifier.enabled = True
  assert summary["route"] == "prfaas"
  want = stack["reference"](prompt)
  assert tokens[0] == want[0]  # the first token comes from region A's prefill
  assert tokens != want


def test_handoff_rejects_a_malformed_probe(stack):
  with grpc.insecure_channel(stack["decode"].address) as ch:
    stub = serving_pb2_grpc.DecodeStub(ch)
    for probe, what in ((serving_pb2.LogitProbe(token=3, ids=[1, 2], values=[0.5]), "ids"),
                        (serving_pb2.LogitProbe(token=4, ids=[1], values=[0.5]), "probe.token")):
      with pytest.raises(grpc.RpcError) as e:
        stub.Handoff(serving_pb2.HandoffRequest(request_id="x", first_token=3, probe=probe),
                     timeout=10)
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.details()
