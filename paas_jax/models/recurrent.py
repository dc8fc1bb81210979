"""Recurrent mixers: gated delta rule linear attention (``G``) and Mamba2 (``m``).

Prefill runs the chunked scans of ``pallas_kernels`` (chunk length from the
config, 64 by default) starting from the cached state; decode runs their
single-step recurrences. Right padding inside a prefill chunk is neutralised by
zeroing the decay exponent and the write strength (``g = 0, beta = 0`` for the
delta rule, ``dt = 0`` for SSD), which leaves the recurrent state untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from pallas_kernels.gated_delta.ops import chunk_gated_delta, gated_delta_step
from pallas_kernels.ssd.ops import ssd, ssd_step
from paas_jax.models.attention import Chunk
from paas_jax.models.config import ModelConfig
from paas_jax.models.layers import CausalConv1d, GatedRMSNorm, dense, rms_normalize


# -- caches (fixed-size recurrent state; f32 whatever the activation dtype) ---------

@struct.dataclass
class GatedDeltaCache:
  """``conv`` [batch, conv_kernel - 1, conv_channels] (last inputs of the short
  convolution) and ``recurrent`` [batch, v_heads, head_k_dim, head_v_dim] f32."""

  conv: jax.Array
  recurrent: jax.Array


@struct.dataclass
class Mamba2Cache:
  """``conv`` [batch, conv_kernel - 1, conv_channels] and ``ssm``
  [batch, heads, head_dim, d_state] f32."""

  conv: jax.Array
  ssm: jax.Array


def _l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
  """Gated delta rule mixer with short causal convolutions on q, k and v.

  ``gate="gdn"``: Gated DeltaNet, log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``
  per value head. ``gate="kda"``: Kimi Delta Attention, the same form per key
  channel, with ``a`` from a low-rank projection. Queries and keys are
  L2-normalised per head and shared across groups of value heads. The output
  is ``o_proj(norm(o) * act(z))`` with ``z`` from ``z_proj``, or from the
  low-rank pair ``z_a``, ``z_b`` when ``output_gate_rank`` is set (KDA).
  """

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    g = config.gated_delta
    self.cfg = g
    self.impl = "auto"  # kernel implementation (pallas_kernels impl names)
    d = config.d_model
    self.key_width = g.n_k_heads * g.head_k_dim
    self.value_width = g.n_v_heads * g.head_v_dim
    self.q_proj = dense(d, self.key_width, config, rngs)
    self.k_proj = dense(d, self.key_width, config, rngs)
    self.v_proj = dense(d, self.value_width, config, rngs)
    self.conv = CausalConv1d(2 * self.key_width + self.value_width, g.conv_kernel,
                             config, rngs)
    self.b_proj = dense(d, g.n_v_heads, config, rngs)
    gate_channels = g.n_v_heads if g.gate == "gdn" else g.n_v_heads * g.head_k_dim
    if g.gate == "gdn":
      self.a_proj = dense(d, g.n_v_heads, config, rngs)
      self.f_a = self.f_b = None
    else:
      self.a_proj = None
      self.f_a = dense(d, g.head_k_dim, config, rngs)
      self.f_b = dense(g.head_k_dim, gate_channels, config, rngs)
    # Decay rates spread over [1, 16] as in Mamba2/GDN initialisation.
    self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, g.n_v_heads, dtype=jnp.float32)))
    self.dt_bias = nnx.Param(jnp.full((gate_channels,), -2.0, jnp.float32))
    if g.output_gate_rank:
      self.z_proj = None
      self.z_a = dense(d, g.output_gate_rank, config, rngs)
      self.z_b = dense(g.output_gate_rank, self.value_width, config, rngs)
    else:
      self.z_proj = dense(d, self.value_width, config, rngs)
      self.z_a = self.z_b = None
    self.o_norm = GatedRMSNorm(g.head_v_dim, config.norm_eps,
                               "silu" if g.gate == "gdn" else "sigmoid",
                               config.weight_dtype)
    self.o_proj = dense(self.value_width, d, config, rngs)

  def _gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., d] -> (log-decay g [..., hv] or [..., hv, dk], beta [..., hv]) in f32."""
    c = self.cfg
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    rate = jnp.exp(self.A_log[...])
    if c.gate == "gdn":
      a = self.a_proj(x).astype(jnp.float32)
      g = -rate * jax.nn.softplus(a + self.dt_bias[...])
    else:
      a = self.f_b(self.f_a(x)).astype(jnp.float32) + self.dt_bias[...]
      a = a.reshape(a.shape[:-1] + (c.n_v_heads, c.head_k_dim))
      g = -rate[:, None] * jax.nn.softplus(a)
    return g, beta

  def _split_heads(self, qkv: jax.Array):
    """Activated conv output [..., C] -> q, k [..., hv, dk] and v [..., hv, dv]."""
    c = self.cfg
    q = qkv[..., :self.key_width]
    k = qkv[..., self.key_width:2 * self.key_width]
    v = qkv[..., 2 * self.key_width:]
    lead = qkv.shape[:-1]
    q = _l2_normalize(q.reshape(lead + (c.n_k_heads, c.head_k_dim)))
    k = _l2_normalize(k.reshape(lead + (c.n_k_heads, c.head_k_dim)))
    groups = c.n_v_heads // c.n_k_heads
    if groups > 1:
      q = jnp.repeat(q, groups, axis=-2)
      k = jnp.repeat(k, groups, axis=-2)
    return q, k, v.reshape(lead + (c.n_v_heads, c.head_v_dim))

  def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
    c = self.cfg
    z = self.z_proj(x) if self.z_proj is not None else self.z_b(self.z_a(x))
    z = z.reshape(x.shape[:-1] + (c.n_v_heads, c.head_v_dim))
    y = self.o_norm(o.astype(x.dtype), z)
    return self.o_proj(y.reshape(x.shape[:-1] + (self.value_width,)))

  def prefill(self, x: jax.Array, cache: GatedDeltaCache, chunk: Chunk):
    qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
    qkv, conv_state = self.conv(qkv, cache.conv, chunk.n_valid)
    q, k, v = self._split_heads(jax.nn.silu(qkv))
    g, beta = self._gates(x)
    valid = chunk.valid.astype(jnp.float32)
    beta = beta * valid[..., None]
    g = g * (valid[..., None] if g.ndim == 3 else valid[..., None, None])
    o, state = chunk_gated_delta(q, k, v, g, beta, initial_state=cache.recurrent,
                                 chunk_size=self.cfg.chunk_size, impl=self.impl)
    return self._output(o, x), GatedDeltaCache(conv=conv_state, recurrent=state)

  def step(self, x: jax.Array, cache: GatedDeltaCache, lengths: jax.Array):
    del lengths  # the recurrence does not depend on the absolute position
    qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
    qkv, conv_state = self.conv.step(qkv, cache.conv)
    q, k, v = self._split_heads(jax.nn.silu(qkv))
    g, beta = self._gates(x)
    o, state = gated_delta_step(q, k, v, g, beta, cache.recurrent, impl=self.impl)
    return self._output(o, x), GatedDeltaCache(conv=conv_state, recurrent=state)


class Mamba2(nnx.Module):
  """Mamba2 mixer: in-projection to (z, xBC, dt), causal conv on xBC, SSD scan,
  D skip, gate-then-group-RMSNorm, out-projection.

  The time step is ``clip(softplus(dt + dt_bias), dt_min, dt_max)`` in prefill
  and decode alike.
  """

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    s = config.mamba2
    self.cfg = s
    self.impl = "auto"  # kernel implementation (pallas_kernels impl names)
    self.eps = config.norm_eps
    self.inner = s.n_heads * s.head_dim
    self.bc_width = s.n_groups * s.d_state
    self.in_proj = dense(config.d_model, 2 * self.inner + 2 * self.bc_width + s.n_heads,
                         config, rngs, use_bias=s.proj_bias)
    self.conv = CausalConv1d(self.inner + 2 * self.bc_width, s.conv_kernel, config, rngs,
                             use_bias=s.conv_bias)
    self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, s.n_heads, dtype=jnp.float32)))
    self.dt_bias = nnx.Param(jnp.full((s.n_heads,), -2.0, jnp.float32))
    self.D = nnx.Param(jnp.ones((s.n_heads,), jnp.float32))
    self.norm_scale = nnx.Param(jnp.ones((self.inner,), config.weight_dtype))
    self.out_proj = dense(self.inner, config.d_model, config, rngs, use_bias=s.proj_bias)

  def _split(self, x: jax.Array):
    zxbcdt = self.in_proj(x)
    z = zxbcdt[..., :self.inner]
    xbc = zxbcdt[..., self.inner:2 * self.inner + 2 * self.bc_width]
    dt = zxbcdt[..., 2 * self.inner + 2 * self.bc_width:]
    return z, xbc, dt

  def _ssm_inputs(self, xbc: jax.Array, dt: jax.Array):
    s = self.cfg
    lead = xbc.shape[:-1]
    xs = xbc[..., :self.inner].reshape(lead + (s.n_heads, s.head_dim))
    B = xbc[..., self.inner:self.inner + self.bc_width].reshape(lead + (s.n_groups, s.d_state))
    C = xbc[..., self.inner + self.bc_width:].reshape(lead + (s.n_groups, s.d_state))
    dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...])
    if s.dt_min > 0.0 or s.dt_max is not None:
      dt = jnp.clip(dt, s.dt_min, s.dt_max)
    return xs, B, C, dt

  def _output(self, y: jax.Array, xs: jax.Array, z: jax.Array) -> jax.Array:
    s = self.cfg
    y = y.astype(jnp.float32) + self.D[...][:, None] * xs.astype(jnp.float32)
    y = y.reshape(y.shape[:-2] + (self.inner,)) * jax.nn.silu(z.astype(jnp.float32))
    # Normalise within each group, as Mamba2's grouped gated RMSNorm does.
    grouped = y.reshape(y.shape[:-1] + (s.n_groups, self.inner // s.n_groups))
    y = rms_normalize(grouped, self.eps).reshape(y.shape).astype(z.dtype)
    return self.out_proj(y * self.norm_scale[...].astype(z.dtype))

  def prefill(self, x: jax.Array, cache: Mamba2Cache, chunk: Chunk):
    z, xbc, dt = self._split(x)
    xbc, conv_state = self.conv(xbc, cache.conv, chunk.n_valid)
    xs, B, C, dt = self._ssm_inputs(jax.nn.silu(xbc), dt)
    dt = dt * chunk.valid.astype(jnp.float32)[..., None]
    A = -jnp.exp(self.A_log[...])
    y, state = ssd(xs, dt, A, B, C, initial_state=cache.ssm, chunk_size=self.cfg.chunk_size,
                   impl=self.impl)
    return self._output(y, xs, z), Mamba2Cache(conv=conv_state, ssm=state)

  def step(self, x: jax.Array, cache: Mamba2Cache, lengths: jax.Array):
    del lengths
    z, xbc, dt = self._split(x)
    xbc, conv_state = self.conv.step(xbc, cache.conv)
    xs, B, C, dt = self._ssm_inputs(jax.nn.silu(xbc), dt)
    y, state = ssd_step(xs, dt, -jnp.exp(self.A_log[...]), B, C, cache.ssm, impl=self.impl)
    return self._output(y, xs, z), Mamba2Cache(conv=conv_state, ssm=state)
