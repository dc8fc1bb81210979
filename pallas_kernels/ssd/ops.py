"""Entry points for the Mamba2 SSD scan (signatures fixed by docs/CONTRACTS.md)."""

from __future__ import annotations

from pallas_kernels import _dispatch
from pallas_kernels.ssd import kernel, reference


def ssd(x, dt, A, B, C, *, initial_state=None, chunk_size=64, impl="auto"):  # pylint: disable=invalid-name
  """Chunked SSD scan over a prefill segment.

  Args:
    x: [batch, seq, heads, head_dim].
    dt: [batch, seq, heads] step sizes (already softplus-ed by the caller).
    A: [heads] (negative).
    B, C: [batch, seq, groups, state_dim]; head i uses group i // (heads // groups).
    initial_state: [batch, heads, head_dim, state_dim] f32 or None (zeros).
    chunk_size: static tokens per chunk; seq needs not be a multiple.
    impl: "auto" | "xla" | "pallas" | "pallas_interpret" | "reference".

  Returns:
    (y [batch, seq, heads, head_dim] in x.dtype,
     final_state [batch, heads, head_dim, state_dim] f32).
  """
  path = _dispatch.record("ssd", _dispatch.resolve_impl(impl))
  if path == "reference":
    return reference.ssd_naive(x, dt, A, B, C, initial_state=initial_state)
  if path == "xla":
    return reference.ssd_xla(x, dt, A, B, C, initial_state=initial_state, chunk_size=chunk_size)
  return kernel.ssd_pallas(x, dt, A, B, C, initial_state=initial_state, chunk_size=chunk_size,
                           backend=path)


def ssd_step(x, dt, A, B, C, state, *, impl="auto"):  # pylint: disable=invalid-name
  """One decode token of the SSD recurrence.

  Args:
    x: [batch, heads, head_dim].
    dt: [batch, heads].
    A: [heads].
    B, C: [batch, groups, state_dim].
    state: [batch, heads, head_dim, state_dim] f32.
    impl: as for ``ssd``. One token is elementwise work plus a mat-vec that
      XLA fuses; every impl runs the same jnp code (recorded as "xla").

  Returns:
    (y [batch, heads, head_dim] in x.dtype, new_state f32).
  """
  path = _dispatch.resolve_impl(impl)
  _dispatch.record("ssd_step", "reference" if path == "reference" else "xla")
  return reference.ssd_step_reference(x, dt, A, B, C, state)
