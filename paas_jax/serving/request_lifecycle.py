"""A request's life at the broker: phases, attempts, failure causes, retries.

One ``RequestLifecycle`` per ``Generate`` call owns the request's phase; every
other part of the broker asks it to move (``advance``), and an illegal move
raises ``IllegalTransition`` instead of silently overwriting a string. Every
move is logged (DEBUG, logger ``paas_jax.serving.lifecycle``) with the
request id. The phase strings are the ones GetStats has always reported
(``inflight_<phase>`` gauges, the ``phase`` of each in-flight/recent record).

A request's walk through the phases (``RequestPhase``):

  RECEIVED        validated and registered, waiting for its routing decision
     |            (the broker's "queued" state; nothing downstream yet)
  ROUTED          the policy chose a route: pdp (prefill in the PD region) or
     |            prfaas (prefill in the prefill region, state over the link)
     |-- PREFIX_SHIPPING   optional: the router wants the longer cached prefix
     |   (-> ROUTED)       of the other region shipped first (ExportPrefix);
     |                     success or not, the request goes back to ROUTED
  PREFILLING      an attempt runs: the decode node admitted the request (remote
     |            routes) and a prefill node computes the prompt's state
  TRANSFERRING    remote routes: the prefill node sampled the first token and
     |            the state streams to the decode node; the broker hands the
     |            token over (Handoff)
  WAITING_FOR_STATE  remote routes: the Handoff was answered: the decode node
     |            has the request and its first token (streamed to the client
     |            at once when first-token-early is on) and waits for the
     |            remote state to land, pass its checks and be restored into a
     |            decode slot; a damaged state fails here (DATA_LOSS)
  DECODING        the decode node restored the state into a slot (its
     |            DecodeEvent with the slot); tokens stream back. A colocated
     |            (or resumed) prefill goes PREFILLING -> DECODING directly
  FINISHED        the decode stream ended with a finish reason (terminal)

  Off the main path:
  REROUTED        an attempt failed with a retryable ``FailureCause`` (or no
                  healthy prefill server was left): a new ``Attempt`` starts
                  (back to PREFILLING), possibly on another route
  FAILED          the request ended with a gRPC error (terminal)
  CANCELLED       the client went away (cancel, deadline, dropped connection);
                  terminal, and "cancel wins": worker threads still holding the
                  request may report progress afterwards, which is dropped
                  (``advance`` returns False) rather than raised

Each try is an ``Attempt`` (route, prefill node, decode node, downstream id).
A failed attempt carries a ``FailureCause`` (where it failed); the pure
function ``retry_decision`` turns cause, status code and the request's
circumstances (including the resume policy's view of its commit point) into a
``RetryDecision`` (retry or not, how, on which route); ``lost_node`` says
which node goes out of routing. Progress
reports from an attempt that is no longer current (a stale prefill follower
after a reroute) are dropped the same way as after a cancel.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time

import grpc

from paas_jax.serving.resume import ResumeDecision
from paas_jax.serving.routing import PDP, PRFAAS

log = logging.getLogger("paas_jax.serving.lifecycle")

Code = grpc.StatusCode
# Below this much of the client's deadline left, a failed attempt is not retried.
MIN_RETRY_TIME_S = 0.5


class RequestPhase(enum.StrEnum):
  """Where a request is (module docstring); values are GetStats' strings."""

  RECEIVED = "received"
  ROUTED = "routed"
  PREFIX_SHIPPING = "prefix_transfer"
  PREFILLING = "prefilling"
  TRANSFERRING = "transferring"
  WAITING_FOR_STATE = "waiting_for_state"
  DECODING = "decoding"
  REROUTED = "rerouted"
  FINISHED = "finished"
  FAILED = "failed"
  CANCELLED = "cancelled"


P = RequestPhase
TERMINAL = frozenset({P.FINISHED, P.FAILED, P.CANCELLED})
_ENDINGS = frozenset({P.FAILED, P.CANCELLED})
# Allowed moves: phase -> the phases it may go to. DECODING needs the decode
# node's slot event, which always comes before a stream's finish, so FINISHED
# is reached from DECODING only (a restarted request whose client already has
# its first tokens re-enters DECODING when its new slot is taken).
TRANSITIONS: dict[RequestPhase, frozenset[RequestPhase]] = {
    P.RECEIVED: frozenset({P.ROUTED}) | _ENDINGS,
    P.ROUTED: frozenset({P.PREFIX_SHIPPING, P.PREFILLING, P.REROUTED}) | _ENDINGS,
    P.PREFIX_SHIPPING: frozenset({P.ROUTED}) | _ENDINGS,
    P.PREFILLING: frozenset({P.TRANSFERRING, P.DECODING, P.REROUTED}) | _ENDINGS,
    P.TRANSFERRING: frozenset({P.WAITING_FOR_STATE, P.REROUTED}) | _ENDINGS,
    P.WAITING_FOR_STATE: frozenset({P.DECODING, P.REROUTED}) | _ENDINGS,
    P.DECODING: frozenset({P.FINISHED, P.REROUTED}) | _ENDINGS,
    P.REROUTED: frozenset({P.REROUTED, P.PREFIX_SHIPPING, P.PREFILLING}) | _ENDINGS,
    P.FINISHED: frozenset(),
    P.FAILED: frozenset(),
    P.CANCELLED: frozenset(),
}


class FailureCause(enum.StrEnum):
  """Where an attempt failed; with the status code it decides the retry."""

  # The request itself (bad argument, refused by a server's validation): never retried.
  REQUEST = "request"
  # A full decode pool (RESOURCE_EXHAUSTED at admission): not retried, that
  # would amplify the overload.
  ADMISSION = "admission"
  # The decode node (its connection broke): restart from a prefill on another one.
  DECODE = "decode"
  # The prefill node or the state transfer: resume from a commit point, or
  # prefill again elsewhere.
  PREFILL = "prefill"
  # A streamed state arrived damaged (DATA_LOSS: a chunk that failed its
  # checksum for good, or a state that failed the logit probe at the
  # handoff): its commit points are not trusted either, so the request is
  # prefilled again locally from scratch, never resumed or sent over the same
  # path again.
  STATE_DAMAGED = "state_damaged"


class RetryAction(enum.StrEnum):
  # Same route, another decode node; the tokens already sent are regenerated
  # (sampling is keyed by seed and position) and checked, not resent.
  RESTART_ON_OTHER_DECODE = "restart_on_other_decode"
  # The same decode node prefills locally (PD-P) from the commit point it holds
  # (resume.py); only the rest of the prompt is computed again.
  RESUME_FROM_COMMIT_POINT = "resume_from_commit_point"
  # Another healthy prefill server in the prefill region (route prfaas).
  PREFILL_ELSEWHERE = "prefill_elsewhere"
  # PD-P in the PD region, from scratch (route pdp).
  PREFILL_LOCALLY = "prefill_locally"


# The route each retry action takes (RESTART_ON_OTHER_DECODE keeps the failed one).
_ACTION_ROUTE = {RetryAction.RESUME_FROM_COMMIT_POINT: PDP,
                 RetryAction.PREFILL_ELSEWHERE: PRFAAS,
                 RetryAction.PREFILL_LOCALLY: PDP}


@dataclasses.dataclass(frozen=True)
class RetryDecision:
  """``retry``: try again with ``action`` on ``route``; ``resume``: the resume
  policy's decision to act on (RESUME_FROM_COMMIT_POINT only). ``reason``:
  why (not); for a retry, the reroute cause GetStats and the metrics show."""

  retry: bool
  reason: str
  action: RetryAction | None = None
  route: str = ""
  resume: ResumeDecision | None = None

  @property
  def fallback(self) -> bool:
    """The prefill moves to the PD region because of the failure."""
    return self.action in (RetryAction.RESUME_FROM_COMMIT_POINT, RetryAction.PREFILL_LOCALLY)


def retry_decision(cause: FailureCause, code: grpc.StatusCode, attempt_no: int, *,
                   max_attempts: int, client_gone: bool, time_left_s: float,
                   tokens_delivered: int, other_decode_healthy: bool, route: str = "",
                   other_prefill_healthy: bool = False,
                   resume: ResumeDecision | None = None) -> RetryDecision:
  """Whether attempt ``attempt_no`` (1 = the first) on ``route`` that failed
  with ``cause`` and ``code`` is tried again, and how. Pure: the caller
  supplies the facts (time left of the client's deadline, tokens the client
  already has, whether another healthy decode / prefill node exists, and
  ``resume``: what ``ResumePolicy.decide`` says of the failed attempt's commit
  point, None when it is not resumable). The whole policy is here: a prefill
  failure resumes when the resume policy says so, else prefills on another
  prefill server if there is one, else locally; a damaged state
  (STATE_DAMAGED) always prefills locally from scratch."""
  if client_gone:
    return RetryDecision(False, "client gone")
  if cause in (FailureCause.REQUEST, FailureCause.ADMISSION):
    return RetryDecision(False, f"{cause} failure is never retried")
  if code == Code.INVALID_ARGUMENT:
    return RetryDecision(False, "invalid argument")
  if code == Code.RESOURCE_EXHAUSTED and cause == FailureCause.DECODE:
    return RetryDecision(False, "decode pool full: retrying would amplify overload")
  if time_left_s < MIN_RETRY_TIME_S:
    return RetryDecision(False, "client deadline nearly spent")
  reason, chosen = f"prefill/transfer failed: {code.name}", None
  if cause == FailureCause.DECODE:
    if code != Code.UNAVAILABLE:
      return RetryDecision(False, f"decode failure {code.name} is not a lost node")
    if not other_decode_healthy:
      return RetryDecision(False, "no other healthy decode node")
    action, reason = RetryAction.RESTART_ON_OTHER_DECODE, f"decode server down: {code.name}"
  elif tokens_delivered:
    return RetryDecision(False, "tokens already reached the client")
  elif cause == FailureCause.STATE_DAMAGED:
    action = RetryAction.PREFILL_LOCALLY  # its commit points are not trusted
  elif resume is not None and resume.resume:
    action, chosen, reason = (RetryAction.RESUME_FROM_COMMIT_POINT, resume,
                              f"{reason}; {resume.reason}")
  else:
    action = (RetryAction.PREFILL_ELSEWHERE if other_prefill_healthy
              else RetryAction.PREFILL_LOCALLY)
  if attempt_no >= max_attempts:
    return RetryDecision(False, f"{max_attempts} attempts spent")
  return RetryDecision(True, reason, action, _ACTION_ROUTE.get(action, route), chosen)


def lost_node(cause: FailureCause, code: grpc.StatusCode, client_gone: bool
              ) -> FailureCause | None:
  """Which side's node a failed attempt lost (DECODE or PREFILL; it goes out of
  routing until a health probe succeeds), or None: only UNAVAILABLE (its
  connection broke) while the client is still there."""
  if code != Code.UNAVAILABLE or client_gone:
    return None
  return cause if cause in (FailureCause.DECODE, FailureCause.PREFILL) else None


class AttemptFailed(Exception):
  """Ends an attempt (and, unless retried, the request) with ``code``."""

  def __init__(self, code: grpc.StatusCode, message: str,
               cause: FailureCause = FailureCause.REQUEST):
    super().__init__(message)
    self.code, self.message, self.cause = code, message, cause


@dataclasses.dataclass
class Attempt:
  """One try of a request. Nodes are addresses ("" until picked); ``pd_split``:
  route pdp prefilled on a PD-P node and decoded on another PD node."""

  number: int  # 1 = the first
  route: str
  downstream_id: str  # the request's id at the regions for this attempt
  prefill_node: str = ""
  decode_node: str = ""
  pd_split: bool = False
  cause: FailureCause | None = None
  error: str = ""
  ended: bool = False


class IllegalTransition(RuntimeError):
  pass


class RequestLifecycle:
  """The phase and attempts of one request; thread-safe (the gRPC thread, the
  prefill follower thread and the cancel callback all report here).
  ``history``: every phase entered, in order, with its ``time.monotonic()``."""

  def __init__(self, request_id: str, phase: RequestPhase = RequestPhase.RECEIVED):
    self.request_id = request_id
    self._phase = RequestPhase(phase)
    self._history: list[tuple[RequestPhase, float]] = [(self._phase, time.monotonic())]
    self._attempts: list[Attempt] = []
    self._lock = threading.Lock()

  @property
  def phase(self) -> RequestPhase:
    return self._phase

  @property
  def history(self) -> tuple[tuple[RequestPhase, float], ...]:
    with self._lock:
      return tuple(self._history)

  @property
  def phases(self) -> tuple[RequestPhase, ...]:
    """The phases entered so far, in order (the first is the starting phase)."""
    return tuple(p for p, _ in self.history)

  @property
  def attempts(self) -> tuple[Attempt, ...]:
    with self._lock:
      return tuple(self._attempts)

  @property
  def attempt(self) -> Attempt | None:
    """The current attempt (None before the first)."""
    with self._lock:
      return self._attempts[-1] if self._attempts else None

  @property
  def terminal(self) -> bool:
    return self._phase in TERMINAL

  def begin_attempt(self, route: str, downstream_id: str) -> Attempt:
    with self._lock:
      att = Attempt(number=len(self._attempts) + 1, route=route, downstream_id=downstream_id)
      self._attempts.append(att)
    log.debug("request %s: attempt %d (%s, %s)", self.request_id, att.number, route,
              downstream_id, extra={"request_id": self.request_id})
    return att

  def _dropped(self, frm: RequestPhase, to: RequestPhase, attempt: Attempt | None) -> bool:
    """Whether a move to ``to`` is dropped (lock held): after a cancel, or a
    report on behalf of an attempt that ended or is no longer current."""
    stale = attempt is not None and (attempt.ended or frm in TERMINAL
                                     or attempt is not self._attempts[-1])
    if frm == RequestPhase.CANCELLED or stale:
      log.debug("request %s: %s -> %s dropped (%s)", self.request_id, frm, to,
                "stale attempt" if stale else "cancelled",
                extra={"request_id": self.request_id})
      return True
    return False

  def _move(self, to: RequestPhase, why: str = "") -> None:
    """Moves to ``to`` (lock held; the caller checked ``TRANSITIONS``) and logs it."""
    frm, self._phase = self._phase, to
    self._history.append((to, time.monotonic()))
    log.debug("request %s: %s -> %s%s", self.request_id, frm, to, f" ({why})" if why else "",
              extra={"request_id": self.request_id, "phase": to.value})

  def advance(self, to: RequestPhase, attempt: Attempt | None = None) -> bool:
    """Moves to ``to``; raises ``IllegalTransition`` for a move ``TRANSITIONS``
    does not allow. Returns False (and changes nothing) after a cancel, and
    for a report on behalf of ``attempt`` (another thread's, e.g. the prefill
    follower) once that attempt ended or the request did: a stale report."""
    with self._lock:
      frm = self._phase
      if self._dropped(frm, to, attempt):
        return False
      if to not in TRANSITIONS[frm]:
        raise IllegalTransition(f"request {self.request_id}: {frm} -> {to} is not allowed")
      self._move(to)
    return True

  def state_awaited(self, attempt: Attempt) -> bool:
    """The prefill follower's Handoff was answered: the decode node holds the
    request and its first token and waits for the remote state
    (TRANSFERRING -> WAITING_FOR_STATE). If the relay already saw the state
    restored (``state_restored`` moved on through WAITING_FOR_STATE), this
    late report is dropped: returns False."""
    with self._lock:
      frm = self._phase
      if self._dropped(frm, RequestPhase.WAITING_FOR_STATE, attempt):
        return False
      if frm != RequestPhase.TRANSFERRING:
        log.debug("request %s: handoff answered in %s (already past)", self.request_id, frm,
                  extra={"request_id": self.request_id})
        return False
      self._move(RequestPhase.WAITING_FOR_STATE, "handoff answered")
    return True

  def state_restored(self) -> bool:
    """The decode node restored the state into a slot (its slot event): DECODING.
    From TRANSFERRING it goes through WAITING_FOR_STATE first: a slot proves
    the decode node had the first token (it takes a slot only after the
    Handoff), whose answer the follower thread has not reported yet."""
    with self._lock:
      frm = self._phase
      if self._dropped(frm, RequestPhase.DECODING, None):
        return False
      if frm == RequestPhase.TRANSFERRING:
        self._move(RequestPhase.WAITING_FOR_STATE, "slot before the handoff's answer")
      elif RequestPhase.DECODING not in TRANSITIONS[frm]:
        raise IllegalTransition(
            f"request {self.request_id}: {frm} -> {RequestPhase.DECODING} is not allowed")
      self._move(RequestPhase.DECODING, "state restored")
    return True

  def cancel(self) -> bool:
    """The client went away: CANCELLED unless already terminal (returns whether
    it moved; the check and the move are one step, so a request that just
    finished is never marked cancelled)."""
    with self._lock:
      if self._phase in TERMINAL:
        return False
      self._move(RequestPhase.CANCELLED)
    return True

  def fail_attempt(self, attempt: Attempt, err: AttemptFailed) -> None:
    """Ends ``attempt`` with ``err``: later reports on its behalf are dropped."""
    with self._lock:
      attempt.cause, attempt.error = err.cause, f"{err.code.name}: {err.message}"
      attempt.ended = True
    log.debug("request %s: attempt %d failed (%s): %s", self.request_id, attempt.number,
              err.cause, attempt.error, extra={"request_id": self.request_id})
