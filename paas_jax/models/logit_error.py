"""Logit error of one model against a reference on the same prompt (bf16 vs f32)."""

from __future__ import annotations

import numpy as np

from paas_jax.models import api


def logit_error(f32, bf16, prompt: list[int], steps: int) -> dict:
  """Logits of ``bf16`` against ``f32`` over a prefill and ``steps`` greedy steps.

  Both models are fed the reference (``f32``) model's greedy tokens, so the
  error does not compound through diverging tokens. ``prompt``: token ids
  ``[seq]``. Returns max |diff|, max |diff| / max |logit|, mean |diff| / mean
  |logit| and top-1 agreement over ``seq + steps`` positions.
  """
  logits32, s32 = api.prefill(f32, [prompt])
  logits16, s16 = api.prefill(bf16, [prompt])
  rows32, rows16 = [np.asarray(logits32[0])], [np.asarray(logits16[0], np.float32)]
  token = int(np.argmax(rows32[0][-1]))
  for _ in range(steps):
    l32, s32 = api.decode_step(f32, s32, [token])
    l16, s16 = api.decode_step(bf16, s16, [token])
    rows32.append(np.asarray(l32)[None, 0])
    rows16.append(np.asarray(l16, np.float32)[None, 0])
    token = int(np.argmax(rows32[-1][0]))
  a, b = np.concatenate(rows32), np.concatenate(rows16)
  diff = np.abs(a - b)
  return {"positions": int(a.shape[0]),
          "max_abs_diff": float(diff.max()),
          "max_rel_error": float(diff.max() / np.abs(a).max()),
          "mean_rel_error": float(diff.mean() / np.abs(a).mean()),
          "top1_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1)))}
