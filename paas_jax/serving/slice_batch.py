"""Continuous batching on a decode slice: every slice process runs the same rounds.

A decode slice (``slice_decode_server``) is Q processes of one JAX program.
Its requests share one batched, sharded ``DecodeState`` of ``slots`` rows
(``SliceBatch``), so that each sharded decode step -- whose collectives cost
the same for one row as for eight -- advances every running request. Process
0 (``slice_leader``) decides, and publishes through the region's key-value
store, one ``SliceRound`` at a time; every process, process 0 too, runs it
(``SliceBatch.run_round``) in this order:

  1. ``drop``: forget the parts of requests that will not be admitted;
  2. ``evict``: free the rows of requests whose client went away;
  3. ``admit``: each job into its row --
     remote (PrfaaS, after the Handoff): take this process's parts, restore its
       own shards (``pod_transfer.restore``), agree with the other processes
       (``lockstep.agree``: if any failed, all drop the request and the first
       failure's status reaches the client), check the handoff logit probe on
       the sharded state (DATA_LOSS on a mismatch, before any token past the
       first; ``--faults=corrupt_states=N`` damages the first N states just
       before it, ``pod.region_damage``);
     local (the slice prefills the prompt itself): the sharded prefill and the
       first token sampled as the single-process engine samples it; with a
       prefix cache (``slice_prefix``) the prefill continues from the longest
       cached prefix, once every process agreed on it;
     then the row's state, grown to the batch's capacity, is written into the
     batch (which first widens if the row is above its width, or grows if the
     request needs more positions; it narrows again when its top rows free);
  4. ``steps`` batched decode steps: every row is fed its last token, each
     row's next token is sampled from the replicated logits with its own seed
     at its own position (as ``slot_pool.generate_step``), and a row that
     reaches a stop token or ``max_new_tokens`` is freed.

Process 0 admits a remote request only once every process holds its parts
(``ReadyBoard``), so that no round waits on the network while others decode.
The processes take identical decisions from identical inputs: the rounds,
agreed verdicts and replicated logits. Each reports what it finished, and
process 0 checks that every process produced the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
import urllib.parse
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from paas_jax.codec.errors import CodecError
from paas_jax.codec.shard_plan import MeshSpec, ShardPlanError
from paas_jax.security.faults import FaultPlan
from paas_jax.serving import lockstep, pod, pod_transfer
from paas_jax.serving.batch_rows import sample_rows
from paas_jax.serving.slice_decode import (SliceJob, SliceParts, SliceReceiveError,
                                           decode_capacity)
from paas_jax.serving.slice_prefix import SlicePrefix
from paas_jax.serving.token_logprob_ops import rows_logprobs
from paas_jax.serving.validation import RequestParams
from paas_jax.state import DecodeState, abstract_state, logit_probe

log = logging.getLogger("paas_jax.serving.slice")

ROUNDS = "sliceround"  # the rounds in the region's key-value store
READY = "sliceready"   # READY/<request>/<process>: that process's parts verdict

# emit(request_id, kind, *payload) on process 0: ("slot", info), ("token",
# token, logprob | None), ("finished", reason).
Emit = Callable[..., None]


def _no_emit(request_id: str, kind: str, *payload) -> None:
  del request_id, kind, payload


@dataclasses.dataclass(frozen=True)
class SliceRound:
  """What every slice process does next (JSON through the key-value store).

  ``admit``: (row, job) pairs, in order; ``evict``: requests whose rows are
  freed; ``drop``: requests whose parts are forgotten; ``steps``: batched
  decode steps after the admissions (fewer if every row finishes first).
  """

  number: int
  admit: tuple[tuple[int, SliceJob], ...] = ()
  evict: tuple[str, ...] = ()
  drop: tuple[str, ...] = ()
  steps: int = 0

  def to_json(self) -> str:
    return json.dumps({"number": self.number, "evict": list(self.evict),
                       "drop": list(self.drop), "steps": self.steps,
                       "admit": [{"slot": s, "job": dataclasses.asdict(j)}
                                 for s, j in self.admit]})

  @classmethod
  def from_json(cls, data: str) -> "SliceRound":
    d = json.loads(data)
    return cls(int(d["number"]),
               tuple((int(a["slot"]), SliceJob.from_dict(a["job"])) for a in d["admit"]),
               tuple(d["evict"]), tuple(d["drop"]), int(d["steps"]))


class ReadyBoard:
  """Which slice processes hold every part of which remote request.

  Each process posts its ``SliceParts`` status under
  ``READY/<request>/<process>`` (and withdraws it once the parts are gone);
  process 0 reads the whole board with one call per round. ``kv`` None: a
  single-process slice keeps the board in memory.
  """

  def __init__(self, kv=None):
    self.kv = kv
    self._lock = threading.Lock()
    self._local: dict[tuple[str, int], str] = {}

  def post(self, request_id: str, process_id: int, verdict: dict | None) -> None:
    key = f"{READY}/{urllib.parse.quote(request_id, safe='')}/{process_id}"
    if self.kv is None:
      with self._lock:
        if verdict is None:
          self._local.pop((request_id, process_id), None)
        else:
          self._local[(request_id, process_id)] = json.dumps(verdict)
      return
    if verdict is None:
      self.kv.key_value_delete(key)
    else:
      self.kv.key_value_set(key, json.dumps(verdict), allow_overwrite=True)

  def read(self) -> dict[str, dict[int, dict]]:
    """request id -> {process: verdict} of every request some process posted."""
    if self.kv is None:
      with self._lock:
        items = list(self._local.items())
      pairs = [(rid, pid, value) for (rid, pid), value in items]
    else:
      pairs = []
      for key, value in self.kv.key_value_dir_get(f"{READY}/"):
        quoted, _, pid = key.rpartition(f"{READY}/")[2].partition("/")
        pairs.append((urllib.parse.unquote(quoted), int(pid), value))
    board: dict[str, dict[int, dict]] = {}
    for rid, pid, value in pairs:
      board.setdefault(rid, {})[pid] = json.loads(value)
    return board


@dataclasses.dataclass
class _Row:
  job: SliceJob
  params: RequestParams
  tokens: list[int]


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=(3,))
def _batch_step(graphdef, params, tokens, state, active, out_shardings, whole):
  """One decode step of every row; free rows step at position 0 (their
  contents are overwritten when a request is admitted)."""
  state = state.replace(lengths=jnp.where(active, state.lengths, 0))
  logits, state = nnx.merge(graphdef, params).step(tokens, state)
  return (jax.lax.with_sharding_constraint(logits.astype(jnp.float32), whole),
          jax.lax.with_sharding_constraint(state, out_shardings.tree))


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _insert_row(batch, one, slot, out_shardings):
  """``batch`` with row ``slot`` replaced by the batch-1 ``one`` (grown to the
  batch's capacity)."""
  one = one.grow(batch.capacity) if batch.capacity is not None else one
  put = lambda b, o: jax.lax.dynamic_update_slice_in_dim(b, o.astype(b.dtype), slot[0], 0)
  return jax.lax.with_sharding_constraint(jax.tree_util.tree_map(put, batch, one),
                                          out_shardings.tree)


@functools.partial(jax.jit, static_argnums=(1, 2, 3), donate_argnums=(0,))
def _resize_batch(batch, width, capacity, out_shardings):
  """``batch`` with ``width`` rows (zero rows added, or trailing free rows cut)
  and its growing caches grown to ``capacity`` positions."""
  batch = batch.grow(capacity)

  def rows(x):
    if x.shape[0] >= width:
      return x[:width]
    return jnp.pad(x, [(0, width - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  return jax.lax.with_sharding_constraint(jax.tree_util.tree_map(rows, batch),
                                          out_shardings.tree)


class SliceBatch:
  """One slice process's rows and batched state (see the module docstring).

  Args:
    model: the model placed on ``mesh`` (``pod.shard_model``).
    mesh: the slice's mesh (``pod.region_mesh``).
    region: this process's ``pod.RegionSpec``.
    parts: this process's ``SliceParts``.
    slots: rows of the batch (the most requests decoding at once).
    take_timeout_s: how long an admission waits for parts every process
      announced (a fallback: they are in when the round is published).
    kv: the region's key-value store (None: a single-process slice).
    prefix: this process's prefix cache for local prefills (None: none).
  """

  def __init__(self, model, mesh, region: pod.RegionSpec, parts: SliceParts, *,
               slots: int = 4, take_timeout_s: float = 30.0, kv=None,
               prefix: SlicePrefix | None = None, faults: FaultPlan | None = None):
    if slots < 1:
      raise ValueError(f"a slice batch needs at least one slot, got {slots}")
    self.model = model
    self.config = model.config
    self.mesh = mesh
    self.region = region
    self.parts = parts
    self.take_timeout_s = take_timeout_s
    self.kv = kv
    self.prefix = prefix
    # Fault injection (demo and tests): ``corrupt_states`` damages that many
    # received states after the transport verified them, on every process
    # alike (each counts the same remote admissions in the same rounds).
    self.faults = faults if faults is not None and faults.corrupt_states else None
    self.barrier = pod.Barrier(region)
    self.placement = pod.state_placement(self.config, MeshSpec.from_mesh(mesh))
    self.whole = NamedSharding(mesh, PartitionSpec())
    self.rows: list[_Row | None] = [None] * slots
    # DecodeState [width, capacity], sharded; None while idle. Its width is the
    # power of two (at most ``slots``) above the highest busy row, so that a
    # lone request steps a batch of one (the leader fills the lowest rows).
    self.state = None
    self.width = 0
    self.capacity = 0
    self._shardings = None

  @property
  def slots(self) -> int:
    return len(self.rows)

  def active(self) -> int:
    return sum(r is not None for r in self.rows)

  def run_round(self, rnd: SliceRound, emit: Emit = _no_emit) -> dict:
    """Runs ``rnd`` on this process; returns its report (JSON-able):
    ``failed``: request -> {code, error[, probe_mismatch]} of refused
    admissions; ``finished``: request -> {tokens, reason}; ``wire_bytes``:
    request -> state bytes this process received; ``steps``; ``row_steps``
    (rows advanced, summed over the steps); ``max_rows`` (rows after the
    admissions); ``prefix``: request -> prompt tokens a local prefill took
    from the prefix cache."""
    report = {"process": self.region.process_id, "ok": True, "failed": {}, "finished": {},
              "wire_bytes": {}, "steps": 0, "row_steps": 0, "max_rows": 0, "prefix": {},
              "probes": 0}
    for rid in rnd.drop:
      self.parts.drop(rid)
    for rid in rnd.evict:
      self.rows = [None if r is not None and r.job.request_id == rid else r
                   for r in self.rows]
    for slot, job in rnd.admit:
      self._admit(rnd.number, slot, job, emit, report)
    report["max_rows"] = self.active()  # steps only free rows
    for _ in range(rnd.steps):
      if not self.active():
        break
      report["row_steps"] += self.active()
      report["steps"] += 1
      self._step(emit, report)
    if not self.active():
      self.state, self.width, self.capacity, self._shardings = None, 0, 0, None  # idle
    elif self._width_for(self._highest_row()) < self.width:
      self._resize(self._width_for(self._highest_row()), self.capacity)
    return report

  def precompile(self, max_ctx: int) -> int:
    """Compiles, before any round, the decode step and the row insert of every
    batch width (1, 2, 4, .. ``slots``) and context octave a request of up to
    ``max_ctx`` positions can reach (``decode_capacity``), and the handoff
    probe's step at each octave, so that no round stops to compile them: all
    processes compile in lockstep there, which took minutes a round on a
    loaded CPU host (requests then met their deadlines). Nothing runs, so no
    collective: each process does this on its own, before it serves, and all
    end up with the same programs (a program one process has and another
    compiles mid-round would make the others wait in its collectives).
    Returns the programs compiled."""
    widths = sorted({self._width_for(row) for row in range(self.slots)})
    capacities = []
    capacity = decode_capacity(1, 0)
    while capacity <= decode_capacity(max_ctx, 0):
      capacities.append(capacity)
      capacity *= 2
    # The probe's fed token and the insert's row: one replicated int32 each.
    scalar = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=self.whole)
    compiled = 0
    for capacity in capacities:
      one, _ = self._abstract(1, capacity)
      compiled += pod.precompile(
          pod.sharded_probe_logits, (0, 4, 5),
          (self.model.graphdef, self.model.params, scalar, one, capacity, self.whole), "probe")
      for width in widths:
        state, shardings = self._abstract(width, capacity)
        rows = lambda dtype: jax.ShapeDtypeStruct((width,), dtype, sharding=self.whole)
        compiled += pod.precompile(
            _batch_step, (0, 5, 6), (self.model.graphdef, self.model.params, rows(jnp.int32),
                                     state, rows(jnp.bool_), shardings, self.whole),
            "slice_step")
        compiled += pod.precompile(_insert_row, (3,), (state, one, scalar, shardings),
                                   "slice_insert")
    return compiled

  def _abstract(self, width: int, capacity: int) -> tuple[DecodeState, pod.StaticShardings]:
    """The batch's state [width, capacity] as ``ShapeDtypeStruct``s carrying its
    shardings, and those shardings (as the rounds pass them)."""
    shardings = pod.state_shardings(self.config, self.mesh, width, capacity)
    state = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_state(self.config, width, capacity), shardings)
    return state, pod.StaticShardings(shardings)

  def _highest_row(self) -> int:
    return max(i for i, r in enumerate(self.rows) if r is not None)

  def _width_for(self, row: int) -> int:
    return min(self.slots, 1 << row.bit_length())

  def _resize(self, width: int, capacity: int) -> None:
    self.width, self.capacity = width, capacity
    self._shardings = pod.state_shardings(self.config, self.mesh, width, capacity)
    if self.state is None:
      self.state = pod.empty_state(self.config, width, capacity, self._shardings)
      return
    self.state = pod.synchronized_call(
        _resize_batch, (1, 2, 3),
        (self.state, width, capacity, pod.StaticShardings(self._shardings)),
        self.barrier, "slice_resize")

  def _admit(self, number: int, slot: int, job: SliceJob, emit: Emit, report: dict) -> None:
    rid, params = job.request_id, job.params
    if not 0 <= slot < self.slots or self.rows[slot] is not None:
      raise ValueError(f"round {number} admits {rid} into row {slot}, which is not free")
    capacity = decode_capacity(job.prompt_len, job.max_new_tokens)
    t0 = time.perf_counter()
    if job.remote:
      state, failure, report["wire_bytes"][rid] = self._receive(number, slot, job, capacity)
      if failure is None and self.faults is not None and self.faults.take_state_corruption():
        log.error("fault: damaging the verified state of %s", rid, extra={"request_id": rid})
        state = pod.region_damage(self.config, state, job.prompt_len, self.barrier)
      if failure is None:
        failure = self._check_probe(job, state)
        report["probes"] += job.logit_probe is not None
      if failure is not None:
        report["failed"][rid] = failure
        return
      emit(rid, "slot", {"queue_s": 0.0, "restore_s": time.perf_counter() - t0})
      tokens = [job.first_token]
    else:
      cached = 0
      if self.prefix is None:
        logits, state = pod.region_prefill_logits(self.model, self.mesh, job.prompt,
                                                  self.barrier, capacity)
      else:
        logits, state, cached = self.prefix.prefill(self.model, job.prompt, capacity,
                                                    self.barrier, self._agree(number, slot))
        report["prefix"][rid] = cached
      host = jnp.asarray(logits[None])
      tokens = [int(sample_rows(host, [params], [job.prompt_len])[0])]
      emit(rid, "slot", {"prefill_s": time.perf_counter() - t0, "cached_tokens": cached})
      emit(rid, "token", tokens[0], self._logprobs(host, tokens, [params])[0])
    reason = finish_reason(tokens, params)
    if reason is not None:
      emit(rid, "finished", reason)
      report["finished"][rid] = {"tokens": tokens, "reason": reason}
      return
    self._place(slot, state, capacity)
    self.rows[slot] = _Row(job, params, tokens)

  def _agree(self, number: int, slot: int):
    """How the processes agree on a local prefill's cached prefix (None alone)."""
    pid, n = self.region.process_id, self.region.num_processes
    if n == 1:
      return None
    key = f"{lockstep.job_key(ROUNDS, number)}/prefix/{slot}"
    return lambda mine: lockstep.agree(self.kv, key, pid, n, self.region.timeout_s, mine)

  def _place(self, slot: int, one, capacity: int) -> None:
    """Writes the batch-1 ``one`` into row ``slot``, widening or growing the
    batch first."""
    width = max(self.width, self._width_for(slot))
    if self.state is None or width > self.width or capacity > self.capacity:
      self._resize(width, max(capacity, self.capacity))
    self.state = pod.synchronized_call(
        _insert_row, (3,), (self.state, one, pod.replicated(self.mesh, np.array([slot],
                                                                                np.int32)),
                            pod.StaticShardings(self._shardings)),
        self.barrier, "slice_insert")

  def _step(self, emit: Emit, report: dict) -> None:
    rows = self.rows[:self.width]  # every busy row is below the width
    feed = np.array([r.tokens[-1] if r else 0 for r in rows], np.int32)
    active = np.array([r is not None for r in rows])
    logits, self.state = pod.synchronized_call(
        _batch_step, (0, 5, 6),
        (self.model.graphdef, self.model.params, pod.replicated(self.mesh, feed), self.state,
         pod.replicated(self.mesh, active), pod.StaticShardings(self._shardings), self.whole),
        self.barrier, "slice_step")
    host = jnp.asarray(np.asarray(logits.addressable_data(0)))  # [slots, vocab], replicated
    params = [r.params if r else RequestParams() for r in rows]
    positions = [r.job.prompt_len + len(r.tokens) if r else 0 for r in rows]
    sampled = sample_rows(host, params, positions)
    lps = self._logprobs(host, sampled, params)
    for i, row in enumerate(rows):
      if row is None:
        continue
      token = int(sampled[i])
      row.tokens.append(token)
      rid = row.job.request_id
      emit(rid, "token", token, lps[i])
      reason = finish_reason(row.tokens, row.params)
      if reason is not None:
        emit(rid, "finished", reason)
        report["finished"][rid] = {"tokens": row.tokens, "reason": reason}
        self.rows[i] = None

  def _logprobs(self, logits, tokens, params: list[RequestParams]) -> list:
    """Per row: its token's ``TokenLogprob`` where it asked for logprobs (on
    process 0, which streams them), else None."""
    want = [i for i, p in enumerate(params) if p.logprobs >= 0]
    out = [None] * len(params)
    if self.region.process_id != 0 or not want:
      return out
    for i, lp in zip(want, rows_logprobs(logits, tokens, want,
                                         [params[i].logprobs for i in want])):
      out[i] = lp
    return out

  def _receive(self, number: int, slot: int, job: SliceJob, capacity: int):
    """(state or None, failure dict or None, wire bytes): this process's parts
    restored, and the slice's agreement that every process restored its own."""
    pid, n = self.region.process_id, self.region.num_processes
    state, mine, wire = None, {"ok": True}, 0
    try:
      collected = self.parts.take(job.request_id, self.take_timeout_s)
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
      verdicts = lockstep.agree(self.kv, f"{lockstep.job_key(ROUNDS, number)}/admit/{slot}",
                                pid, n, self.take_timeout_s + self.region.timeout_s, mine)
    failed = next((v for v in verdicts if not v["ok"]), None)
    if failed is not None:
      return None, {"code": failed["code"], "error": failed["error"]}, wire
    return state, None, wire

  def _check_probe(self, job: SliceJob, state) -> dict | None:
    probe = job.logit_probe
    if probe is None:
      return None
    logits = pod.region_probe_logits(self.model, self.mesh, state, probe.token,
                                     logit_probe.probe_capacity(job.prompt_len), self.barrier)
    result = logit_probe.compare(probe, logits)
    if result.ok:
      return None
    return {"code": "DATA_LOSS", "probe_mismatch": True,
            "error": f"the received state failed the logit probe ({result.reason}); "
                     "nothing was streamed from it"}


def finish_reason(tokens: list[int], params: RequestParams) -> str | None:
  """As ``decode_scheduler``: a stop token first, then the token budget."""
  if tokens[-1] in params.stop_tokens:
    return "stop_token"
  if len(tokens) >= params.max_new_tokens:
    return "max_tokens"
  return None


def follow_rounds(batch: SliceBatch, kv) -> None:
  """Slice processes 1..Q-1: run every round process 0 publishes (``lockstep.follow``)."""
  lockstep.follow(kv, ROUNDS, batch.region.process_id,
                  lambda data: batch.run_round(SliceRound.from_json(data)))
