"""Shared building blocks: norms, RoPE, dense and MoE feed-forward, causal conv."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paas_jax.models import moe_dispatch
from paas_jax.models.config import ModelConfig, MoEConfig


def dense(d_in: int, d_out: int, config: ModelConfig, rngs: nnx.Rngs,
          use_bias: bool = False) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=use_bias, dtype=config.compute_dtype,
                    param_dtype=config.weight_dtype,
                    kernel_init=nnx.initializers.normal(stddev=d_in ** -0.5),
                    rngs=rngs)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """RMS-normalises the last axis in f32 and returns ``x.dtype``."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned scale initialised to one.

  With ``plus_one`` the parameter stores ``scale - 1`` (initialised to zero)
  and the scaling runs in f32 before the cast back, which is how Qwen3-Next's
  checkpoints define their norms; converting those weights to plain scales
  would round ``1 + w`` to the parameter dtype.
  """

  def __init__(self, dim: int, eps: float, param_dtype=jnp.float32, plus_one: bool = False):
    self.eps = eps
    self.plus_one = plus_one
    self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.plus_one:
      y = rms_normalize(x.astype(jnp.float32), self.eps)
      return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
    return rms_normalize(x, self.eps) * self.scale[...].astype(x.dtype)


def make_norm(dim: int, config: ModelConfig, eps: float | None = None) -> RMSNorm:
  """An ``RMSNorm`` following the model's norm convention (``norm_plus_one``)."""
  return RMSNorm(dim, config.norm_eps if eps is None else eps, config.weight_dtype,
                 plus_one=config.norm_plus_one)


class GatedRMSNorm(nnx.Module):
  """Per-head RMSNorm of a mixer output, multiplied by an activated gate.

  Used on the outputs of gated delta rule and Mamba2 mixers:
  ``norm(y) * act(z)`` over the last axis (one head or one group).
  """

  def __init__(self, dim: int, eps: float, activation: str = "silu",
               param_dtype=jnp.float32):
    self.eps = eps
    self.activation = activation
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
    gate = jax.nn.silu(z) if self.activation == "silu" else jax.nn.sigmoid(z)
    return rms_normalize(y, self.eps) * self.scale[...].astype(y.dtype) * gate


def rope_frequencies(rot_dim: int, theta: float) -> jax.Array:
  """Inverse frequencies [rot_dim // 2] (f32)."""
  return 1.0 / (theta ** (jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim))


def apply_rope(x: jax.Array, positions: jax.Array, rot_dim: int, theta: float) -> jax.Array:
  """Rotates the first ``rot_dim`` channels of ``x`` (half-split convention).

  Args:
    x: [batch, seq, heads, head_dim] (or [batch, seq, head_dim]).
    positions: int32 [batch, seq], absolute token positions.
  """
  squeeze = x.ndim == 3
  if squeeze:
    x = x[:, :, None, :]
  angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(rot_dim, theta)
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  rot, rest = x[..., :rot_dim].astype(jnp.float32), x[..., rot_dim:]
  x1, x2 = jnp.split(rot, 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  out = jnp.concatenate([rotated.astype(x.dtype), rest], axis=-1)
  return out[:, :, 0, :] if squeeze else out


def _hidden_activation(up: jax.Array, gate: jax.Array | None) -> jax.Array:
  """SwiGLU ``silu(gate) * up`` or, without a gate, squared ReLU ``relu(up)**2``."""
  if gate is None:
    return jnp.square(jax.nn.relu(up))
  return jax.nn.silu(gate) * up


class MLP(nnx.Module):
  """Dense feed-forward, ``down(act(x))`` with ``config.ffn_activation``:
  SwiGLU ``silu(gate(x)) * up(x)`` or squared ReLU ``relu(up(x))**2`` (no gate)."""

  def __init__(self, d_model: int, d_ff: int, config: ModelConfig, rngs: nnx.Rngs):
    swiglu = config.ffn_activation == "swiglu"
    self.gate = dense(d_model, d_ff, config, rngs) if swiglu else None
    self.up = dense(d_model, d_ff, config, rngs)
    self.down = dense(d_ff, d_model, config, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate = self.gate(x) if self.gate is not None else None
    return self.down(_hidden_activation(self.up(x), gate))


class MoE(nnx.Module):
  """Top-k mixture of experts with optional always-on shared experts.

  Experts use ``config.ffn_activation`` (SwiGLU, or squared ReLU without a
  gate projection). Routing follows ``MoEConfig`` (softmax or sigmoid scores,
  optional balancing bias and group-limited choice, normalisation, scale;
  see ``moe_dispatch.route``).

  ``dispatch`` selects the evaluation (a static attribute, part of the graph
  definition): ``"sparse"`` (default) sorts the (token, expert) assignments
  by expert and runs grouped matmuls over the chosen pairs only
  (``moe_dispatch.sparse_experts``); ``"dense"`` evaluates every expert on
  every token and combines with the (sparse) routing weights, the simple
  reference the sparse path is tested against. ``impl`` picks the grouped
  matmul's implementation (``pallas_kernels`` impl names).
  """

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dispatch: str = "sparse",
               impl: str = "auto"):
    moe: MoEConfig = config.moe
    self.moe = moe
    self.dispatch = dispatch
    self.impl = impl
    d, e, f = config.d_model, moe.n_experts, moe.d_expert
    init = nnx.initializers.normal(stddev=d ** -0.5)
    if moe.router_in_fp32:
      # Expert choice is discontinuous in the router logits; DeepSeek-V3-style
      # models keep the router weight and its matmul in f32 for that reason.
      self.router = nnx.Linear(d, e, use_bias=False, dtype=jnp.float32,
                               param_dtype=jnp.float32,
                               kernel_init=nnx.initializers.normal(stddev=d ** -0.5),
                               rngs=rngs)
    else:
      self.router = dense(d, e, config, rngs)
    self.w_gate = (nnx.Param(init(rngs.params(), (e, d, f), config.weight_dtype))
                   if config.ffn_activation == "swiglu" else None)
    self.w_up = nnx.Param(init(rngs.params(), (e, d, f), config.weight_dtype))
    self.w_down = nnx.Param(nnx.initializers.normal(stddev=f ** -0.5)(
        rngs.params(), (e, f, d), config.weight_dtype))
    self.shared = MLP(d, moe.shared_width, config, rngs) if moe.shared_width else None
    # Optional parts are drawn after the original ones, so configs that do not
    # use them keep their random initialisation.
    self.shared_gate = (dense(d, 1, config, rngs)
                        if moe.shared_gate and self.shared is not None else None)
    self.score_bias = (nnx.Param(jnp.zeros((e,), jnp.float32))
                       if moe.score_correction_bias else None)

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(top_idx int32 [..., top_k], top_weights f32 [..., top_k]) for x [..., d]."""
    logits = self.router(x).astype(jnp.float32)  # an f32 router casts x itself
    bias = None if self.score_bias is None else self.score_bias[...]
    return moe_dispatch.route(self.moe, logits, bias)

  def routing_weights(self, x: jax.Array) -> jax.Array:
    """Dense routing weights [..., n_experts], zero outside each token's top-k."""
    return moe_dispatch.dense_weights(*self.route(x), self.moe.n_experts)

  def _dense_experts(self, x: jax.Array) -> jax.Array:
    weights = self.routing_weights(x).astype(x.dtype)
    dt = x.dtype
    gate = (jnp.einsum("...d,edf->...ef", x, self.w_gate[...].astype(dt))
            if self.w_gate is not None else None)
    h = _hidden_activation(jnp.einsum("...d,edf->...ef", x, self.w_up[...].astype(dt)), gate)
    return jnp.einsum("...ef,efd,...e->...d", h, self.w_down[...].astype(dt), weights)

  def _sparse_experts(self, x: jax.Array) -> jax.Array:
    dt = x.dtype
    flat = x.reshape(-1, x.shape[-1])
    top_idx, top_weights = self.route(flat)
    y = moe_dispatch.sparse_experts(
        flat, top_idx, top_weights,
        self.w_gate[...].astype(dt) if self.w_gate is not None else None,
        self.w_up[...].astype(dt), self.w_down[...].astype(dt), _hidden_activation,
        impl=self.impl)
    return y.reshape(x.shape)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.dispatch == "sparse":
      y = self._sparse_experts(x)
    elif self.dispatch == "dense":
      y = self._dense_experts(x)
    else:
      raise ValueError(f"MoE.dispatch must be one of {moe_dispatch.DISPATCH_MODES}, "
                       f"got {self.dispatch!r}")
    if self.shared is not None:
      shared = self.shared(x)
      if self.shared_gate is not None:
        shared = shared * jax.nn.sigmoid(self.shared_gate(x))
      y = y + shared
    return y


class CausalConv1d(nnx.Module):
  """Depthwise causal convolution with a carried tail of the last inputs.

  Weight: [kernel, channels]; optional bias [channels] (Mamba2's conv bias).
  Prefill prepends the cached tail ``conv_state`` [batch, kernel - 1, channels],
  so chunked prefill continues exactly.
  """

  def __init__(self, channels: int, kernel: int, config: ModelConfig, rngs: nnx.Rngs,
               use_bias: bool = False):
    self.kernel = kernel
    self.weight = nnx.Param(nnx.initializers.normal(stddev=kernel ** -0.5)(
        rngs.params(), (kernel, channels), config.weight_dtype))
    self.bias = nnx.Param(jnp.zeros((channels,), config.weight_dtype)) if use_bias else None

  def __call__(self, x: jax.Array, conv_state: jax.Array, n_valid: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Convolves a right-padded chunk.

    Args:
      x: [batch, seq, channels].
      conv_state: [batch, kernel - 1, channels], inputs before this chunk.
      n_valid: int32 [batch], valid (non-padding) tokens of each row.

    Returns:
      (y [batch, seq, channels], new conv_state: the last ``kernel - 1`` valid inputs).
    """
    k = self.kernel
    seq = x.shape[1]
    full = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
    w = self.weight[...].astype(x.dtype)
    y = sum(full[:, i:i + seq] * w[i] for i in range(k))
    if self.bias is not None:
      y = y + self.bias[...].astype(x.dtype)
    if k == 1:
      return y, conv_state
    # Token j of the chunk sits at index j + k - 1 of `full`; the tail after
    # n_valid tokens is full[n_valid : n_valid + k - 1].
    idx = n_valid[:, None] + jnp.arange(k - 1)[None, :]
    new_state = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return y, new_state.astype(conv_state.dtype)

  def step(self, x: jax.Array, conv_state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token: x [batch, channels] -> (y [batch, channels], new conv_state)."""
    full = jnp.concatenate([conv_state.astype(x.dtype), x[:, None]], axis=1)
    y = jnp.einsum("bkc,kc->bc", full, self.weight[...].astype(x.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(x.dtype)
    return y, full[:, 1:].astype(conv_state.dtype)
