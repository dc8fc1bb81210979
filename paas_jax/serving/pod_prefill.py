"""Serving prefill on a pod: every process of the pod runs each request in lockstep.

Process 0 of the pod fronts the gRPC Prefill service
(``pod_prefill_server``). Each request becomes a ``PodJob`` that process 0
publishes in the region's key-value store (``podjob/<n>``); every process --
process 0 too -- takes jobs in order and runs ``PodPrefillRunner.run``:

  1. the sharded prefill (``pod.region_prefill_logits``, one SPMD program over
     the pod's mesh; compiled, then started after a coordinator barrier with
     the region's deadline);
  2. the first token sampled from the last position's logits exactly as the
     single-process engine does (``batch_rows.sample_rows``, same seed and
     position), its ``TokenLogprob`` (process 0) and the handoff logit probe
     (``pod.region_probe_logits``: one sharded decode step);
  3. each process encodes only its own shards, the pod merges the partial
     manifests through the key-value store (deadline-bounded), and each
     process streams the objects the shard plan routes from it to the decode
     server (``pod_transfer.send_shards``, transfer ids
     ``pod:<request>:<process>-><target>``); the decode side
     (``pod_intake``) restores the state only once every pod process's part
     arrived and verified;
  4. each process reports its part (``podjob/<n>/done/<p>``); process 0 ends
     the RPC with the pod's totals.

A peer that does not report within the region's deadline leaves the pod out
of lockstep: process 0 fails the request (DEADLINE_EXCEEDED) and marks the
pod broken, so that its supervisor restarts the pod as a unit. A peer that
dies is seen by the supervisor first, which stops every process of the pod
(the broker sees the Prefill stream break: UNAVAILABLE, and re-prefills
elsewhere).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import sys
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from paas_jax.codec.encode import encode_groups
from paas_jax.codec.options import CodecOptions
from paas_jax.codec.shard_plan import MeshSpec, check_plan, placement_from_state, plan_transfer
from paas_jax.scheduling.tenant_queue import DEFAULT_TENANT, TenantPolicy, TenantQueue
from paas_jax.models.api import SamplingParams
from paas_jax.serving import lockstep, pod, pod_transfer
from paas_jax.serving.batch_rows import sample_rows
from paas_jax.serving.token_logprob_ops import rows_logprobs
from paas_jax.serving.validation import RequestParams
from paas_jax.state import logit_probe
from paas_jax.transport.errors import TransferError
from paas_jax.transport.sender import SenderOptions

log = logging.getLogger("paas_jax.serving.pod_prefill")

FAULT_EXIT = 75  # a pod process that a fault plan killed (as pod_worker's)


@dataclasses.dataclass(frozen=True)
class PodJob:
  """One request as every pod process sees it (JSON through the key-value store).

  ``logprobs``: ``RequestParams.logprobs`` (-1: none). ``codec_json``: the
  broker's ``CodecOptions`` ("" = the server's). ``slice_targets`` /
  ``slice_devices``: a decode slice (``PrefillRequest.decode_slice``): each
  slice process's StateTransfer address by rank and the devices each owns;
  empty: one single-device decode process at ``decode_target``.
  """

  number: int
  request_id: str
  prompt: tuple[int, ...]
  decode_target: str
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  logprobs: int = -1
  codec_json: str = ""
  slice_targets: tuple[str, ...] = ()
  slice_devices: int = 0

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, data: str) -> "PodJob":
    d = json.loads(data)
    d["prompt"] = tuple(int(t) for t in d["prompt"])
    d["slice_targets"] = tuple(d.get("slice_targets", ()))
    return cls(**d)

  @property
  def targets(self) -> list[str]:
    """The decode processes' StateTransfer addresses, by slice rank."""
    return list(self.slice_targets) or [self.decode_target]

  @property
  def target_mesh(self) -> MeshSpec:
    """The decode side's mesh: one device, or the slice's ``tp`` mesh."""
    if not self.slice_targets:
      return MeshSpec(("tp",), (1,), (0,))
    q, d = len(self.slice_targets), self.slice_devices
    return MeshSpec(("tp",), (q * d,), tuple(p for p in range(q) for _ in range(d)))

  @property
  def params(self) -> RequestParams:
    return RequestParams(sampling=SamplingParams(self.temperature, self.top_k, self.top_p),
                         seed=self.seed, max_new_tokens=1, logprobs=self.logprobs)


@dataclasses.dataclass(frozen=True)
class FirstOut:
  """What process 0 reports as soon as the prefill is done (``FirstToken``)."""

  token: int
  logprob: object | None         # TokenLogprob or None
  probe: logit_probe.LogitProbe | None
  prefill_s: float               # the sharded prefill and the sampling
  probe_s: float = 0.0           # the probe's sharded decode step


def _fault(plan: dict | None, process_id: int, at: str, job: int) -> None:
  if (plan and plan.get("process") == process_id and plan.get("at") == at
      and plan.get("job", 1) == job):
    log.error("fault plan: pod process %d exits at %s", process_id, at)
    sys.stdout.flush()
    os._exit(FAULT_EXIT)  # a lost machine: no cleanup, no goodbye to the coordinator


class PodPrefillRunner:
  """One pod process's side of every job (see the module docstring).

  Args:
    model: the model placed on ``mesh`` (``pod.shard_model``).
    mesh: the pod's mesh (``pod.region_mesh``).
    region: this process's ``pod.RegionSpec``.
    sender_options: how this process's shards are sent.
    codec: default ``CodecOptions``.
    logit_probe: compute the handoff probe.
    fault: ``{"process": p, "at": "prefill"|"transfer", "job": n}``: process
      p exits with ``FAULT_EXIT`` in the middle of job n (default 1): before
      its part of the prefill program (the others wait in a collective), or
      after the manifests are merged, before it sends its shards (tests, demo).
  """

  def __init__(self, model, mesh, region: pod.RegionSpec, *,
               sender_options: SenderOptions = SenderOptions(),
               codec: CodecOptions = CodecOptions(), logit_probe: bool = True,
               fault: dict | None = None):
    self.model = model
    self.config = model.config
    self.mesh = mesh
    self.region = region
    self.barrier = pod.Barrier(region)
    self.sender_options = sender_options
    self.codec = codec
    self.logit_probe = logit_probe
    self.fault = fault

  def warmup(self, prompt_lengths: Sequence[int] = (16,)) -> float:
    """Compiles the prefill and probe programs for prompts of these lengths (all
    processes together; one prefill program per ``api.prefill_bucket``)."""
    t0 = time.perf_counter()
    for n in prompt_lengths:
      _, state = pod.region_prefill_logits(self.model, self.mesh, [1] * n, self.barrier)
      if self.logit_probe:
        pod.region_probe_logits(self.model, self.mesh, state, 1,
                                logit_probe.probe_capacity(n), self.barrier)
    return time.perf_counter() - t0

  def run(self, job: PodJob, on_first: Callable[[FirstOut], None] | None = None) -> dict:
    """Runs ``job`` on this process; returns this process's report (JSON-able)."""
    pid = self.region.process_id
    t0 = time.perf_counter()
    _fault(self.fault, pid, "prefill", job.number)
    logits, state = pod.region_prefill_logits(self.model, self.mesh, job.prompt, self.barrier)
    params = job.params
    row = jnp.asarray(logits[None])
    first = int(sample_rows(row, [params], [len(job.prompt)])[0])
    lp = None
    if pid == 0 and params.logprobs >= 0:
      lp = rows_logprobs(row, [first], [0], [params.logprobs])[0]
    jax.block_until_ready(state)
    prefill_s = time.perf_counter() - t0
    probe = None
    if self.logit_probe:
      plogits = pod.region_probe_logits(self.model, self.mesh, state, first,
                                        logit_probe.probe_capacity(len(job.prompt)),
                                        self.barrier)
      probe = logit_probe.fingerprint(plogits, first, self.config.dtype)
    probe_s = time.perf_counter() - t0 - prefill_s
    if on_first is not None:
      on_first(FirstOut(first, lp, probe, prefill_s, probe_s))

    t1 = time.perf_counter()
    codec = CodecOptions.from_json(job.codec_json) if job.codec_json else self.codec
    groups = list(encode_groups(state, options=codec, token_count=len(job.prompt)))
    mine = pod_transfer.partial_manifest(
        groups, model_id=self.config.name, config_fingerprint=self.config.fingerprint(),
        token_count=len(job.prompt), batch=1, options=codec)
    if self.region.num_processes > 1:
      merged = pod_transfer.exchange_manifests(
          mine, key=f"podjob/{job.number}/manifest", process_id=pid,
          num_processes=self.region.num_processes, timeout_s=self.region.timeout_s,
          kv=pod.kv_client())
    else:
      merged = mine
    source = placement_from_state(state)
    target = pod.state_placement(self.config, job.target_mesh)
    manifest = dataclasses.replace(merged, placements={"source": source.to_dict(),
                                                       "target": target.to_dict()})
    plan = plan_transfer(manifest, source, target)
    check_plan(plan, manifest)
    _fault(self.fault, pid, "transfer", job.number)
    try:
      sent = pod_transfer.send_shards(
          groups, plan, pod_transfer.Envelope(manifest, first, self.region.num_processes),
          source=pid, targets=job.targets, request_id=job.request_id,
          model_id=self.config.name, config_fingerprint=self.config.fingerprint(),
          options=self.sender_options)
    except TransferError as e:  # The pod stays in lockstep: only this request fails.
      return {"ok": False, "process": pid, "code": e.code.name,
              "error": f"state transfer to {job.decode_target} failed: {e.message}"}
    return {"ok": True, "process": pid, "first_token": first, "prefill_s": prefill_s,
            "probe_s": probe_s,
            "transfer_s": time.perf_counter() - t1, "state_bytes": manifest.nbytes,
            "wire_bytes": sum(s.wire_bytes for s in sent),
            "planned_bytes": sum(s.planned_bytes for s in sent),
            "objects": sum(len(s.keys) for s in sent)}


JOBS = "podjob"  # the pod's jobs in the region's key-value store (lockstep)


def follow_jobs(runner: PodPrefillRunner, kv=None) -> None:
  """Pod processes 1..P-1: run every job process 0 publishes, in order, for
  ever (``lockstep.follow``). A broken key-value store raises."""
  lockstep.follow(kv or pod.kv_client(), JOBS, runner.region.process_id,
                  lambda data: runner.run(PodJob.from_json(data)))


@dataclasses.dataclass
class _Waiting:
  fields: dict
  events: queue.Queue
  cancelled: threading.Event | None
  tenant: str


class PodLeader:
  """Process 0: takes requests one at a time, publishes each as a job, runs
  its own part and gathers the others' reports. Waiting requests are served
  by ``tenants`` (a ``TenantPolicy``: weighted fair queueing over prompt
  tokens between the decode regions, quotas; None: arrival order), as region
  A's single-process batcher does.

  ``submit(fields, events)`` queues a request; ``events`` (a ``queue.Queue``)
  then gets ``("first", FirstOut)``, and ``("done", totals)`` or
  ``("error", grpc code name, message)``. ``on_broken`` is called once the pod
  lost lockstep (a peer missed its deadline): its supervisor must restart it.
  """

  def __init__(self, runner: PodPrefillRunner, *, kv=None, on_broken: Callable | None = None,
               tenants: TenantPolicy | None = None):
    self.runner = runner
    self.kv = kv if kv is not None else (pod.kv_client()
                                         if runner.region.num_processes > 1 else None)
    self.on_broken = on_broken
    self.broken = False
    self._queue: TenantQueue[_Waiting] = TenantQueue(
        tenants or TenantPolicy(fair=False), tenant_of=lambda w: w.tenant,
        cost_of=lambda w: len(w.fields["prompt"]))
    self._cv = threading.Condition()
    self._n = 0
    self.jobs_done = 0
    self.jobs_failed = 0
    self.jobs_skipped = 0
    self._thread = threading.Thread(target=self._loop, name="pod-leader", daemon=True)
    self._thread.start()

  @property
  def queue_depth(self) -> int:
    with self._cv:
      return len(self._queue)

  def admits(self, tenant: str) -> bool:
    """False once ``tenant`` has its quota of requests waiting."""
    with self._cv:
      return self._queue.admits(tenant)

  def tenant_depths(self) -> dict[str, int]:
    with self._cv:
      return self._queue.depths()

  def tenant_served_tokens(self) -> dict[str, float]:
    with self._cv:
      return dict(self._queue.served_cost)

  def submit(self, fields: dict, events: queue.Queue,
             cancelled: threading.Event | None = None, tenant: str = DEFAULT_TENANT) -> None:
    """Queues a request; once ``cancelled`` is set (its RPC ended) before the
    job started, the pod skips it (a started job runs to its end: lockstep)."""
    with self._cv:
      self._queue.push(_Waiting(fields, events, cancelled, tenant))
      self._cv.notify()

  def _next(self) -> _Waiting:
    with self._cv:
      while not len(self._queue):
        self._cv.wait()
      return self._queue.pop()

  def _loop(self) -> None:
    while True:
      waiting = self._next()
      fields, events, cancelled = waiting.fields, waiting.events, waiting.cancelled
      if cancelled is not None and cancelled.is_set():
        self.jobs_skipped += 1
        continue
      if self.broken:
        events.put(("error", "UNAVAILABLE", "the prefill pod is restarting"))
        continue
      self._n += 1
      job = PodJob(number=self._n, **fields)
      try:
        self._run(job, events)
      except Exception as e:  # pylint: disable=broad-except
        # The peers may wait in a collective this process never reached: the
        # pod is out of lockstep and restarts as a unit.
        log.exception("pod job %s failed", job.request_id)
        self.jobs_failed += 1
        self._break()
        events.put(("error", "UNAVAILABLE", f"pod prefill failed, the pod restarts: {e!r}"))

  def _run(self, job: PodJob, events: queue.Queue) -> None:
    region = self.runner.region
    try:
      reports = lockstep.lead(
          self.kv, JOBS, job.number, job.to_json(),
          lambda: self.runner.run(job, on_first=lambda out: events.put(("first", out))),
          region.num_processes, region.timeout_s, f"request {job.request_id}")
    except lockstep.LockstepLost as e:
      self._break()
      events.put(("error", e.code, f"pod {e.message}"))
      return
    mine = reports[0]
    failed = [r for r in reports if not r.get("ok")]
    if failed:
      self.jobs_failed += 1
      events.put(("error", failed[0].get("code", "INTERNAL"),
                  f"pod process {failed[0]['process']} failed request {job.request_id}: "
                  f"{failed[0].get('error')}"))
      return
    self.jobs_done += 1
    events.put(("done", {
        "state_bytes": mine["state_bytes"],
        "bytes_sent": sum(r["wire_bytes"] for r in reports),
        "transfer_s": max(r["transfer_s"] for r in reports),
        "per_process_bytes": [r["wire_bytes"] for r in reports],
        "per_process_objects": [r["objects"] for r in reports]}))

  def _break(self) -> None:
    self.broken = True
    if self.on_broken is not None:
      self.on_broken()
