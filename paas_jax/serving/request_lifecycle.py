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
  TRANSFERRING    remote routes: the first token is known and handed to the
     |            decode node, which waits for the remote state while it
     |            streams in (the "waiting for the remote state" phase);
     |            a colocated prefill goes PREFILLING -> DECODING directly
  DECODING        the first token reached the client; tokens stream back
     |
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
circumstances into a ``RetryDecision`` (retry or not, and how). Progress
reports from an attempt that is no longer current (a stale prefill follower
after a reroute) are dropped the same way as after a cancel.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
import uuid

import grpc

from paas_jax.proto import serving_pb2

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
  DECODING = "decoding"
  REROUTED = "rerouted"
  FINISHED = "finished"
  FAILED = "failed"
  CANCELLED = "cancelled"


P = RequestPhase
TERMINAL = frozenset({P.FINISHED, P.FAILED, P.CANCELLED})
_ENDINGS = frozenset({P.FAILED, P.CANCELLED})
# Allowed moves: phase -> the phases it may go to. FINISHED is reachable from
# PREFILLING / TRANSFERRING too: a restarted request whose first token the
# client already has never re-enters DECODING (and a stream may finish before
# any token, e.g. max_new_tokens reached by the prefill's own token).
TRANSITIONS: dict[RequestPhase, frozenset[RequestPhase]] = {
    P.RECEIVED: frozenset({P.ROUTED}) | _ENDINGS,
    P.ROUTED: frozenset({P.PREFIX_SHIPPING, P.PREFILLING, P.REROUTED}) | _ENDINGS,
    P.PREFIX_SHIPPING: frozenset({P.ROUTED}) | _ENDINGS,
    P.PREFILLING: frozenset({P.TRANSFERRING, P.DECODING, P.FINISHED, P.REROUTED}) | _ENDINGS,
    P.TRANSFERRING: frozenset({P.DECODING, P.FINISHED, P.REROUTED}) | _ENDINGS,
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
  # The prefill node or the state transfer: prefill again elsewhere.
  PREFILL = "prefill"


class RetryAction(enum.StrEnum):
  # Same route, another decode node; the tokens already sent are regenerated
  # (sampling is keyed by seed and position) and checked, not resent.
  RESTART_ON_OTHER_DECODE = "restart_on_other_decode"
  # Another healthy prefill server, else PD-P in the PD region.
  PREFILL_ELSEWHERE = "prefill_elsewhere"


@dataclasses.dataclass(frozen=True)
class RetryDecision:
  retry: bool
  reason: str
  action: RetryAction | None = None


def retry_decision(cause: FailureCause, code: grpc.StatusCode, attempt_no: int, *,
                   max_attempts: int, client_gone: bool, time_left_s: float,
                   tokens_delivered: int, other_decode_healthy: bool) -> RetryDecision:
  """Whether attempt ``attempt_no`` (1 = the first) that failed with ``cause``
  and ``code`` is tried again, and how. Pure: the caller supplies the facts
  (time left of the client's deadline, tokens the client already has, whether
  another healthy decode node exists)."""
  if client_gone:
    return RetryDecision(False, "client gone")
  if cause in (FailureCause.REQUEST, FailureCause.ADMISSION):
    return RetryDecision(False, f"{cause} failure is never retried")
  if code == Code.INVALID_ARGUMENT:
    return RetryDecision(False, "invalid argument")
  if code == Code.RESOURCE_EXHAUSTED and cause != FailureCause.PREFILL:
    return RetryDecision(False, "decode pool full: retrying would amplify overload")
  if time_left_s < MIN_RETRY_TIME_S:
    return RetryDecision(False, "client deadline nearly spent")
  if cause == FailureCause.DECODE:
    if code != Code.UNAVAILABLE:
      return RetryDecision(False, f"decode failure {code.name} is not a lost node")
    if not other_decode_healthy:
      return RetryDecision(False, "no other healthy decode node")
    action = RetryAction.RESTART_ON_OTHER_DECODE
  else:
    if tokens_delivered:
      return RetryDecision(False, "tokens already reached the client")
    action = RetryAction.PREFILL_ELSEWHERE
  if attempt_no >= max_attempts:
    return RetryDecision(False, f"{max_attempts} attempts spent")
  return RetryDecision(True, f"{cause} failure {code.name}", action)


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
  prefill follower thread and the cancel callback all report here)."""

  def __init__(self, request_id: str, phase: RequestPhase = RequestPhase.RECEIVED):
    self.request_id = request_id
    self._phase = RequestPhase(phase)
    self._attempts: list[Attempt] = []
    self._lock = threading.Lock()

  @property
  def phase(self) -> RequestPhase:
    return self._phase

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

  def advance(self, to: RequestPhase, attempt: Attempt | None = None) -> bool:
    """Moves to ``to``; raises ``IllegalTransition`` for a move ``TRANSITIONS``
    does not allow. Returns False (and changes nothing) after a cancel, and
    for a report on behalf of ``attempt`` (another thread's, e.g. the prefill
    follower) once that attempt ended or the request did: a stale report."""
    with self._lock:
      frm = self._phase
      stale = attempt is not None and (attempt.ended or frm in TERMINAL
                                       or attempt is not self._attempts[-1])
      if frm == RequestPhase.CANCELLED or stale:
        log.debug("request %s: %s -> %s dropped (%s)", self.request_id, frm, to,
                  "stale attempt" if stale else "cancelled",
                  extra={"request_id": self.request_id})
        return False
      if to not in TRANSITIONS[frm]:
        raise IllegalTransition(f"request {self.request_id}: {frm} -> {to} is not allowed")
      self._phase = to
    log.debug("request %s: %s -> %s", self.request_id, frm, to,
              extra={"request_id": self.request_id})
    return True

  def cancel(self) -> bool:
    """The client went away: CANCELLED unless already terminal (returns whether
    it moved; the check and the move are one step, so a request that just
    finished is never marked cancelled)."""
    with self._lock:
      frm = self._phase
      if frm in TERMINAL:
        return False
      self._phase = RequestPhase.CANCELLED
    log.debug("request %s: %s -> %s", self.request_id, frm, RequestPhase.CANCELLED,
              extra={"request_id": self.request_id})
    return True

  def fail_attempt(self, attempt: Attempt, err: AttemptFailed) -> None:
    """Ends ``attempt`` with ``err``: later reports on its behalf are dropped."""
    with self._lock:
      attempt.cause, attempt.error = err.cause, f"{err.code.name}: {err.message}"
      attempt.ended = True
    log.debug("request %s: attempt %d failed (%s): %s", self.request_id, attempt.number,
              err.cause, attempt.error, extra={"request_id": self.request_id})


@dataclasses.dataclass
class RequestRecord:
  """One request's lifecycle at the broker."""

  request_id: str
  prompt_tokens: int
  max_new_tokens: int
  # Id of the request at the regions (decode job, transfer): unique per
  # attempt even when a client reuses its own request ids.
  downstream_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
  created: float = dataclasses.field(default_factory=time.time)
  t0: float = dataclasses.field(default_factory=time.perf_counter)
  route: str = ""
  route_reason: str = ""
  threshold: float = 0.0
  decode_server: str = ""
  prefill_server: str = ""
  first_token_s: float = 0.0
  prefill_s: float = 0.0
  prefill_queue_s: float = 0.0
  prefill_batch_size: int = 0
  # Routing inputs/outputs (adaptive router) and the prefix reused by the
  # server that prefilled (cached_tokens, as it reports it).
  l_pd_cached: int = 0
  l_prfaas_cached: int = 0
  prefix_source: str = ""
  bandwidth_mode: str = ""
  cached_tokens: int = 0
  # Cross-cluster prefix transfer before the prefill (abundant link, longer
  # prefix in the other region): direction ("prfaas->pdp" | "pdp->prfaas"),
  # what crossed, and why it did not ("CODE: message"; the request then
  # prefilled without it).
  prefix_transfer: str = ""
  prefix_transfer_tokens: int = 0
  prefix_transfer_bytes: int = 0
  prefix_transfer_s: float = 0.0
  prefix_transfer_error: str = ""
  prefix_node: int = -1  # the PD node a prefix was shipped to (its PD-P should prefill)
  transfer_s: float = 0.0
  decode_queue_s: float = 0.0
  link_bytes: int = 0
  state_bytes: int = 0
  generated: int = 0
  finish_reason: str = ""
  error: str = ""
  total_s: float = 0.0
  client_gone: bool = False
  # Route pdp prefilled on a PD-P node and decoded on another (PD-D) node: the
  # state moved like a PrfaaS one, inside region B.
  pd_split: bool = False
  reroutes: list = dataclasses.field(default_factory=list)
  # Tokens already sent to the client: a restarted request must reproduce
  # them (sampling is keyed by seed and position) and only sends what follows.
  delivered: list = dataclasses.field(default_factory=list)
  prefill_error: tuple | None = None
  prefill_done: threading.Event = dataclasses.field(default_factory=threading.Event)
  # Chunk-pipelined transfer (resume.py): the last commit point region A
  # reported; a resumed attempt's earlier id and the prompt tokens it did not
  # recompute (resumed_tokens) and recomputed.
  commit_point: int = 0
  resumed_from: str = ""
  resumed_tokens: int = 0
  recomputed_tokens: int = 0
  # The phase and attempts (request_lifecycle.py); default: a new request.
  lifecycle: RequestLifecycle | None = None

  def __post_init__(self):
    if self.lifecycle is None:
      self.lifecycle = RequestLifecycle(self.request_id)

  @property
  def phase(self) -> RequestPhase:
    return self.lifecycle.phase

  @property
  def attempts(self) -> int:
    return len(self.lifecycle.attempts)

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def summary(self) -> serving_pb2.RequestSummary:
    return serving_pb2.RequestSummary(
        request_id=self.request_id, route=self.route, route_reason=self.route_reason,
        prompt_tokens=self.prompt_tokens, threshold_tokens=self.threshold,
        prefill_server=self.prefill_server, decode_server=self.decode_server,
        first_token_s=self.first_token_s, prefill_s=self.prefill_s,
        prefill_queue_s=self.prefill_queue_s, transfer_s=self.transfer_s,
        decode_queue_s=self.decode_queue_s, link_bytes=self.link_bytes,
        state_bytes=self.state_bytes, generated_tokens=self.generated,
        total_s=self.total_s, finish_reason=self.finish_reason,
        prefill_batch_size=self.prefill_batch_size, cached_tokens=self.cached_tokens,
        prefix_source=self.prefix_source, prefix_transfer_tokens=self.prefix_transfer_tokens,
        prefix_transfer_bytes=self.prefix_transfer_bytes,
        prefix_transfer_s=self.prefix_transfer_s, commit_point=self.commit_point,
        resumed_tokens=self.resumed_tokens, recomputed_tokens=self.recomputed_tokens)

  def to_dict(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
         if f.name not in ("t0", "prefill_done", "prefill_error", "delivered", "lifecycle")}
    d["phase"], d["attempts"] = self.phase.value, self.attempts
    d["prefill_error"] = None if self.prefill_error is None else (
        f"{self.prefill_error[0].name}: {self.prefill_error[1]}")
    return d
