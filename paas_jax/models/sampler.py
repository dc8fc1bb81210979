"""Token sampling with per-row settings, without sorting the vocabulary.

Which tokens a row may draw (its *kept set*) follows the usual rules: the
``top_k`` highest scaled logits (0: no limit), then, among those, the smallest
set of most probable tokens whose probability mass reaches ``top_p`` (the most
probable token always). Tokens tied at a boundary are all kept. The draw is the
Gumbel-max trick over the kept set (what ``jax.random.categorical`` does).

Finding the kept set does not sort: each boundary is a threshold on the logits,
found by bisection over the float32 bit patterns (32 rounds of one masked count
or sum over the vocabulary), so its cost is ~2 x 32 passes over ``[batch,
vocab]`` instead of a sort of every row (tens of ms on CPU at 32K ids; the
sampler was half of a ``hybrid_100m`` batch-8 decode step). ``sample_tokens_sorted``
is the sorting sampler it replaced, kept as the baseline of the decode
benchmarks and as the reference of its kept set in the tests.

Keys are per (seed, absolute position), so a request draws the same tokens
whether it was prefilled locally or remotely and whatever batch it decodes in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A numpy scalar, not a jnp array: importing the models must not start a JAX
# backend (pod processes call jax.distributed.initialize after their imports).
_SIGN = np.uint32(0x80000000)
_BISECT_ROUNDS = 32  # one per bit of a float32


def sampling_key(seed: int, position: int) -> jax.Array:
  """The PRNG key for the token at ``position`` of a request seeded with ``seed``."""
  return jax.random.fold_in(jax.random.key(seed), position)


@jax.jit
def sampling_keys(seeds, positions: jax.Array) -> jax.Array:
  """Vectorised ``sampling_key``: seeds int [batch] (or a scalar), positions int [batch]."""
  seeds = jnp.broadcast_to(jnp.asarray(seeds, jnp.uint32), positions.shape)
  return jax.vmap(sampling_key)(seeds, positions)


def _ordered_bits(x: jax.Array) -> jax.Array:
  """uint32 keys with the order of the float32 values ``x`` (no NaNs)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits & _SIGN, ~bits, bits | _SIGN)


def _top_k_bound(keys: jax.Array, top_k: jax.Array) -> jax.Array:
  """Per row, the largest key t with at least ``top_k`` keys >= t (the k-th
  largest key); rows with ``top_k <= 0`` get the smallest key (keep all).

  keys: uint32 [batch, vocab]; top_k: int32 [batch]. Returns uint32 [batch].
  """
  lo, hi = keys.min(axis=-1), keys.max(axis=-1)
  k = jnp.maximum(top_k, 1)

  def step(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2 + (lo < hi)  # in (lo, hi] while lo < hi: no overflow
    enough = jnp.sum(keys >= mid[:, None], axis=-1) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - (lo < hi))

  lo, _ = jax.lax.fori_loop(0, _BISECT_ROUNDS, step, (lo, hi))
  return jnp.where(top_k > 0, lo, keys.min(axis=-1))


def _top_p_bound(keys: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """Per row, the smallest key t whose strictly-higher keys hold less than
  ``top_p`` of the mass: token i is kept iff ``keys[i] >= t``, i.e. iff the
  tokens more probable than it hold less than ``top_p``.

  keys: uint32 [batch, vocab]; probs: f32 [batch, vocab] (0 outside the top-k
  set); top_p: f32 [batch]. Returns uint32 [batch].
  """
  lo, hi = keys.min(axis=-1), keys.max(axis=-1)  # mass above the max key: 0 < top_p

  def step(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    above = jnp.sum(jnp.where(keys > mid[:, None], probs, 0.0), axis=-1)
    small = above < top_p
    return jnp.where(small, lo, mid + (lo < hi)), jnp.where(small, mid, hi)

  _, hi = jax.lax.fori_loop(0, _BISECT_ROUNDS, step, (lo, hi))
  return hi


@jax.jit
def kept_mask(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
              top_p: jax.Array) -> jax.Array:
  """bool [batch, vocab]: the tokens each row may draw (module docstring);
  ``top_p >= 1`` keeps the whole top-k set (no float rounding of the mass).

  Args:
    logits: f32 [batch, vocab]; temperature, top_p: f32 [batch]; top_k: int32
      [batch] (0 = no limit).
  """
  return _kept_of_scaled(_scaled(logits, temperature), top_k, top_p)


def _scaled(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """f32 [batch, vocab]: logits over each row's temperature (greedy rows: huge)."""
  return logits / jnp.maximum(temperature, 1e-6)[:, None]


def _kept_of_scaled(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """``kept_mask`` of logits already scaled by their temperature."""
  keys = _ordered_bits(scaled)
  in_top_k = jax.lax.cond(jnp.all(top_k <= 0), lambda: jnp.ones(keys.shape, bool),
                          lambda: keys >= _top_k_bound(keys, top_k)[:, None])
  probs = jax.nn.softmax(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1)
  in_top_p = jax.lax.cond(jnp.all(top_p >= 1.0), lambda: in_top_k,
                          lambda: (keys >= _top_p_bound(keys, probs, top_p)[:, None])
                          | (top_p >= 1.0)[:, None])
  return in_top_k & in_top_p


@jax.jit
def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Samples one token per row with per-row settings.

  Args:
    logits: f32 [batch, vocab].
    keys: PRNG keys [batch].
    temperature, top_p: f32 [batch]; top_k: int32 [batch] (0 = no limit).

  Returns:
    int32 [batch]; rows with ``temperature <= 0`` take the argmax. A batch whose
    rows are all greedy computes only the argmax.
  """
  greedy = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sampled():
    scaled = _scaled(logits, temperature)
    keep = _kept_of_scaled(scaled, top_k, top_p)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:], jnp.float32))(keys)
    drawn = jnp.argmax(jnp.where(keep, scaled + gumbel, -jnp.inf), axis=-1).astype(jnp.int32)
    return jnp.where(temperature <= 0, greedy(), drawn)

  return jax.lax.cond(jnp.all(temperature <= 0), greedy, sampled)


def sorted_kept_mask(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The sorting sampler's kept set: (scaled logits sorted per row, their token
  ids, bool keep) all [batch, vocab]; the rank order breaks ties by id."""
  vocab = logits.shape[-1]
  scaled = _scaled(logits, temperature)
  sorted_logits, sorted_idx = jax.lax.top_k(scaled, vocab)
  ranks = jnp.arange(vocab)[None, :]
  keep = (top_k[:, None] <= 0) | (ranks < top_k[:, None])
  probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
  # Keep the smallest prefix whose mass reaches top_p (the first token always).
  keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
  return sorted_logits, sorted_idx, keep


@jax.jit
def sample_tokens_sorted(logits: jax.Array, keys: jax.Array, temperature: jax.Array,
                         top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """The sampler before this module: every row's vocabulary sorted, greedy rows
  too (same arguments and kept sets as ``sample_tokens``; it draws other tokens
  for the same keys, since it draws over the sorted order)."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  sorted_logits, sorted_idx, keep = sorted_kept_mask(logits, temperature, top_k, top_p)
  choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
  sampled = jnp.take_along_axis(sorted_idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(temperature <= 0, greedy, sampled)
