"""Attention and linear-recurrence kernels for paas-jax.

Each op lives in its own folder: ``reference.py`` (pure jnp, naive), the fast XLA
form used on CPU, Pallas kernels, and ``ops.py`` as the single entry point whose
signatures are fixed by ``docs/CONTRACTS.md``.
"""

from pallas_kernels._dispatch import IMPLS, clear_impl_records, last_impl, resolve_impl

__all__ = ["IMPLS", "clear_impl_records", "last_impl", "resolve_impl"]
