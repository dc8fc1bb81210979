"""Entry points for the gated delta rule (signatures fixed by docs/CONTRACTS.md)."""

from __future__ import annotations

from pallas_kernels import _dispatch
from pallas_kernels.gated_delta import kernel, reference


def chunk_gated_delta(q, k, v, g, beta, *, initial_state=None, chunk_size=64, scale=None,
                      impl="auto"):
  """Chunked gated delta rule over a prefill segment.

  Args:
    q, k: [batch, seq, heads, dk] (normalisation is the caller's job).
    v: [batch, seq, heads, dv].
    g: log decay (<= 0), [batch, seq, heads] (GDN) or [batch, seq, heads, dk] (KDA).
    beta: [batch, seq, heads].
    initial_state: [batch, heads, dk, dv] f32, or None for zeros.
    chunk_size: static tokens per chunk; seq needs not be a multiple.
    scale: query scale, default dk**-0.5.
    impl: "auto" | "xla" | "pallas" | "pallas_interpret" | "reference".

  Returns:
    (o [batch, seq, heads, dv] in q.dtype, final_state [batch, heads, dk, dv] f32).
  """
  path = _dispatch.record("chunk_gated_delta", _dispatch.resolve_impl(impl))
  if path == "reference":
    return reference.gated_delta_naive(q, k, v, g, beta, initial_state=initial_state, scale=scale)
  if path == "xla":
    return reference.chunk_gated_delta_xla(q, k, v, g, beta, initial_state=initial_state,
                                           chunk_size=chunk_size, scale=scale)
  return kernel.chunk_gated_delta_pallas(
      q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size, scale=scale,
      backend=path)


def gated_delta_step(q, k, v, g, beta, state, *, scale=None, impl="auto"):
  """One decode token of the gated delta rule.

  Args:
    q, k: [batch, heads, dk].
    v: [batch, heads, dv].
    g: [batch, heads] or [batch, heads, dk] log decay.
    beta: [batch, heads].
    state: [batch, heads, dk, dv] f32.
    impl: as for ``chunk_gated_delta``. A single token is a handful of
      elementwise ops and two mat-vecs, which XLA fuses well; a Pallas kernel
      would only add launch overhead, so every impl runs the same jnp code.

  Returns:
    (o [batch, heads, dv] in q.dtype, new_state [batch, heads, dk, dv] f32).
  """
  path = _dispatch.resolve_impl(impl)
  _dispatch.record("gated_delta_step", "reference" if path == "reference" else "xla")
  return reference.gated_delta_step_reference(q, k, v, g, beta, state, scale=scale)
