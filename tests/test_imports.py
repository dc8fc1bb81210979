"""Every module imports, and all of them can be imported into one process.

Modules that define absl flags at import time collide when two of them use
one name (the suite imports many modules into each worker): this is how
``--out`` broke the front-door tests once. Launchers under ``experiments/``
are scripts and are not imported by library code or tests.
"""

from __future__ import annotations

import subprocess
import sys


_IMPORT_ALL = """
import importlib, pkgutil, sys, paas_jax
# Stand-alone command-line tools: never imported by other modules, so their
# flags may reuse names (``--out``).
skip = {"paas_jax.netem.__main__", "paas_jax.security.make_certs", "paas_jax.tools.import_hf"}
names = [m.name for m in pkgutil.walk_packages(paas_jax.__path__, "paas_jax.")
         if m.name not in skip]
for name in names:
  importlib.import_module(name)
leaked = skip & set(sys.modules)
assert not leaked, f"library modules import stand-alone tools: {leaked}"
print(len(names))
"""


def test_all_modules_import_into_one_process():
  r = subprocess.run([sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert int(r.stdout.strip().splitlines()[-1]) > 50


def test_duplicate_flag_is_caught():
  # Negative control: two definitions of one flag name in one process fail.
  r = subprocess.run([sys.executable, "-c",
                      "from absl import flags\n"
                      "flags.DEFINE_string('out', None, 'a')\n"
                      "import paas_jax.security.make_certs\n"], capture_output=True, text=True,
                     timeout=120)
  assert r.returncode != 0 and "DuplicateFlagError" in r.stderr
