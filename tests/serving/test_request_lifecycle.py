"""The request state machine (serving/request_lifecycle.py): transition table,
illegal moves refused, stale/cancelled reports dropped, the retry policy."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from paas_jax.serving.request_lifecycle import (TERMINAL, TRANSITIONS, AttemptFailed,
                                                FailureCause, IllegalTransition,
                                                RequestLifecycle, RequestPhase, RetryAction,
                                                lost_node, retry_decision)
from paas_jax.serving.resume import ResumeDecision

P = RequestPhase
C = grpc.StatusCode

# The walks the broker takes (module docstring), each must be accepted.
PATHS = {
    "colocated": [P.ROUTED, P.PREFILLING, P.DECODING, P.FINISHED],
    "remote": [P.ROUTED, P.PREFILLING, P.TRANSFERRING, P.WAITING_FOR_STATE, P.DECODING,
               P.FINISHED],
    "prefix_shipped": [P.ROUTED, P.PREFIX_SHIPPING, P.ROUTED, P.PREFILLING, P.DECODING,
                       P.FINISHED],
    "no_prefill_server": [P.ROUTED, P.REROUTED, P.PREFILLING, P.DECODING, P.FINISHED],
    # Decode node lost mid-stream: restarted, the client already has the first token.
    "restart": [P.ROUTED, P.PREFILLING, P.TRANSFERRING, P.WAITING_FOR_STATE, P.DECODING,
                P.REROUTED, P.PREFILLING, P.TRANSFERRING, P.WAITING_FOR_STATE, P.DECODING,
                P.FINISHED],
    # The probe at the handoff caught a damaged state: re-prefilled locally.
    "damaged_state": [P.ROUTED, P.PREFILLING, P.TRANSFERRING, P.WAITING_FOR_STATE,
                      P.REROUTED, P.PREFILLING, P.DECODING, P.FINISHED],
    "failed": [P.ROUTED, P.PREFILLING, P.FAILED],
    "refused_route": [P.FAILED],
}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_broker_paths_are_legal(name):
  lc = RequestLifecycle("r1")
  assert lc.phase == P.RECEIVED
  for to in PATHS[name]:
    assert lc.advance(to) is True
    assert lc.phase == to
  assert lc.terminal


@pytest.mark.parametrize("frm,to", [
    (P.RECEIVED, P.DECODING),        # no route yet
    (P.RECEIVED, P.PREFILLING),
    (P.ROUTED, P.FINISHED),          # nothing ran
    (P.PREFIX_SHIPPING, P.DECODING),
    (P.DECODING, P.PREFILLING),      # backwards without a reroute
    (P.TRANSFERRING, P.PREFILLING),
    (P.TRANSFERRING, P.DECODING),    # remote: only through waiting_for_state
    (P.PREFILLING, P.WAITING_FOR_STATE),  # no first token handed over yet
    (P.PREFILLING, P.FINISHED),      # a finish always follows a slot (decoding)
    (P.WAITING_FOR_STATE, P.FINISHED),
    (P.FINISHED, P.FAILED),          # terminal is terminal
    (P.FAILED, P.ROUTED),
    (P.FINISHED, P.DECODING),
])
def test_illegal_transition_is_refused(frm, to):
  lc = RequestLifecycle("r2", phase=frm)
  with pytest.raises(IllegalTransition, match=f"r2: {frm} -> {to}"):
    lc.advance(to)
  assert lc.phase == frm  # unchanged


def test_table_is_closed_and_terminals_have_no_exits():
  assert set(TRANSITIONS) == set(RequestPhase)
  for frm, tos in TRANSITIONS.items():
    assert tos <= set(RequestPhase)
    assert (not tos) == (frm in TERMINAL)
  # Every non-terminal phase can fail or be cancelled.
  for frm in set(RequestPhase) - TERMINAL:
    assert {P.FAILED, P.CANCELLED} <= TRANSITIONS[frm]


def test_phase_values_are_the_getstats_strings():
  # GetStats' inflight_<phase> gauges and record "phase" keep their names.
  assert [p.value for p in RequestPhase] == [
      "received", "routed", "prefix_transfer", "prefilling", "transferring",
      "waiting_for_state", "decoding",
      "rerouted", "finished", "failed", "cancelled"]
  assert f"inflight_{P.PREFIX_SHIPPING}" == "inflight_prefix_transfer"


def test_cancel_wins_and_later_reports_are_dropped():
  lc = RequestLifecycle("r3")
  lc.advance(P.ROUTED)
  lc.advance(P.PREFILLING)
  assert lc.cancel() is True
  assert lc.phase == P.CANCELLED
  assert lc.advance(P.DECODING) is False  # a relay still holding a token
  assert lc.phase == P.CANCELLED
  assert lc.cancel() is False


def test_cancel_after_finish_is_a_no_op():
  lc = RequestLifecycle("r4")
  for to in PATHS["colocated"]:
    lc.advance(to)
  assert lc.cancel() is False
  assert lc.phase == P.FINISHED


def test_stale_attempt_reports_are_dropped_but_current_ones_apply():
  lc = RequestLifecycle("r5")
  lc.advance(P.ROUTED)
  first = lc.begin_attempt("prfaas", "d")
  lc.advance(P.PREFILLING)
  lc.fail_attempt(first, AttemptFailed(C.UNAVAILABLE, "gone", FailureCause.PREFILL))
  assert first.ended and first.cause == FailureCause.PREFILL and "UNAVAILABLE" in first.error
  # The failed attempt's follower reports its first token late: dropped.
  assert lc.advance(P.TRANSFERRING, first) is False
  lc.advance(P.REROUTED)
  second = lc.begin_attempt("pdp", "d~1")
  assert second.number == 2 and lc.attempt is second
  lc.advance(P.PREFILLING)
  assert lc.advance(P.TRANSFERRING, first) is False
  assert lc.phase == P.PREFILLING
  assert lc.advance(P.TRANSFERRING, second) is True
  assert [a.number for a in lc.attempts] == [1, 2]


def test_thread_reports_after_the_end_are_dropped_not_raised():
  lc = RequestLifecycle("r6")
  lc.advance(P.ROUTED)
  att = lc.begin_attempt("prfaas", "d")
  lc.advance(P.PREFILLING)
  lc.advance(P.FAILED)
  out = []
  t = threading.Thread(target=lambda: out.append(lc.advance(P.TRANSFERRING, att)))
  t.start()
  t.join()
  assert out == [False] and lc.phase == P.FAILED
  with pytest.raises(IllegalTransition):  # the request's own thread is not excused
    lc.advance(P.TRANSFERRING)


def test_every_transition_is_logged_with_the_request_id(caplog):
  caplog.set_level(logging.DEBUG, logger="paas_jax.serving.lifecycle")
  lc = RequestLifecycle("req-xyz")
  lc.advance(P.ROUTED)
  lc.advance(P.PREFILLING)
  moves = [r for r in caplog.records if "->" in r.getMessage()]
  assert len(moves) == 2
  assert all(r.request_id == "req-xyz" and "req-xyz" in r.getMessage() for r in moves)


def _decide(cause, code, attempt_no=1, **kw):
  facts = dict(max_attempts=3, client_gone=False, time_left_s=30.0, tokens_delivered=0,
               other_decode_healthy=True, route="prfaas", other_prefill_healthy=True)
  facts.update(kw)
  return retry_decision(cause, code, attempt_no, **facts)


def _offer(resume: bool) -> ResumeDecision:
  return ResumeDecision(resume, "pdp" if resume else "prfaas", 0, "d", 64,
                        "resume:n=64" if resume else "reprefill:n=64")


A = RetryAction
# The decision table: cause, code, facts -> action, route, resumes.
@pytest.mark.parametrize("cause,code,kw,action,route", [
    (FailureCause.PREFILL, C.UNAVAILABLE, {}, A.PREFILL_ELSEWHERE, "prfaas"),
    (FailureCause.PREFILL, C.UNAVAILABLE, {"other_prefill_healthy": False},
     A.PREFILL_LOCALLY, "pdp"),
    (FailureCause.PREFILL, C.DEADLINE_EXCEEDED, {}, A.PREFILL_ELSEWHERE, "prfaas"),
    (FailureCause.PREFILL, C.RESOURCE_EXHAUSTED, {}, A.PREFILL_ELSEWHERE, "prfaas"),
    # A commit point the resume policy takes: resume on the same decode node.
    (FailureCause.PREFILL, C.UNAVAILABLE, {"resume": _offer(True)},
     A.RESUME_FROM_COMMIT_POINT, "pdp"),
    # ... or one it does not (the router would prefill remotely): another prefill node.
    (FailureCause.PREFILL, C.UNAVAILABLE, {"resume": _offer(False)},
     A.PREFILL_ELSEWHERE, "prfaas"),
    # A damaged state: locally from scratch, whatever the commit point or other nodes.
    (FailureCause.STATE_DAMAGED, C.DATA_LOSS, {}, A.PREFILL_LOCALLY, "pdp"),
    (FailureCause.STATE_DAMAGED, C.DATA_LOSS, {"resume": _offer(True)},
     A.PREFILL_LOCALLY, "pdp"),
    (FailureCause.DECODE, C.UNAVAILABLE, {"tokens_delivered": 5},
     A.RESTART_ON_OTHER_DECODE, "prfaas"),
    (FailureCause.DECODE, C.UNAVAILABLE, {"route": "pdp"}, A.RESTART_ON_OTHER_DECODE, "pdp"),
])
def test_retried(cause, code, kw, action, route):
  d = _decide(cause, code, **kw)
  assert d.retry and d.action == action and d.route == route
  assert (d.resume is not None) == (action == A.RESUME_FROM_COMMIT_POINT)
  assert d.fallback == (route == "pdp" and action != A.RESTART_ON_OTHER_DECODE)
  assert code.name in d.reason


def test_retry_reasons_are_the_reroute_causes_the_broker_reports():
  # GetStats route_reason / reroutes and the reroute metric's label keep their text.
  assert _decide(FailureCause.DECODE, C.UNAVAILABLE).reason == "decode server down: UNAVAILABLE"
  assert (_decide(FailureCause.STATE_DAMAGED, C.DATA_LOSS).reason
          == "prefill/transfer failed: DATA_LOSS")
  assert (_decide(FailureCause.PREFILL, C.UNAVAILABLE, resume=_offer(True)).reason
          == "prefill/transfer failed: UNAVAILABLE; resume:n=64")


@pytest.mark.parametrize("cause,code,attempt_no,kw", [
    (FailureCause.REQUEST, C.UNAVAILABLE, 1, {}),
    (FailureCause.ADMISSION, C.RESOURCE_EXHAUSTED, 1, {}),
    (FailureCause.PREFILL, C.INVALID_ARGUMENT, 1, {}),
    (FailureCause.DECODE, C.RESOURCE_EXHAUSTED, 1, {}),   # full pool: no amplification
    (FailureCause.DECODE, C.DATA_LOSS, 1, {}),             # not a lost node
    (FailureCause.DECODE, C.UNAVAILABLE, 1, {"other_decode_healthy": False}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 1, {"tokens_delivered": 1}),
    (FailureCause.STATE_DAMAGED, C.DATA_LOSS, 1, {"tokens_delivered": 1}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 1, {"resume": _offer(True), "tokens_delivered": 2}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 1, {"client_gone": True}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 1, {"time_left_s": 0.1}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 3, {}),          # attempts spent
    (FailureCause.STATE_DAMAGED, C.DATA_LOSS, 3, {}),
])
def test_not_retried(cause, code, attempt_no, kw):
  d = _decide(cause, code, attempt_no, **kw)
  assert not d.retry and d.action is None and d.reason and d.resume is None


@pytest.mark.parametrize("cause,code,gone,lost", [
    (FailureCause.DECODE, C.UNAVAILABLE, False, FailureCause.DECODE),
    (FailureCause.PREFILL, C.UNAVAILABLE, False, FailureCause.PREFILL),
    (FailureCause.PREFILL, C.UNAVAILABLE, True, None),     # the client left: not the node
    (FailureCause.PREFILL, C.DEADLINE_EXCEEDED, False, None),
    (FailureCause.STATE_DAMAGED, C.DATA_LOSS, False, None),  # the node answered
    (FailureCause.REQUEST, C.UNAVAILABLE, False, None),
])
def test_lost_node(cause, code, gone, lost):
  assert lost_node(cause, code, gone) == lost


def _remote(rid: str):
  lc = RequestLifecycle(rid)
  lc.advance(P.ROUTED)
  att = lc.begin_attempt("prfaas", rid)
  lc.advance(P.PREFILLING)
  lc.advance(P.TRANSFERRING, att)
  return lc, att


def test_waiting_for_state_between_handoff_and_slot():
  lc, att = _remote("w1")
  assert lc.state_awaited(att) is True and lc.phase == P.WAITING_FOR_STATE
  assert lc.state_restored() is True and lc.phase == P.DECODING
  assert lc.phases == (P.RECEIVED, P.ROUTED, P.PREFILLING, P.TRANSFERRING,
                       P.WAITING_FOR_STATE, P.DECODING)
  times = [t for _, t in lc.history]
  assert times == sorted(times)


def test_slot_before_the_handoff_answer_still_passes_waiting_for_state():
  # The relay sees the slot before the follower reports the Handoff's answer:
  # the slot proves the handoff happened, so the walk keeps its order and the
  # follower's late report is dropped, not raised.
  lc, att = _remote("w2")
  assert lc.state_restored() is True
  assert lc.phases[-2:] == (P.WAITING_FOR_STATE, P.DECODING)
  assert lc.state_awaited(att) is False and lc.phase == P.DECODING
  assert lc.phases.count(P.WAITING_FOR_STATE) == 1


def test_state_awaited_by_a_stale_attempt_or_outside_transferring_is_dropped():
  lc, att = _remote("w3")
  lc.fail_attempt(att, AttemptFailed(C.DATA_LOSS, "probe", FailureCause.PREFILL))
  assert lc.state_awaited(att) is False and lc.phase == P.TRANSFERRING
  lc2 = RequestLifecycle("w4")
  lc2.advance(P.ROUTED)
  att2 = lc2.begin_attempt("pdp", "w4")
  lc2.advance(P.PREFILLING)  # colocated: no handoff, a late report changes nothing
  assert lc2.state_awaited(att2) is False and lc2.phase == P.PREFILLING
  assert lc2.state_restored() is True and lc2.phases[-1] == P.DECODING
  with pytest.raises(IllegalTransition):  # a slot out of order is a bug, not a drop
    RequestLifecycle("w5", phase=P.ROUTED).state_restored()


def test_waiting_for_state_is_logged_with_the_request_id(caplog):
  caplog.set_level(logging.DEBUG, logger="paas_jax.serving.lifecycle")
  lc, att = _remote("req-wait")
  lc.state_awaited(att)
  lc.state_restored()
  moves = [r.getMessage() for r in caplog.records
           if getattr(r, "request_id", "") == "req-wait" and "->" in r.getMessage()]
  assert moves[-2:] == ["request req-wait: transferring -> waiting_for_state (handoff answered)",
                        "request req-wait: waiting_for_state -> decoding (state restored)"]
