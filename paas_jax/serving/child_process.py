"""Child processes that signal readiness by writing a JSON file (launchers, tests).

``spawn`` starts ``python <args> --ready_file=<workdir>/<name>.ready.json`` with
its output in ``<workdir>/<name>.log``; ``wait_ready`` waits for a group of
them, failing with the log tail of one that exits first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Sequence

PY = sys.executable


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
