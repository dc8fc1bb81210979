"""The suite's rerun after a worker crash (``tests/conftest.py``), on a scratch
suite run by a real pytest with two xdist workers and this repo's conftest:

* a test that segfaults its worker once: it and the test the crash kept from
  running pass in the rerun, and the run passes;
* the control, a crash beside a real failure: no rerun, the run fails;
* the control, a test that crashes every time: the rerun crashes too, and the
  run fails.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")

CRASHER = """
import ctypes, pathlib
FLAG = pathlib.Path(__file__).with_name("crashed_once")
def test_before(): pass
def test_crashes():
    if {always} or not FLAG.exists():
        FLAG.write_text("x")
        ctypes.string_at(0)  # SIGSEGV: the worker dies
def test_after(): pass
"""


def _run(tmp_path: pathlib.Path, always: bool, real_failure: bool):
  suite = tmp_path / "tests"
  suite.mkdir()
  shutil.copy(CONFTEST, suite / "conftest.py")
  (suite / "test_crasher.py").write_text(CRASHER.format(always=always))
  (suite / "test_other.py").write_text(
      f"def test_fine(): pass\ndef test_maybe(): assert not {real_failure}\n")
  env = {k: v for k, v in os.environ.items() if k != "PAAS_JAX_CRASH_RERUN"}
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
       "-n", "2", "--dist", "loadfile", "--max-worker-restart=0", "tests"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("always, real_failure, passes", [
    (False, False, True),   # crashes once: rerun, passes
    (False, True, False),   # control: a real failure besides
    (True, False, False),   # control: crashes again in the rerun
])
def test_a_crashed_worker_is_rerun_once_and_only_alone(tmp_path, always, real_failure, passes):
  proc = _run(tmp_path, always, real_failure)
  out = proc.stdout + proc.stderr
  assert "crashed while running 'tests/test_crasher.py::test_crashes'" in out, out[-3000:]
  assert (proc.returncode == 0) == passes, out[-3000:]
  assert ("rerunning it" in out) == (not real_failure), out[-3000:]
  if passes:
    assert "rerun after the worker crash: exit status 0" in out
