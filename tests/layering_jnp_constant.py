"""A module that creates a JAX array at import (the negative control of
``tests/test_layering.py::test_importing_the_pod_processes_starts_no_jax_backend``)."""

import jax.numpy as jnp

SIGN = jnp.uint32(0x80000000)
