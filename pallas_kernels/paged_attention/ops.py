"""Entry points for paged decode attention (signatures fixed by docs/CONTRACTS.md)."""

from __future__ import annotations

from pallas_kernels import _dispatch
from pallas_kernels.paged_attention import kernel, reference


def paged_attention(q, k_pages, v_pages, lengths, page_table, *, sm_scale=None, window=None,
                    impl="auto"):
  """Attention of 1..n new tokens per sequence against a paged KV cache.

  Args:
    q: [batch, n, hq, d].
    k_pages: [num_pages, page_size, hkv, d].
    v_pages: [num_pages, page_size, hkv, dv]; hq % hkv == 0.
    lengths: [batch] int32 keys per sequence including the n new tokens; query
      i of sequence b sits at position lengths[b] - n + i.
    page_table: [batch, max_pages] int32 page ids (any order, non-contiguous).
    sm_scale: default d**-0.5.
    window: static sliding window or None.
    impl: "auto" | "xla" | "pallas" | "pallas_interpret" | "reference".

  Returns:
    [batch, n, hq, dv] in q.dtype.
  """
  path = _dispatch.record("paged_attention", _dispatch.resolve_impl(impl))
  if path in ("reference", "xla"):
    # Decode reads each key once; XLA's gather + dense softmax is already the
    # memory-bound optimum on CPU, so the XLA path is the reference itself.
    return reference.paged_attention_reference(q, k_pages, v_pages, lengths, page_table,
                                               sm_scale=sm_scale, window=window)
  return kernel.paged_attention_pallas(q, k_pages, v_pages, lengths, page_table,
                                       sm_scale=sm_scale, window=window, backend=path)


def paged_mla_attention(q_latent, q_rope, latent_pages, rope_pages, lengths, page_table, *,
                        sm_scale, impl="auto"):
  """Absorbed MLA decode attention over paged latent and rope-key caches.

  Args:
    q_latent: [batch, n, heads, r].
    q_rope: [batch, n, heads, dr].
    latent_pages: [num_pages, page_size, r].
    rope_pages: [num_pages, page_size, dr].
    lengths, page_table: as ``paged_attention``.
    sm_scale: softmax scale (required: it comes from the un-absorbed head dim).
    impl: as ``paged_attention``.

  Returns:
    [batch, n, heads, r] in q_latent.dtype (latent space; the caller applies W_uv).
  """
  path = _dispatch.record("paged_mla_attention", _dispatch.resolve_impl(impl))
  if path in ("reference", "xla"):
    return reference.paged_mla_reference(q_latent, q_rope, latent_pages, rope_pages, lengths,
                                         page_table, sm_scale=sm_scale)
  return kernel.paged_mla_attention_pallas(q_latent, q_rope, latent_pages, rope_pages, lengths,
                                           page_table, sm_scale=sm_scale, backend=path)
