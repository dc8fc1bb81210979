"""Jobs that every process of a region (a prefill pod, a decode slice) runs in lockstep.

Process 0 takes the RPCs and publishes each job, numbered 1, 2, ..., under
``<prefix>/<n>`` in the region's coordination key-value store; processes
1..N-1 (``follow``) take the jobs in order, run them and report under
``<prefix>/<n>/done/<p>``; process 0 runs its own part, then ``gather``s the
others' reports with the region's deadline and deletes ``<prefix>/<n>`` with
everything under it (the store does not grow with the requests served). A
process that cannot report (dead, stuck in a collective) makes ``gather``
raise ``LockstepLost``: the region is out of lockstep and restarts as a unit.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

log = logging.getLogger("paas_jax.serving.lockstep")

IDLE_POLL_MS = 5_000


class LockstepLost(Exception):
  """A process of the region did not report in time (``code``: a gRPC code name)."""

  def __init__(self, code: str, message: str):
    super().__init__(message)
    self.code = code
    self.message = message


def job_key(prefix: str, n: int) -> str:
  return f"{prefix}/{n}"


def done_key(prefix: str, n: int, p: int) -> str:
  return f"{prefix}/{n}/done/{p}"


def is_deadline(e: Exception) -> bool:
  return "DEADLINE_EXCEEDED" in str(e) or "deadline" in str(e).lower()


def follow(kv, prefix: str, process_id: int, run: Callable[[str], dict]) -> None:
  """Processes 1..N-1: ``run(job_json)`` every job process 0 publishes, in
  order, for ever, reporting what it returns. A job that raises is reported
  as failed (UNAVAILABLE) and re-raised: the process is out of lockstep and
  exits, so that its region restarts as a unit. A broken store raises."""
  n = 1
  while True:
    try:
      data = kv.blocking_key_value_get(job_key(prefix, n), IDLE_POLL_MS)
    except Exception as e:  # pylint: disable=broad-except
      if is_deadline(e):
        continue  # idle
      raise
    try:
      report = run(data)
    except Exception as e:
      log.exception("%s job %d failed", prefix, n)
      kv.key_value_set(done_key(prefix, n, process_id), json.dumps(
          {"ok": False, "process": process_id, "code": "UNAVAILABLE", "error": repr(e)}))
      raise
    kv.key_value_set(done_key(prefix, n, process_id), json.dumps(report))
    n += 1


def gather(kv, prefix: str, n: int, num_processes: int, timeout_s: float, what: str
           ) -> list[dict]:
  """Process 0: the reports of processes 1..N-1 on job ``n`` (``what``: the
  request, for messages), then the job's keys are deleted.

  Raises:
    LockstepLost: a process did not report within ``timeout_s``.
  """
  reports = []
  deadline = time.monotonic() + timeout_s
  for p in range(1, num_processes):
    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
      reports.append(json.loads(kv.blocking_key_value_get(done_key(prefix, n, p), left_ms)))
    except Exception as e:  # pylint: disable=broad-except
      raise LockstepLost("DEADLINE_EXCEEDED" if is_deadline(e) else "UNAVAILABLE",
                         f"process {p} did not report {what} within {timeout_s:.0f}s: "
                         f"{e}") from None
  kv.key_value_delete(job_key(prefix, n))
  return reports


def lead(kv, prefix: str, n: int, data: str, run_own: Callable[[], dict],
         num_processes: int, timeout_s: float, what: str) -> list[dict]:
  """Process 0: publishes job ``n`` (``data``, for ``follow``), runs its own
  part and returns every process's report, its own first (``kv`` None: a
  single-process region, only its own).

  Raises:
    LockstepLost: as ``gather``.
  """
  if kv is not None:
    kv.key_value_set(job_key(prefix, n), data)
  reports = [run_own()]
  if kv is not None:
    reports += gather(kv, prefix, n, num_processes, timeout_s, what)
  return reports


def agree(kv, key: str, process_id: int, num_processes: int, timeout_s: float,
          mine: dict) -> list[dict]:
  """Every process posts ``mine`` under ``<key>/<p>`` and reads everyone's (in
  rank order), so that all take the same decision on a step only some of
  them may have failed (e.g. receiving their shards). Keys under a job's
  prefix go with the job.

  Raises:
    LockstepLost: a process did not post within ``timeout_s``.
  """
  kv.key_value_set(f"{key}/{process_id}", json.dumps(mine))
  out = []
  deadline = time.monotonic() + timeout_s
  for p in range(num_processes):
    if p == process_id:
      out.append(mine)
      continue
    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
      out.append(json.loads(kv.blocking_key_value_get(f"{key}/{p}", left_ms)))
    except Exception as e:  # pylint: disable=broad-except
      raise LockstepLost("DEADLINE_EXCEEDED" if is_deadline(e) else "UNAVAILABLE",
                         f"process {p} did not post {key} within {timeout_s:.0f}s: "
                         f"{e}") from None
  return out
