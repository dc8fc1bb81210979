"""Test-wide setup, done before jax is imported anywhere.

* 8 fake CPU devices for the sharding tests.
* A persistent compilation cache shared by the xdist workers and by the server
  processes that tests spawn (they inherit the environment), so each distinct
  program compiles once per run instead of once per process.
"""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
