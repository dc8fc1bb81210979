"""Mixture-of-experts routing and sparse token-to-expert dispatch.

Routing (shared by the dense and the sparse evaluation) covers the three
families' variants: softmax top-k with optional renormalisation (Qwen3-Next),
and sigmoid scores with a balancing bias used for choice only, group-limited
choice and a routed scale (Kimi Linear / DeepSeek-V3, Nemotron-H).

Sparse dispatch: the ``tokens * top_k`` (token, expert) assignments are sorted
by expert, the token rows are gathered in that order and every expert's rows
are multiplied by its own weights with one grouped matmul per projection
(``pallas_kernels.grouped_matmul``); the outputs are gathered back to
assignment order and combined with the routing weights. Every assignment is
computed (no capacity, no dropping), so the result equals the dense
evaluation up to float summation order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paas_jax.models.config import MoEConfig
from pallas_kernels.grouped_matmul.ops import grouped_matmul

DISPATCH_MODES = ("sparse", "dense")


def keep_top_groups(moe: MoEConfig, choice: jax.Array) -> jax.Array:
  """Masks (-inf) the experts outside each token's ``top_k_groups`` groups,
  ranking groups by the sum of their two best scores (DeepSeek-V3)."""
  per_group = moe.n_experts // moe.n_groups
  grouped = choice.reshape(choice.shape[:-1] + (moe.n_groups, per_group))
  group_score = jnp.sum(jax.lax.top_k(grouped, min(2, per_group))[0], axis=-1)
  _, top_groups = jax.lax.top_k(group_score, moe.top_k_groups)
  keep = jnp.any(top_groups[..., :, None] == jnp.arange(moe.n_groups), axis=-2)
  return jnp.where(jnp.repeat(keep, per_group, axis=-1), choice, -jnp.inf)


def route(moe: MoEConfig, logits: jax.Array, score_bias: jax.Array | None
          ) -> tuple[jax.Array, jax.Array]:
  """Chooses each token's experts and their weights.

  Args:
    moe: routing settings.
    logits: f32 [..., n_experts] router logits.
    score_bias: f32 [n_experts] balancing bias (added for choice only), or None.

  Returns:
    (top_idx int32 [..., top_k], top_weights f32 [..., top_k]).
  """
  scores = (jax.nn.softmax(logits, axis=-1) if moe.router == "softmax"
            else jax.nn.sigmoid(logits))
  choice = scores if score_bias is None else scores + score_bias
  if moe.n_groups > 1:
    choice = keep_top_groups(moe, choice)
  _, top_idx = jax.lax.top_k(choice, moe.top_k)
  top_vals = jnp.take_along_axis(scores, top_idx, axis=-1)
  if moe.normalize_top_k:
    top_vals = top_vals / jnp.sum(top_vals, axis=-1, keepdims=True)
  if moe.routed_scale != 1.0:
    top_vals = top_vals * moe.routed_scale
  return top_idx.astype(jnp.int32), top_vals


def dense_weights(top_idx: jax.Array, top_weights: jax.Array, n_experts: int) -> jax.Array:
  """Routing as dense weights f32 [..., n_experts], zero outside the top-k."""
  onehot = jax.nn.one_hot(top_idx, n_experts, dtype=jnp.float32)
  return jnp.einsum("...k,...ke->...e", top_weights, onehot)


def sort_by_expert(top_idx: jax.Array, n_experts: int):
  """Orders the flat (token, slot) assignments by expert.

  Args:
    top_idx: int32 [tokens, top_k].

  Returns:
    (order int32 [tokens * top_k]: assignment at each sorted position,
     inverse int32 [tokens * top_k]: sorted position of each assignment,
     group_sizes int32 [n_experts]).
  """
  flat = top_idx.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
  group_sizes = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
  return order, inverse, group_sizes


def sparse_experts(x: jax.Array, top_idx: jax.Array, top_weights: jax.Array,
                   w_gate: jax.Array | None, w_up: jax.Array, w_down: jax.Array,
                   activation, *, impl: str = "auto") -> jax.Array:
  """The routed experts' output, evaluating only the chosen (token, expert) pairs.

  Args:
    x: [tokens, d] in the compute dtype.
    top_idx / top_weights: [tokens, top_k] from ``route``.
    w_gate, w_up: [n_experts, d, f] (``w_gate`` None for ungated experts);
      w_down: [n_experts, f, d], all already in the compute dtype.
    activation: ``act(up, gate_or_None)`` -> hidden.
    impl: grouped-matmul implementation (see ``pallas_kernels``).

  Returns:
    [tokens, d] in x.dtype: sum over each token's k experts of weight * expert(x).
  """
  tokens, top_k = top_idx.shape
  n_experts = w_up.shape[0]
  order, inverse, group_sizes = sort_by_expert(top_idx, n_experts)
  rows = jnp.take(x, order // top_k, axis=0)                          # [tokens*k, d]

  def gmm(lhs, w):
    return grouped_matmul(lhs, w, group_sizes, impl=impl, out_dtype=x.dtype)

  gate = gmm(rows, w_gate) if w_gate is not None else None
  hidden = activation(gmm(rows, w_up), gate)
  out = jnp.take(gmm(hidden, w_down), inverse, axis=0)                # assignment order
  out = out.reshape(tokens, top_k, -1)
  return jnp.einsum("tkd,tk->td", out, top_weights.astype(x.dtype))
