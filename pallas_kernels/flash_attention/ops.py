"""Entry point for prefill attention (signature fixed by docs/CONTRACTS.md)."""

from __future__ import annotations

from pallas_kernels import _dispatch
from pallas_kernels.flash_attention import kernel, reference


def flash_attention(q, k, v, *, q_positions, kv_positions, window=None, q_segment_ids=None,
                    kv_segment_ids=None, sm_scale=None, block_q=128, block_k=128, impl="auto"):
  """Masked softmax attention with online softmax.

  Args:
    q: [batch, t, hq, d].
    k: [batch, s, hkv, d].
    v: [batch, s, hkv, dv]; hq % hkv == 0.
    q_positions: [batch, t] int32.
    kv_positions: [batch, s] int32; negative marks padding / empty slots.
    window: static sliding window (q_pos - kv_pos < window) or None.
    q_segment_ids, kv_segment_ids: [batch, t] / [batch, s] int32 or None.
    sm_scale: softmax scale, default d**-0.5.
    block_q, block_k: static tile sizes (queries / keys per tile). The XLA path
      uses block_k as its key-block size.
    impl: "auto" | "xla" | "pallas" | "pallas_interpret" | "reference".

  Returns:
    [batch, t, hq, dv] in q.dtype; rows that see no key are zero.
  """
  path = _dispatch.record("flash_attention", _dispatch.resolve_impl(impl))
  kwargs = dict(q_positions=q_positions, kv_positions=kv_positions, window=window,
                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, sm_scale=sm_scale)
  if path == "reference":
    return reference.attention_reference(q, k, v, **kwargs)
  if path == "xla":
    return reference.attention_xla(q, k, v, block_k=block_k, **kwargs)
  return kernel.flash_attention_pallas(q, k, v, block_q=block_q, block_k=block_k,
                                       backend=path, **kwargs)
