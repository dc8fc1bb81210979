"""Test-wide setup, done before jax is imported anywhere.

* 8 fake CPU devices for the sharding tests.
* A persistent compilation cache for the server processes that tests spawn
  (they inherit $PAAS_JAX_COMPILATION_CACHE and turn it on, see
  ``common.enable_compilation_cache``), so a program compiles once per run
  instead of once per server. The pytest workers themselves keep it off: XLA:CPU
  crashed a worker now and then (SIGSEGV in libgcc's unwinder, reached from
  ``executable.serialize()`` in ``compilation_cache.put_executable_and_time``,
  always while a worker wrote a fresh entry). A worker that never serializes
  cannot hit it; the in-process tests recompile instead.
"""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX reads $JAX_COMPILATION_CACHE_DIR at import and would turn the cache on in
# the worker itself, so a directory given that way goes to the servers only.
os.environ.setdefault("PAAS_JAX_COMPILATION_CACHE",
                      os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
                      or str(pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"))
