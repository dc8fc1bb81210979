"""Log-probabilities of sampled tokens, on the device (see ``logprobs`` for the semantics).

One small jitted op over a step's logits, run only for steps where some
request asked for logprobs: requests that did not ask cost nothing (no extra
device work, no extra host transfer).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.serving.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, from_rows


@functools.partial(jax.jit, static_argnums=2)
def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int = MAX_TOP_LOGPROBS):
  """Log-probabilities of ``tokens`` and the ``k`` most likely tokens per row.

  Args:
    logits: [batch, vocab] (any float dtype; computed in f32), the logits the
      tokens were sampled from.
    tokens: int32 [batch], the sampled tokens.
    k: alternatives returned per row (static; at most the vocabulary).

  Returns:
    (f32 [batch] log p(token), int32 [batch, k] top ids largest first,
    f32 [batch, k] their log-probabilities).
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  sampled = jnp.take_along_axis(logp, tokens.astype(jnp.int32)[:, None], axis=-1)[:, 0]
  top_values, top_ids = jax.lax.top_k(logp, min(k, logp.shape[-1]))
  return sampled, top_ids.astype(jnp.int32), top_values


def rows_logprobs(logits: jax.Array, tokens, rows: Sequence[int],
                  tops: Sequence[int]) -> list[TokenLogprob]:
  """``TokenLogprob`` of batch rows ``rows`` (``tops``: alternatives per row).

  ``logits`` [batch, vocab] on the device, ``tokens`` int [batch]; one device
  op and one host transfer of [batch, MAX_TOP_LOGPROBS] for the whole batch.
  """
  lp, ids, values = token_logprobs(logits, jnp.asarray(np.asarray(tokens, np.int32)))
  lp, ids, values = np.asarray(lp), np.asarray(ids), np.asarray(values)
  rows = list(rows)
  return from_rows([int(np.asarray(tokens)[r]) for r in rows], lp[rows], ids[rows],
                   values[rows], tops)
