"""Children started by ``child_process.spawn`` die with the launcher.

A launcher (here a small Python process) spawns a child that calls
``die_with_parent`` like every server's main does, then is killed with
SIGKILL, as a crashed pytest worker or launcher would be: the child must go
too. Negative control: spawned from a thread other than the main one (which
``spawn`` does not arm, since Linux signals the end of that thread), the same
child outlives its launcher.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from paas_jax.serving import child_process

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
  import json, os, sys, time
  from paas_jax.serving import child_process
  armed = child_process.die_with_parent()
  ready = sys.argv[-1].split("=", 1)[1]
  with open(ready + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "armed": armed,
               "env_left": child_process.PARENT_PID_ENV in os.environ}, f)
  os.replace(ready + ".tmp", ready)
  time.sleep(120)
""")

LAUNCHER = textwrap.dedent("""
  import json, pathlib, sys, threading, time
  from paas_jax.serving import child_process
  workdir, from_thread, code = pathlib.Path(sys.argv[1]), sys.argv[2] == "thread", sys.argv[3]
  procs = []
  start = lambda: procs.append(child_process.spawn("child", ["-c", code], workdir))
  if from_thread:
    t = threading.Thread(target=start)
    t.start()
    t.join()
  else:
    start()
  child_process.wait_ready(procs, 60)
  print(json.dumps(procs[0].info), flush=True)
  time.sleep(120)
""")


def _alive(pid: int) -> bool:
  try:
    state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except OSError:
    return False
  return state not in ("Z", "X")  # a zombie is dead, whoever reaps it


def _launch_and_kill(tmp_path: pathlib.Path, how: str) -> tuple[dict, bool]:
  """(the child's report, whether it is still alive 5 s after its launcher was killed)."""
  launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), how, CHILD],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
  try:
    info = json.loads(launcher.stdout.readline())
  finally:
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(10)
  deadline = time.monotonic() + 5
  while _alive(info["pid"]) and time.monotonic() < deadline:
    time.sleep(0.05)
  alive = _alive(info["pid"])
  if alive:
    os.kill(info["pid"], signal.SIGKILL)
  return info, alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_launcher(tmp_path):
  info, alive = _launch_and_kill(tmp_path, "main")
  assert info["armed"]
  assert not info["env_left"]  # its own children are not armed for a process they lack
  assert not alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_negative_control_a_child_not_armed_outlives_its_launcher(tmp_path):
  info, alive = _launch_and_kill(tmp_path, "thread")
  assert not info["armed"]
  assert alive


SUPERVISOR = textwrap.dedent("""
  import json, os, subprocess, sys, time
  # Like a pod or slice supervisor that starts its workers itself: it never
  # reads the variable, so its worker inherits it.
  grandchild = subprocess.run(
      [sys.executable, "-c", "import json; from paas_jax.serving import child_process; "
       "print(json.dumps(child_process.die_with_parent()))"],
      capture_output=True, text=True, timeout=60)
  ready = sys.argv[-1].split("=", 1)[1]
  with open(ready + ".tmp", "w") as f:
    json.dump({"returncode": grandchild.returncode, "armed": grandchild.stdout.strip()}, f)
  os.replace(ready + ".tmp", ready)
  time.sleep(120)  # a supervisor stays up (wait_ready fails on a child that exits)
""")


def test_a_grandchild_that_inherits_the_variable_runs_on_unarmed(tmp_path):
  """Its parent is not the launcher: it is not armed and must not exit (a
  slice supervisor's workers exited with 1 when they took it for an orphan)."""
  proc = child_process.spawn("supervisor", ["-c", SUPERVISOR], tmp_path)
  try:
    child_process.wait_ready([proc], 60)
  finally:
    proc.stop()
  assert proc.info == {"returncode": 0, "armed": "false"}
