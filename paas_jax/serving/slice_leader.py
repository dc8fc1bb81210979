"""Process 0 of a decode slice: which requests join, leave and step in each round.

The slice's Decode service (``slice_decode_server``) hands every request to
the ``SliceLeader``: a local one as soon as it arrives, a remote one once its
Handoff came. The leader composes one ``SliceRound`` at a time from what it
knows -- free rows, requests whose parts every process holds (the
``ReadyBoard``), clients that went away -- publishes it for the other
processes (``lockstep``), runs its own part, gathers their reports and turns
the outcome into each request's events. Rounds are short (one decode step)
while a request waits and longer (``steps_per_round``) otherwise, so a new
request joins the running batch within one step.

A remote request whose parts failed on any process, or did not reach every
process within ``receive_timeout_s`` of its Handoff, fails with that status
(naming the processes still missing parts) and its parts are dropped
everywhere; it never holds up the batch. A round that raises, a process that
does not report, or processes that disagree on a request's tokens break the
slice: every request it holds fails UNAVAILABLE and ``on_broken`` lets the
supervisor restart the slice as a unit.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from paas_jax.serving import lockstep
from paas_jax.serving.slice_batch import ROUNDS, ReadyBoard, SliceBatch, SliceRound
from paas_jax.serving.slice_decode import SliceJob

log = logging.getLogger("paas_jax.serving.slice_leader")

# How often the leader looks at the ready board while requests wait for parts
# and nothing decodes.
PARTS_POLL_S = 0.01
SLOW_ROUND_S = 10.0  # rounds slower than this are logged with what they held


@dataclasses.dataclass
class SliceRequest:
  """One request on its way through the slice.

  ``events`` get ``("slot", info)``, ``("token", token, logprob)``,
  ``("finished", reason)`` or ``("error", code name, message)``.
  """

  request_id: str
  make_job: Callable[[int], SliceJob] | None
  events: queue.Queue
  cancelled: threading.Event
  submitted: float
  params: object = None  # RequestParams (a remote request's, for its Handoff)
  prompt_len: int = 0
  remote: bool = False
  number: int = 0        # its job's, once admitted
  handed_off: float = 0.0
  finished: bool = False


class SliceLeader:
  """Runs the slice's rounds (see the module docstring).

  Args:
    batch: process 0's ``SliceBatch``.
    board: the slice's ``ReadyBoard``.
    kv: the region's key-value store (None: a single-process slice).
    steps_per_round: decode steps of a round while nothing waits.
    receive_timeout_s: how long a remote request waits for its parts.
    round_timeout_s: how long process 0's own part of a round may run. The
      others' reports have the region's deadline (``lockstep.gather``), which
      starts only once process 0's part is done; a part stuck in a collective
      would otherwise hold every admitted request until its client gives up.
    on_broken: called once the slice lost lockstep (its supervisor restarts it).
  """

  def __init__(self, batch: SliceBatch, board: ReadyBoard, *, kv=None,
               steps_per_round: int = 4, receive_timeout_s: float = 300.0,
               round_timeout_s: float = 300.0, on_broken: Callable | None = None):
    self.batch = batch
    self.board = board
    self.kv = kv
    self.steps_per_round = max(1, steps_per_round)
    self.receive_timeout_s = receive_timeout_s
    self.round_timeout_s = round_timeout_s
    self.on_broken = on_broken
    self.broken = False
    # The leader thread and a round's watchdog may both end the slice.
    self._ending = threading.RLock()
    self.counters = collections.Counter()
    self._cv = threading.Condition()
    self._waiting: collections.deque[SliceRequest] = collections.deque()
    self._drops: set[str] = set()   # requests gone before they reached the leader
    self._admitted: dict[str, SliceRequest] = {}
    self._jobs = 0
    self._rounds = 0
    self.in_round = False
    threading.Thread(target=self._loop, name="slice-leader", daemon=True).start()

  @property
  def queue_depth(self) -> int:
    with self._cv:
      return len(self._waiting)

  @property
  def rows_busy(self) -> int:
    return len(self._admitted)

  @property
  def busy(self) -> bool:
    """Requests decode, or a round's reports are not in yet."""
    return bool(self._admitted) or self.in_round

  def submit(self, request: SliceRequest) -> None:
    request.handed_off = time.monotonic()
    with self._cv:
      self._waiting.append(request)
      self._cv.notify()

  def cancel(self, request: SliceRequest) -> None:
    """The request's RPC ended: it leaves the batch in the next round; parts
    that reached any process before its Handoff are dropped everywhere."""
    request.cancelled.set()
    with self._cv:
      if not request.number and request not in self._waiting:
        self._drops.add(request.request_id)
      self._cv.notify()

  def _loop(self) -> None:
    while True:
      with self._cv:
        while not (self._waiting or self._admitted or self._drops):
          self._cv.wait()
      if self.broken:
        self._fail_all("the decode slice is restarting")
        continue
      rnd = self._compose()
      if rnd is None:  # only requests waiting for their parts
        time.sleep(PARTS_POLL_S)
        continue
      self.in_round = True
      try:
        self._run(rnd)
      except Exception as e:  # pylint: disable=broad-except
        # Peers may wait in a collective this process never reached.
        log.exception("slice round %d failed", rnd.number)
        self._break(f"slice decode failed, the slice restarts: {e!r}")
      finally:
        self.in_round = False

  def _compose(self) -> SliceRound | None:
    """The next round, or None when there is nothing to do yet."""
    batch = self.batch
    evict = tuple(rid for rid, r in self._admitted.items() if r.cancelled.is_set())
    for rid in evict:
      self._admitted.pop(rid)
      self.counters["jobs_cancelled"] += 1
    free = [i for i, row in enumerate(batch.rows)
            if row is None or row.job.request_id in evict]
    with self._cv:
      waiting = list(self._waiting)
      drop = set(self._drops)
      self._drops.clear()
    board = self.board.read() if any(r.remote for r in waiting) else {}
    admit, now = [], time.monotonic()
    for request in waiting:
      rid = request.request_id
      if request.cancelled.is_set():
        self._leave(request, drop)
        self.counters["jobs_skipped"] += 1
        continue
      if request.remote and not self._parts_ready(request, board.get(rid, {}), now, drop):
        continue
      if free:
        with self._cv:
          self._waiting.remove(request)
        self._jobs += 1
        request.number = self._jobs
        self._admitted[rid] = request
        admit.append((free.pop(0), request.make_job(request.number)))
    with self._cv:
      still_waiting = bool(self._waiting)
    rows = batch.active() - len(evict) + len(admit)
    steps = 0 if rows <= 0 else (1 if still_waiting else self.steps_per_round)
    if not (admit or evict or drop or steps):
      return None
    self._rounds += 1
    return SliceRound(self._rounds, tuple(admit), evict, tuple(sorted(drop)), steps)

  def _parts_ready(self, request: SliceRequest, verdicts: dict[int, dict], now: float,
                   drop: set[str]) -> bool:
    """Whether every process holds the request's parts; fails it (and drops
    its parts) if one failed or they are late."""
    failed = next((verdicts[p] for p in sorted(verdicts) if not verdicts[p]["ok"]), None)
    if failed is not None:
      self._fail(request, failed["code"], failed["error"], drop)
      return False
    num = self.batch.region.num_processes
    if len(verdicts) >= num:
      return True
    if now - request.handed_off > self.receive_timeout_s:
      missing = [p for p in range(num) if p not in verdicts]
      self._fail(request, "DEADLINE_EXCEEDED", f"the parts of {request.request_id} did not "
                 f"reach slice processes {missing} within {self.receive_timeout_s:.0f}s of "
                 "its Handoff", drop)
    return False

  def _fail(self, request: SliceRequest, code: str, message: str, drop: set[str]) -> None:
    self._leave(request, drop)
    self.counters["jobs_failed"] += 1
    request.events.put(("error", code, message))

  def _leave(self, request: SliceRequest, drop: set[str]) -> None:
    with self._cv:
      self._waiting.remove(request)
    request.finished = True
    if request.remote:
      drop.add(request.request_id)

  def _run(self, rnd: SliceRound) -> None:
    region = self.batch.region
    watchdog = threading.Timer(self.round_timeout_s, self._round_stuck, (rnd,))
    watchdog.daemon = True
    watchdog.start()
    started = time.monotonic()
    try:
      reports = lockstep.lead(self.kv, ROUNDS, rnd.number, rnd.to_json(),
                              lambda: self.batch.run_round(rnd, emit=self._emit),
                              region.num_processes, region.timeout_s, f"round {rnd.number}")
    except lockstep.LockstepLost as e:
      self._break(f"slice {e.message}", e.code)
      return
    finally:
      watchdog.cancel()
    took = time.monotonic() - started
    if took > SLOW_ROUND_S:
      log.warning("slice round %d took %.1f s: %d admitted, %d evicted, %d steps, %d rows "
                  "busy after it", rnd.number, took, len(rnd.admit), len(rnd.evict), rnd.steps,
                  self.batch.active())
    with self._ending:
      if not self.broken:  # else the watchdog ended the slice while the round ran
        self._take_reports(rnd, reports)

  def _round_stuck(self, rnd: SliceRound) -> None:
    log.error("slice round %d (%d admitted, %d steps) did not finish within %.0f s",
              rnd.number, len(rnd.admit), rnd.steps, self.round_timeout_s)
    self._break(f"slice round {rnd.number} did not finish within {self.round_timeout_s:.0f}s "
                "(a process stuck in a collective?); the slice restarts")

  def _take_reports(self, rnd: SliceRound, reports: list[dict]) -> None:
    mine = reports[0]
    lost = next((r for r in reports if not r.get("ok")), None)
    if lost is not None:
      self._break(f"slice process {lost.get('process')} failed round {rnd.number}: "
                  f"{lost.get('error', '')}", lost.get("code", "UNAVAILABLE"))
      return
    # A decode server's gauges: states the handoff probe passed / caught.
    mismatches = sum(bool(f.get("probe_mismatch")) for f in mine["failed"].values())
    self.counters["handoff_probe_mismatch"] += mismatches
    self.counters["handoff_probe_ok"] += mine.get("probes", 0) - mismatches
    for rid, failure in mine["failed"].items():
      request = self._admitted.pop(rid)
      self.counters["jobs_failed"] += 1
      request.events.put(("error", failure["code"], failure["error"]))
      request.finished = True
    for rid, done in mine["finished"].items():
      others = [r["finished"].get(rid, {}).get("tokens") for r in reports[1:]]
      if any(tokens != done["tokens"] for tokens in others):
        self._break(f"slice processes disagree on the tokens of {rid}: out of lockstep")
        return
      request = self._admitted.pop(rid)
      self.counters["jobs_done"] += 1
      self.counters["tokens"] += len(done["tokens"])
      request.finished = True
    self.counters["rounds"] += 1
    self.counters["steps"] += mine["steps"]
    self.counters["row_steps"] += mine["row_steps"]
    self.counters["max_batch"] = max(self.counters["max_batch"], mine["max_rows"])
    for r in reports:
      self.counters[f"slice_bytes_in:{r['process']}"] += sum(r["wire_bytes"].values())

  def _emit(self, request_id: str, kind: str, *payload) -> None:
    request = self._admitted.get(request_id)
    if request is not None:
      request.events.put((kind, *payload))

  def _break(self, message: str, code: str = "UNAVAILABLE") -> None:
    with self._ending:
      if self.broken:
        return
      self.counters["jobs_failed"] += len(self._admitted)
      for request in self._admitted.values():
        request.events.put(("error", code, message))
        request.finished = True
      self._admitted.clear()
      self.broken = True
    if self.on_broken is not None:
      self.on_broken()

  def _fail_all(self, message: str) -> None:
    with self._cv:
      waiting = list(self._waiting)
      self._waiting.clear()
      self._drops.clear()
    for request in waiting:
      request.finished = True
      request.events.put(("error", "UNAVAILABLE", message))
