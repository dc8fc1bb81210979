"""Child processes that signal readiness by writing a JSON file (launchers, tests).

``spawn`` starts ``python <args> --ready_file=<workdir>/<name>.ready.json`` with
its output in ``<workdir>/<name>.log``; ``wait_ready`` waits for a group of
them, failing with the log tail of one that exits first.

A child started from the launcher's main thread dies with the launcher: it
calls ``die_with_parent`` first thing, which arms ``PR_SET_PDEATHSIG``.
Otherwise a launcher that crashed (a pytest worker's segfault did) left its
servers running, holding ports, memory and CPU. Linux sends that signal when
the *thread* that started the child ends, hence main thread only (a restart
from a monitor thread is not armed); and the child arms it itself, after
``exec``, rather than in a ``preexec_fn``, which can deadlock a parent that
runs other threads (JAX's).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

PY = sys.executable
# Set by ``spawn`` to the launcher's pid; read (and removed, so that the
# child's own children do not inherit it) by ``die_with_parent``.
PARENT_PID_ENV = "PAAS_JAX_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
  """``sig`` to this process when the thread that started it ends (Linux
  ``prctl``); whether it took effect."""
  try:
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig)) == 0
  except (OSError, AttributeError):
    return False


def die_with_parent() -> bool:
  """In a child ``spawn`` started: die (SIGKILL) when the launcher does; if
  it already has, exit now. Whether this process is armed: False when it was
  not started that way, off Linux, or in a grandchild that inherited the
  variable from a child that never read it (a supervisor's worker: its
  parent is the supervisor, which arms its workers itself)."""
  parent = os.environ.pop(PARENT_PID_ENV, "")
  if not parent:
    return False
  launcher = int(parent)
  if os.getppid() != launcher:
    if _exists(launcher):
      return False  # not the launcher's own child
    os._exit(1)  # the launcher is gone already  # pylint: disable=protected-access
  if not set_parent_death_signal():
    return False
  if os.getppid() != launcher:  # the launcher ended before the signal was armed
    os._exit(1)  # pylint: disable=protected-access
  return True


def _exists(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class LaunchError(RuntimeError):
  pass


@dataclasses.dataclass
class Proc:
  """A child process that signals readiness by writing a JSON file."""

  name: str
  popen: subprocess.Popen
  ready_file: pathlib.Path
  log_file: pathlib.Path
  info: dict = dataclasses.field(default_factory=dict)
  args: tuple = ()
  prefix: tuple = ()

  def log_tail(self, lines: int = 30) -> str:
    try:
      return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
      return ""

  def poll_ready(self) -> bool:
    if self.info:
      return True
    if self.popen.poll() is not None:
      raise LaunchError(f"{self.name} exited with {self.popen.returncode} before it was "
                        f"ready; last log lines:\n{self.log_tail()}")
    if self.ready_file.exists():
      self.info = json.loads(self.ready_file.read_text())
      return True
    return False

  def stop(self, timeout_s: float = 10.0) -> None:
    stop_process(self.popen, timeout_s)


def stop_process(popen: subprocess.Popen, timeout_s: float = 10.0) -> None:
  """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
  if popen.poll() is None:
    popen.send_signal(signal.SIGTERM)
    try:
      popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
      popen.kill()
      popen.wait(5)


def spawn(name: str, args: Sequence[str], workdir: pathlib.Path, *,
          prefix: Sequence[str] = (), env: dict | None = None) -> Proc:
  ready = workdir / f"{name}.ready.json"
  log = workdir / f"{name}.log"
  ready.unlink(missing_ok=True)
  full_env = dict(os.environ)
  full_env.update(env or {})
  full_env.setdefault("PYTHONUNBUFFERED", "1")
  full_env.pop(PARENT_PID_ENV, None)
  if threading.current_thread() is threading.main_thread():
    full_env[PARENT_PID_ENV] = str(os.getpid())
  with open(log, "a") as f:
    popen = subprocess.Popen([*prefix, PY, *args, f"--ready_file={ready}"], stdout=f,
                             stderr=subprocess.STDOUT, env=full_env,
                             cwd=str(pathlib.Path(__file__).resolve().parents[2]))
  return Proc(name, popen, ready, log, args=tuple(args), prefix=tuple(prefix))


def wait_ready(procs: Sequence[Proc], timeout_s: float, on_tick=None) -> None:
  deadline = time.monotonic() + timeout_s
  while True:
    if all(p.poll_ready() for p in procs):
      return
    if time.monotonic() > deadline:
      late = [p.name for p in procs if not p.info]
      raise LaunchError(f"{late} not ready after {timeout_s:.0f} s")
    if on_tick is not None:
      on_tick()
    time.sleep(0.1)
