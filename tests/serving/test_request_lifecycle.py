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
                                                retry_decision)

P = RequestPhase
C = grpc.StatusCode

# The walks the broker takes (module docstring), each must be accepted.
PATHS = {
    "colocated": [P.ROUTED, P.PREFILLING, P.DECODING, P.FINISHED],
    "remote": [P.ROUTED, P.PREFILLING, P.TRANSFERRING, P.DECODING, P.FINISHED],
    "prefix_shipped": [P.ROUTED, P.PREFIX_SHIPPING, P.ROUTED, P.PREFILLING, P.DECODING,
                       P.FINISHED],
    "no_prefill_server": [P.ROUTED, P.REROUTED, P.PREFILLING, P.DECODING, P.FINISHED],
    # Decode node lost mid-stream: restarted, the client already has the first token.
    "restart": [P.ROUTED, P.PREFILLING, P.TRANSFERRING, P.DECODING, P.REROUTED, P.PREFILLING,
                P.TRANSFERRING, P.FINISHED],
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
      "received", "routed", "prefix_transfer", "prefilling", "transferring", "decoding",
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
               other_decode_healthy=True)
  facts.update(kw)
  return retry_decision(cause, code, attempt_no, **facts)


@pytest.mark.parametrize("cause,code,kw,action", [
    (FailureCause.PREFILL, C.UNAVAILABLE, {}, RetryAction.PREFILL_ELSEWHERE),
    (FailureCause.PREFILL, C.DATA_LOSS, {}, RetryAction.PREFILL_ELSEWHERE),
    (FailureCause.PREFILL, C.RESOURCE_EXHAUSTED, {}, RetryAction.PREFILL_ELSEWHERE),
    (FailureCause.DECODE, C.UNAVAILABLE, {"tokens_delivered": 5},
     RetryAction.RESTART_ON_OTHER_DECODE),
])
def test_retried(cause, code, kw, action):
  d = _decide(cause, code, **kw)
  assert d.retry and d.action == action


@pytest.mark.parametrize("cause,code,attempt_no,kw", [
    (FailureCause.REQUEST, C.UNAVAILABLE, 1, {}),
    (FailureCause.ADMISSION, C.RESOURCE_EXHAUSTED, 1, {}),
    (FailureCause.PREFILL, C.INVALID_ARGUMENT, 1, {}),
    (FailureCause.DECODE, C.RESOURCE_EXHAUSTED, 1, {}),   # full pool: no amplification
    (FailureCause.DECODE, C.DATA_LOSS, 1, {}),             # not a lost node
    (FailureCause.DECODE, C.UNAVAILABLE, 1, {"other_decode_healthy": False}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 1, {"tokens_delivered": 1}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 1, {"client_gone": True}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 1, {"time_left_s": 0.1}),
    (FailureCause.PREFILL, C.UNAVAILABLE, 3, {}),          # attempts spent
])
def test_not_retried(cause, code, attempt_no, kw):
  d = _decide(cause, code, attempt_no, **kw)
  assert not d.retry and d.action is None and d.reason
