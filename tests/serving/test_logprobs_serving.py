"""Served logprobs vs single-process reference logits, through real gRPC servers.

Broker, region A's prefill server and region B's decode server run in this
process (real gRPC, real state transfer, the production logit probe on). On
both routes -- PrfaaS (region A prefills, the state crosses the transfer port)
and local PD-P (the decode node prefills) -- the client's ``TokenLogprob`` of
every token (the first from the prefill side, later ones from the paged decode
pool) must equal ``log_softmax`` of the reference logits (one full
single-process prefill: ``logprob_check``) within ``LOGPROB_ATOL``, and the
tokens must equal ``api.generate``'s. Negative control: the decode side holds
a damaged state (the ``corrupt_states`` fault, probe off so that it is not
caught first) and the same comparison fails.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from paas_jax.client import BrokerClient, GenerationError
from paas_jax.models import api
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security.faults import FaultPlan
from paas_jax.serving import logprob_check

MAX_NEW = 6
TOP = 5
LONG, SHORT = 60, 20  # threshold 32: remote (PrfaaS) / local (PD-P)


def _prompt(salt: int, length: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(1200 + salt).integers(1, 256, length)]


@pytest.fixture(scope="module")
def stack(ref_model):
  from paas_jax.serving import broker, decode_server, handoff_probe, prefill_server
  from paas_jax.serving.engine_config import EngineConfig
  from paas_jax.serving.routing import StaticThresholdPolicy
  model = ref_model
  ec = EngineConfig(n_slots=2, max_ctx=128, prefill_buckets=(64,), prefill_max_batch=1)
  plan = FaultPlan()  # tests arm it: plan.corrupt_states
  damage = handoff_probe.fault_hook(FaultPlan(corrupt_states=1 << 30), model.config)

  def corrupt(request_id, state):
    return damage(request_id, state) if plan.take_state_corruption() else state
  d = decode_server.start(model, ec, max_queue=4, corrupt_state=corrupt)
  p = prefill_server.start(model, ec)
  b = broker.start(model.config, StaticThresholdPolicy(32), prefill_targets=[p.address],
                   decode_targets=[broker.DecodeTarget(d.address, d.transfer_address)],
                   health_interval_s=0.3)
  client = BrokerClient(b.address, timeout_s=120)
  yield {"model": model, "broker": b, "decode": d, "plan": plan, "client": client}
  client.close()
  b.stop()
  p.stop()
  d.stop()


def _arm(stack, n):
  plan = stack["plan"]
  with plan._lock:  # pylint: disable=protected-access
    plan.corrupt_states = plan._states_corrupted + n  # pylint: disable=protected-access


@pytest.mark.parametrize("route,length,sampling", [
    ("remote", LONG, (0.0, 0, 1.0)),
    ("local", SHORT, (0.0, 0, 1.0)),
    ("remote", LONG, (0.8, 0, 0.95)),
])
def test_served_logprobs_match_reference_logits(stack, route, length, sampling):
  model = stack["model"]
  prompt = _prompt(length + int(sampling[0] * 10), length)
  out = stack["client"].generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, route=route,
                                 temperature=sampling[0], top_k=sampling[1],
                                 top_p=sampling[2], seed=11, logprobs=True, top_logprobs=TOP)
  assert out.route == ("prfaas" if route == "remote" else "pdp")
  want = api.generate(model, prompt, MAX_NEW, sampling=api.SamplingParams(*sampling),
                      seed=11).tokens
  assert out.tokens == list(want)
  assert [lp.token_id for lp in out.logprobs] == out.tokens
  assert all(len(lp.top_ids) == TOP for lp in out.logprobs)
  ref = logprob_check.reference_logprobs(model, prompt, out.tokens)
  cmp = logprob_check.compare(out.logprobs, ref)
  assert cmp.ok and cmp.steps == MAX_NEW, cmp


def test_no_logprobs_unless_asked(stack):
  chunks = list(stack["client"].stream(prompt_ids=_prompt(7, LONG), max_new_tokens=3))
  assert sum(len(c.token_ids) for c in chunks) == 3
  assert all(not c.logprobs for c in chunks)


def test_negative_control_damaged_state_fails_the_logprob_comparison(stack):
  """The decode pool decodes a damaged state (probe off): the first token's
  logprobs (region A's prefill) still match, every later step's do not."""
  model = stack["model"]
  verifier = stack["decode"].servicer.verifier
  verifier.enabled = False
  try:
    _arm(stack, 1)
    prompt = _prompt(3, LONG)
    out = stack["client"].generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, route="remote",
                                   logprobs=True, top_logprobs=TOP)
  finally:
    verifier.enabled = True
  assert out.route == "prfaas"
  ref = logprob_check.reference_logprobs(model, prompt, out.tokens)
  assert logprob_check.compare(out.logprobs, ref, steps=[0]).ok
  later = logprob_check.compare(out.logprobs, ref, steps=range(1, MAX_NEW))
  assert not later.ok and later.max_error > 10 * logprob_check.LOGPROB_ATOL, later


def test_reprefilled_request_keeps_one_logprob_per_token(stack):
  """The probe (on) catches a damaged state after region A's first token was
  streamed early: the broker re-prefills locally and drops the regenerated
  first token, and its logprob, from the retry; the client gets each token
  once with its logprob, all matching the reference."""
  model = stack["model"]
  counters = stack["broker"].servicer.counters
  fallbacks = counters["fallback_pdp"]
  sched = stack["decode"].servicer.scheduler
  early = sched.counters["first_tokens_early"]
  _arm(stack, 1)
  prompt = _prompt(4, LONG)
  out = stack["client"].generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, logprobs=True,
                                 top_logprobs=TOP)
  assert out.route == "pdp" and counters["fallback_pdp"] == fallbacks + 1
  assert sched.counters["first_tokens_early"] == early + 1  # token 1 went out before
  assert out.tokens == list(api.generate(model, prompt, MAX_NEW).tokens)
  assert [lp.token_id for lp in out.logprobs] == out.tokens
  cmp = logprob_check.compare(out.logprobs, logprob_check.reference_logprobs(
      model, prompt, out.tokens))
  assert cmp.ok and cmp.steps == MAX_NEW, cmp


@pytest.mark.parametrize("kwargs,what", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be in [0, 20]"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs needs logprobs"),
])
def test_bad_logprob_requests_are_invalid_argument(stack, kwargs, what):
  with pytest.raises(GenerationError) as e:
    stack["client"].generate(prompt_ids=_prompt(8, SHORT), max_new_tokens=2, **kwargs)
  assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.message


def test_handoff_rejects_a_malformed_first_logprob(stack):
  bad = [(serving_pb2.TokenLogprob(token_id=3, logprob=-0.1, top_ids=[1, 2],
                                   top_logprobs=[-0.5]), "differ in length"),
         (serving_pb2.TokenLogprob(token_id=4, logprob=-0.1), "is not first_token"),
         (serving_pb2.TokenLogprob(token_id=3, logprob=0.5), "not <= 0"),
         (serving_pb2.TokenLogprob(token_id=3, logprob=-1.0, top_ids=[99999],
                                   top_logprobs=[-1.0]), "outside the vocabulary")]
  with grpc.insecure_channel(stack["decode"].address) as ch:
    stub = serving_pb2_grpc.DecodeStub(ch)
    for lp, what in bad:
      with pytest.raises(grpc.RpcError) as e:
        stub.Handoff(serving_pb2.HandoffRequest(request_id="x", first_token=3,
                                                first_logprob=lp), timeout=10)
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.details()


def test_handoff_refuses_logprobs_that_do_not_fit_the_request(stack):
  """A registered request that asked for top-2 logprobs: a Handoff without
  first_logprob, or with another top count, is INVALID_ARGUMENT (never a
  token streamed without its logprobs); the control with 2 is accepted."""
  with grpc.insecure_channel(stack["decode"].address) as ch:
    stub = serving_pb2_grpc.DecodeStub(ch)
    call = stub.Decode(serving_pb2.DecodeRequest(
        request_id="lp-fit", remote_prefill=True, prompt_len=10, max_new_tokens=2,
        logprobs=True, top_logprobs=2), timeout=30)
    assert next(call).accepted
    one = serving_pb2.TokenLogprob(token_id=3, logprob=-1.0, top_ids=[3], top_logprobs=[-1.0])
    for lp, what in ((None, "missing"), (one, "asked for 2")):
      with pytest.raises(grpc.RpcError) as e:
        stub.Handoff(serving_pb2.HandoffRequest(request_id="lp-fit", first_token=3,
                                                first_logprob=lp), timeout=10)
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.details()
    two = serving_pb2.TokenLogprob(token_id=3, logprob=-1.0, top_ids=[3, 4],
                                   top_logprobs=[-1.0, -2.0])
    stub.Handoff(serving_pb2.HandoffRequest(request_id="lp-fit", first_token=3,
                                            first_logprob=two), timeout=10)
    call.cancel()


@pytest.mark.slow
def test_pd_split_route_relays_logprobs(ref_model):
  """Route pdp over two PD nodes (roles pdp + pdd): the PD-P node prefills and
  streams the state to the PD-D node inside region B; its first token's
  logprob travels FirstToken -> Handoff like PrfaaS's."""
  from paas_jax.serving import broker, decode_server
  from paas_jax.serving.engine_config import EngineConfig
  from paas_jax.serving.routing import StaticThresholdPolicy
  ec = EngineConfig(n_slots=2, max_ctx=128, prefill_buckets=(64,), prefill_max_batch=1)
  nodes = [decode_server.start(ref_model, ec, max_queue=4) for _ in range(2)]
  b = broker.start(ref_model.config, StaticThresholdPolicy(32), prefill_targets=[],
                   decode_targets=[broker.DecodeTarget(d.address, d.transfer_address)
                                   for d in nodes], roles=["pdp", "pdd"],
                   health_interval_s=0.3)
  try:
    with BrokerClient(b.address, timeout_s=120) as client:
      prompt = _prompt(5, SHORT)
      out = client.generate(prompt_ids=prompt, max_new_tokens=MAX_NEW, logprobs=True,
                            top_logprobs=TOP)
  finally:
    b.stop()
    for d in nodes:
      d.stop()
  s = out.summary
  assert s["route"] == "pdp" and s["prefill_server"] == nodes[0].address
  assert s["decode_server"] == nodes[1].address
  assert out.tokens == list(api.generate(ref_model, prompt, MAX_NEW).tokens)
  cmp = logprob_check.compare(out.logprobs, logprob_check.reference_logprobs(
      ref_model, prompt, out.tokens))
  assert cmp.ok and cmp.steps == MAX_NEW, cmp
