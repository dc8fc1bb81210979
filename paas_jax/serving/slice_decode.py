"""Decode on a slice: every process of a decode slice runs each request in lockstep.

Region B's decode server as a slice of Q processes (one JAX program over a
``tp`` mesh of every process's devices; ``slice_decode_server``). Each slice
process serves its own StateTransfer port: a prefill pod streams to slice
process q exactly the shard bytes q needs for the slice's mesh (transfer ids
``pod:<request>:<p>-><q>``, ``pod_transfer``), which ``SliceParts`` keeps,
verified, until the request's job takes them. Process 0 fronts the Decode
service and publishes one ``SliceJob`` per request (``lockstep``); every
process -- process 0 too -- runs ``SliceDecodeRunner.run``:

  remote (PrfaaS, after the Handoff):
    1. take this process's parts of the request (``SliceParts.take``), check
       them against the pod's plan and restore its own shards in place
       (``pod_transfer.restore``); the processes then agree
       (``lockstep.agree``): if any failed, every process drops the request
       (the first failure's status reaches the client), nothing is decoded;
    2. the handoff logit probe: one sharded decode step fed the first token,
       compared with the prefill side's fingerprint on every process (the
       logits are replicated, so every process takes the same decision);
       DATA_LOSS on a mismatch before any token past the first is streamed;
  local (the slice prefills the prompt itself, PD-P colocated):
    1. the sharded prefill (``pod.region_prefill_logits``) and the first token
       sampled as the single-process engine samples it;
  then the decode loop: one sharded step per token (``pod.region_step_logits``),
  each token sampled from the replicated logits with the request's seed at its
  position, exactly as ``slot_pool.generate_step``, until a stop token or
  ``max_new_tokens``. Process 0 emits tokens (and their logprobs) as they come.

Requests run one at a time (no continuous batching on a slice yet), and a
started job runs to its end on every process (lockstep): a client that goes
away while its job waits for its parts ends the wait (the cancel key), one
that goes away mid-decode does not stop the loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Callable

import grpc
import jax.numpy as jnp

from paas_jax.codec.errors import CodecError
from paas_jax.codec.shard_plan import MeshSpec, ShardPlanError
from paas_jax.models.api import SamplingParams
from paas_jax.serving import lockstep, pod, pod_transfer
from paas_jax.serving.batch_rows import sample_rows
from paas_jax.serving.token_logprob_ops import rows_logprobs
from paas_jax.serving.validation import RequestParams
from paas_jax.state import abstract_state, logit_probe

log = logging.getLogger("paas_jax.serving.slice_decode")

JOBS = "slicejob"  # the slice's jobs in the region's key-value store
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
    d = json.loads(data)
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


class SliceParts:
  """The pod transfers one slice process received, per request, until a job
  takes them (the ``StateReceiver``'s ``on_ready`` / ``on_failure``)."""

  def __init__(self, target: int):
    self.target = target
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
      self._gc()
      parts = self._parts.setdefault(rid, pod_transfer.PodParts(rid, self.target))
      parts.add(received)
      self.parts_in += 1
      self._cv.notify_all()

  def on_failure(self, transfer_id: str, code: grpc.StatusCode, message: str) -> None:
    """A part failed: the request's other parts go and its job fails with ``code``."""
    try:
      rid, src, _ = pod_transfer.parse_transfer_id(transfer_id)
    except ShardPlanError:
      return
    with self._cv:
      parts = self._parts.pop(rid, None)
      self._failed[rid] = (code.name, f"state transfer from pod process {src} to slice "
                           f"process {self.target} failed: {message}", time.monotonic())
      self._cv.notify_all()
    if parts is not None:
      parts.close()

  def take(self, request_id: str, timeout_s: float,
           cancelled: Callable[[], bool] = lambda: False) -> pod_transfer.Collected:
    """Waits for every pod process's part of ``request_id``; returns them.

    Raises:
      SliceReceiveError: a part failed (its status), none came in time
        (DEADLINE_EXCEEDED), the request was cancelled (CANCELLED), or the pod
        processes disagree (DATA_LOSS).
    """
    deadline = time.monotonic() + timeout_s
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
    try:
      return parts.collected()
    except ShardPlanError as e:
      parts.close()
      raise SliceReceiveError("DATA_LOSS", str(e)) from None

  def drop(self, request_id: str) -> None:
    with self._cv:
      self._drop_locked(request_id)

  def pending(self) -> int:
    with self._cv:
      return len(self._parts)

  def _drop_locked(self, request_id: str) -> None:
    parts = self._parts.pop(request_id, None)
    if parts is not None:
      parts.close()

  def _gc(self) -> None:
    now = time.monotonic()
    for rid in [r for r, p in self._parts.items() if now - p.updated > PARTS_TTL_S]:
      self._parts.pop(rid).close()
    for rid in [r for r, f in self._failed.items() if now - f[2] > PARTS_TTL_S]:
      del self._failed[rid]


Emit = Callable[..., None]  # emit(kind, *payload) on process 0; see SliceDecodeRunner.run


def _no_emit(kind: str, *payload) -> None:
  del kind, payload


class SliceDecodeRunner:
  """One slice process's side of every job (see the module docstring).

  Args:
    model: the model placed on ``mesh`` (``pod.shard_model``).
    mesh: the slice's mesh (``pod.region_mesh``).
    region: this process's ``pod.RegionSpec``.
    parts: this process's ``SliceParts``.
    receive_timeout_s: how long a job waits for its parts.
    kv: the region's key-value store (None: a single-process slice).
  """

  def __init__(self, model, mesh, region: pod.RegionSpec, parts: SliceParts, *,
               receive_timeout_s: float = 300.0, kv=None):
    self.model = model
    self.config = model.config
    self.mesh = mesh
    self.region = region
    self.parts = parts
    self.receive_timeout_s = receive_timeout_s
    self.kv = kv
    self.barrier = pod.Barrier(region)
    self.placement = pod.state_placement(self.config, MeshSpec.from_mesh(mesh))

  def run(self, job: SliceJob, emit: Emit = _no_emit,
          cancelled: Callable[[], bool] | None = None) -> dict:
    """Runs ``job`` on this process; returns its report (JSON-able). ``emit``
    (process 0): ``("slot", info)``, ``("token", token, logprob | None)``
    for every token past a remote request's first, ``("finished", reason)``.
    ``cancelled``: whether to stop waiting for the parts (default: the job's
    cancel key, which process 0 sets when the request's RPC ends)."""
    pid = self.region.process_id
    params = job.params
    capacity = decode_capacity(job.prompt_len, job.max_new_tokens)
    t0 = time.perf_counter()
    report = {"process": pid, "wire_bytes": 0}
    if job.remote:
      state, failure, report["wire_bytes"] = self._receive(job, capacity, cancelled)
      if failure is not None:
        return dict(report, ok=False, **failure)
      restore_s = time.perf_counter() - t0
      failure = self._check_probe(job, state, job.prompt_len)
      if failure is not None:
        return dict(report, ok=False, **failure)
      emit("slot", {"queue_s": 0.0, "restore_s": restore_s})
      tokens = [job.first_token]
    else:
      logits, state = pod.region_prefill_logits(self.model, self.mesh, job.prompt,
                                                self.barrier, capacity)
      tokens = [self._sample(logits, params, job.prompt_len)]
      emit("slot", {"prefill_s": time.perf_counter() - t0})
      emit("token", tokens[0], self._logprob(logits, tokens[0], params))
    reason = _finish_reason(tokens, params)
    while reason is None:
      logits, state = pod.region_step_logits(self.model, self.mesh, state, tokens[-1],
                                             self.barrier)
      token = self._sample(logits, params, job.prompt_len + len(tokens))
      tokens.append(token)
      emit("token", token, self._logprob(logits, token, params))
      reason = _finish_reason(tokens, params)
    emit("finished", reason)
    return dict(report, ok=True, tokens=tokens, reason=reason,
                decode_s=time.perf_counter() - t0)

  def _receive(self, job: SliceJob, capacity: int, cancelled: Callable[[], bool] | None):
    """(state or None, failure dict or None, wire bytes): this process's parts
    restored, and the slice's agreement that every process restored its own."""
    pid, n = self.region.process_id, self.region.num_processes
    cancel_key = f"{lockstep.job_key(JOBS, job.number)}/cancel"

    def cancel_key_set() -> bool:
      if self.kv is None:
        return False
      try:
        self.kv.key_value_try_get(cancel_key)  # raises NOT_FOUND until process 0 sets it
      except Exception:  # pylint: disable=broad-except
        return False
      return True
    cancelled = cancelled or cancel_key_set
    state, mine, wire = None, {"ok": True}, 0
    try:
      collected = self.parts.take(job.request_id, self.receive_timeout_s, cancelled)
      wire = collected.wire_bytes
      if collected.envelope.manifest.token_count != job.prompt_len:
        raise SliceReceiveError("DATA_LOSS", f"the pod sent a state of "
                                f"{collected.envelope.manifest.token_count} tokens for a "
                                f"prompt of {job.prompt_len}")
      state = pod_transfer.restore(collected, pid, self.placement,
                                   abstract_state(self.config, 1, capacity),
                                   pod.state_shardings(self.config, self.mesh, 1, capacity))
    except SliceReceiveError as e:
      mine = {"ok": False, "code": e.code, "error": e.message}
    except (CodecError, ShardPlanError, ValueError) as e:
      mine = {"ok": False, "code": "DATA_LOSS",
              "error": f"slice process {pid} refused its part of {job.request_id}: {e}"}
    verdicts = [mine]
    if n > 1:
      verdicts = lockstep.agree(self.kv, f"{lockstep.job_key(JOBS, job.number)}/received", pid,
                                n, self.receive_timeout_s + self.region.timeout_s, mine)
    failed = next((v for v in verdicts if not v["ok"]), None)
    if failed is not None:
      return None, {"code": failed["code"], "error": failed["error"]}, wire
    return state, None, wire

  def _check_probe(self, job: SliceJob, state, prompt_len: int) -> dict | None:
    probe = job.logit_probe
    if probe is None:
      return None
    logits = pod.region_probe_logits(self.model, self.mesh, state, probe.token,
                                     logit_probe.probe_capacity(prompt_len), self.barrier)
    result = logit_probe.compare(probe, logits)
    if result.ok:
      return None
    return {"code": "DATA_LOSS", "probe_mismatch": True,
            "error": f"the received state failed the logit probe ({result.reason}); "
                     "nothing was streamed from it"}

  @staticmethod
  def _sample(logits, params: RequestParams, position: int) -> int:
    return int(sample_rows(jnp.asarray(logits[None]), [params], [position])[0])

  def _logprob(self, logits, token: int, params: RequestParams):
    if self.region.process_id != 0 or params.logprobs < 0:
      return None
    return rows_logprobs(jnp.asarray(logits[None]), [token], [0], [params.logprobs])[0]


def _finish_reason(tokens: list[int], params: RequestParams) -> str | None:
  """As ``decode_scheduler``: a stop token first, then the token budget."""
  if tokens[-1] in params.stop_tokens:
    return "stop_token"
  if len(tokens) >= params.max_new_tokens:
    return "max_tokens"
  return None


def follow_jobs(runner: SliceDecodeRunner, kv=None) -> None:
  """Slice processes 1..Q-1: run every job process 0 publishes (``lockstep.follow``)."""
  lockstep.follow(kv or pod.kv_client(), JOBS, runner.region.process_id,
                  lambda data: runner.run(SliceJob.from_json(data)))
