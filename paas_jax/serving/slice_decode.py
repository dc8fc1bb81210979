"""A decode slice's requests and their state parts (every slice process).

Region B's decode server as a slice of Q processes (one JAX program over a
``tp`` mesh of every process's devices; ``slice_decode_server``). Each slice
process serves its own StateTransfer port: a prefill pod streams to slice
process q exactly the shard bytes q needs for the slice's mesh (transfer ids
``pod:<request>:<p>-><q>``, ``pod_transfer``), which ``SliceParts`` keeps,
verified, until the request is admitted to the slice's batch, and says
through ``on_status`` when a request's parts are all in (or failed), so that
process 0 admits a remote request only once every process can restore it
(``slice_batch.ReadyBoard``). A ``SliceJob`` is one request as every process
sees it; ``slice_batch.SliceBatch`` decodes the jobs, continuously batched.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Callable

import grpc

from paas_jax.codec.shard_plan import ShardPlanError
from paas_jax.models.api import SamplingParams
from paas_jax.serving import pod_transfer
from paas_jax.serving.validation import RequestParams
from paas_jax.state import logit_probe

# Parts of a request that no job took (its RPC ended first) are dropped after this long.
PARTS_TTL_S = 300.0
_POLL_S = 0.2


def decode_capacity(prompt_len: int, max_new_tokens: int) -> int:
  """Positions of a request's decode state: a power of two above what it
  writes (prompt and every fed token), so a slice compiles one step program
  per octave of context rather than one per request length."""
  return logit_probe.probe_capacity(prompt_len + max_new_tokens)


@dataclasses.dataclass(frozen=True)
class SliceJob:
  """One request as every slice process sees it (JSON through the key-value store).

  ``prompt``: the prompt of a local prefill; empty for a remote request, whose
  state the pod streams (``first_token``: the Handoff's; ``probe``: the
  prefill side's ``LogitProbe`` fields, None: unverified). ``logprobs``:
  ``RequestParams.logprobs`` (-1: none).
  """

  number: int
  request_id: str
  prompt_len: int
  max_new_tokens: int
  prompt: tuple[int, ...] = ()
  first_token: int = -1
  probe: dict | None = None
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: tuple[int, ...] = ()
  logprobs: int = -1

  @property
  def remote(self) -> bool:
    return not self.prompt

  @property
  def params(self) -> RequestParams:
    return RequestParams(sampling=SamplingParams(self.temperature, self.top_k, self.top_p),
                         seed=self.seed, max_new_tokens=self.max_new_tokens,
                         stop_tokens=self.stop_tokens, logprobs=self.logprobs)

  @classmethod
  def from_request(cls, number: int, request_id: str, prompt_len: int, params: RequestParams,
                   *, prompt=(), first_token: int = -1,
                   probe: logit_probe.LogitProbe | None = None) -> "SliceJob":
    s = params.sampling
    return cls(number, request_id, prompt_len, params.max_new_tokens, tuple(prompt),
               first_token, None if probe is None else _probe_fields(probe),
               s.temperature, s.top_k, s.top_p, params.seed, tuple(params.stop_tokens),
               params.logprobs)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, data: str) -> "SliceJob":
    return cls.from_dict(json.loads(data))

  @classmethod
  def from_dict(cls, d: dict) -> "SliceJob":
    d = dict(d)
    d["prompt"] = tuple(int(t) for t in d["prompt"])
    d["stop_tokens"] = tuple(int(t) for t in d["stop_tokens"])
    return cls(**d)

  @property
  def logit_probe(self) -> logit_probe.LogitProbe | None:
    if self.probe is None:
      return None
    p = self.probe
    return logit_probe.LogitProbe(int(p["token"]), tuple(p["ids"]), tuple(p["values"]),
                                  str(p["dtype"]))


def _probe_fields(probe: logit_probe.LogitProbe) -> dict:
  """The probe as it reads back from JSON (lists, not tuples)."""
  return {"token": int(probe.token), "ids": [int(i) for i in probe.ids],
          "values": [float(v) for v in probe.values], "dtype": str(probe.dtype)}


class SliceReceiveError(Exception):
  """This slice process could not take a request's parts (``code``: gRPC code name)."""

  def __init__(self, code: str, message: str):
    super().__init__(message)
    self.code = code
    self.message = message


# on_status(request_id, verdict): {"ok": True} once every part of the request is
# in, {"ok": False, "code": ..., "error": ...} once one failed, None once the
# request's parts are gone (taken, dropped or expired).
StatusCallback = Callable[[str, dict | None], None]


def _no_status(request_id: str, verdict: dict | None) -> None:
  del request_id, verdict


class SliceParts:
  """The pod transfers one slice process received, per request, until the
  request is admitted and takes them (the ``StateReceiver``'s ``on_ready`` /
  ``on_failure``). ``on_status`` hears when a request's parts are complete,
  failed or gone (called outside the lock)."""

  def __init__(self, target: int, on_status: StatusCallback = _no_status):
    self.target = target
    self.on_status = on_status
    self._cv = threading.Condition()
    self._parts: dict[str, pod_transfer.PodParts] = {}
    self._failed: dict[str, tuple[str, str, float]] = {}
    self.parts_in = 0

  def on_state(self, received) -> None:
    """One pod process's verified part. Raises (the sender's Commit fails) for
    a transfer that is not a pod part for this process."""
    try:
      rid, _, target = pod_transfer.parse_transfer_id(received.info.transfer_id)
    except ShardPlanError:
      received.release()
      raise ShardPlanError(f"transfer {received.info.transfer_id!r} is a whole state; a "
                           "decode slice takes only a prefill pod's parts") from None
    if target != self.target:
      received.release()
      raise ShardPlanError(f"transfer {received.info.transfer_id} is for slice process "
                           f"{target}, this is {self.target}")
    with self._cv:
      expired = self._gc()
      parts = self._parts.setdefault(rid, pod_transfer.PodParts(rid, self.target))
      parts.add(received)
      self.parts_in += 1
      complete = parts.complete
      self._cv.notify_all()
    self._announce(expired)
    if complete:
      self.on_status(rid, {"ok": True})

  def on_failure(self, transfer_id: str, code: grpc.StatusCode, message: str) -> None:
    """A part failed: the request's other parts go and its job fails with ``code``."""
    try:
      rid, src, _ = pod_transfer.parse_transfer_id(transfer_id)
    except ShardPlanError:
      return
    error = (f"state transfer from pod process {src} to slice process {self.target} "
             f"failed: {message}")
    with self._cv:
      parts = self._parts.pop(rid, None)
      self._failed[rid] = (code.name, error, time.monotonic())
      self._cv.notify_all()
    if parts is not None:
      parts.close()
    self.on_status(rid, {"ok": False, "code": code.name, "error": error})

  def take(self, request_id: str, timeout_s: float,
           cancelled: Callable[[], bool] = lambda: False) -> pod_transfer.Collected:
    """Waits for every pod process's part of ``request_id``; returns them.

    Raises:
      SliceReceiveError: a part failed (its status), none came in time
        (DEADLINE_EXCEEDED), the request was cancelled (CANCELLED), or the pod
        processes disagree (DATA_LOSS).
    """
    deadline = time.monotonic() + timeout_s
    try:
      with self._cv:
        while True:
          failed = self._failed.pop(request_id, None)
          if failed is not None:
            raise SliceReceiveError(failed[0], failed[1])
          parts = self._parts.get(request_id)
          if parts is not None and parts.complete:
            del self._parts[request_id]
            break
          if cancelled():
            self._drop_locked(request_id)
            raise SliceReceiveError("CANCELLED", f"request {request_id} was cancelled")
          left = deadline - time.monotonic()
          if left <= 0:
            missing = parts.missing() if parts is not None else "all"
            self._drop_locked(request_id)
            raise SliceReceiveError(
                "DEADLINE_EXCEEDED", f"slice process {self.target}: parts of {request_id} "
                f"from pod processes {missing} did not arrive within {timeout_s:.0f}s")
          self._cv.wait(min(left, _POLL_S))
    finally:
      self.on_status(request_id, None)
    try:
      return parts.collected()
    except ShardPlanError as e:
      parts.close()
      raise SliceReceiveError("DATA_LOSS", str(e)) from None

  def drop(self, request_id: str) -> None:
    """Forgets the request: its parts and any failure of them."""
    with self._cv:
      self._drop_locked(request_id)
      self._failed.pop(request_id, None)
    self.on_status(request_id, None)

  def pending(self) -> int:
    with self._cv:
      return len(self._parts)

  def _drop_locked(self, request_id: str) -> None:
    parts = self._parts.pop(request_id, None)
    if parts is not None:
      parts.close()

  def _gc(self) -> list[str]:
    """Drops parts and failures older than ``PARTS_TTL_S``; returns their requests."""
    now = time.monotonic()
    expired = [r for r, p in self._parts.items() if now - p.updated > PARTS_TTL_S]
    for rid in expired:
      self._parts.pop(rid).close()
    old = [r for r, f in self._failed.items() if now - f[2] > PARTS_TTL_S]
    for rid in old:
      del self._failed[rid]
    return expired + old

  def _announce(self, gone: list[str]) -> None:
    for rid in gone:
      self.on_status(rid, None)
