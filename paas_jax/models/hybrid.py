"""The hybrid decoder-only language model (Flax NNX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paas_jax.models.attention import Chunk
from paas_jax.models.config import ModelConfig
from paas_jax.models.kinds import kind_spec
from paas_jax.models.layers import MLP, MoE, make_norm
from paas_jax.state import DecodeState


def make_mixer(kind: str, config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The mixer of a ``layer_pattern`` letter (its kind's module builds it)."""
  return kind_spec(kind).make_mixer(config, rngs)


def make_ffn(ffn_kind: str, config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module | None:
  if ffn_kind == "e":
    return MoE(config, rngs)
  if ffn_kind == "d":
    return MLP(config.d_model, config.d_ff, config, rngs)
  if ffn_kind == "-":
    return None
  raise ValueError(f"ModelConfig.ffn_pattern: unknown feed-forward kind {ffn_kind!r}")


class Block(nnx.Module):
  """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``.

  ``ffn_kind`` (default: the config's first layer's) picks the feed-forward
  network; ``"-"`` makes a mixer-only block.
  """

  def __init__(self, kind: str, config: ModelConfig, rngs: nnx.Rngs,
               ffn_kind: str | None = None):
    self.kind = kind
    self.mixer_norm = make_norm(config.d_model, config)
    self.mixer = make_mixer(kind, config, rngs)
    ffn_kind = ffn_kind or config.ffn_kinds[0]
    self.ffn_norm = make_norm(config.d_model, config) if ffn_kind != "-" else None
    self.ffn = make_ffn(ffn_kind, config, rngs)

  def feed_forward(self, x):
    """The block's second half, ``x + ffn(norm(x))``; ``x`` itself when mixer-only.

    Code that runs the mixer by other means (the serving engine's paged decode)
    finishes the block with this.
    """
    return x if self.ffn is None else x + self.ffn(self.ffn_norm(x))

  def prefill(self, x, cache, chunk: Chunk):
    h, cache = self.mixer.prefill(self.mixer_norm(x), cache, chunk)
    return self.feed_forward(x + h), cache

  def step(self, x, cache, lengths):
    h, cache = self.mixer.step(self.mixer_norm(x), cache, lengths)
    return self.feed_forward(x + h), cache


class HybridLM(nnx.Module):
  """A stack of ``Block``s over a token embedding, with a (tied) output head."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=config.compute_dtype,
                           param_dtype=config.weight_dtype,
                           embedding_init=nnx.initializers.normal(stddev=1.0),
                           rngs=rngs)
    self.blocks = nnx.List([Block(kind, config, rngs, ffn_kind) for kind, ffn_kind
                            in zip(config.layer_kinds, config.ffn_kinds)])
    self.final_norm = make_norm(config.d_model, config)
    if config.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                                dtype=config.compute_dtype,
                                param_dtype=config.weight_dtype,
                                kernel_init=nnx.initializers.normal(
                                    stddev=config.d_model ** -0.5), rngs=rngs)

  def logits(self, h: jax.Array) -> jax.Array:
    """Final norm and output head: h [..., d_model] -> f32 logits [..., vocab]."""
    h = self.final_norm(h)
    if self.lm_head is None:
      # Scaled so that a tied head starts with unit-scale logits.
      out = self.embed.attend(h) * (self.config.d_model ** -0.5)
    else:
      out = self.lm_head(h)
    return out.astype(jnp.float32)

  def prefill(self, tokens: jax.Array, state: DecodeState, n_valid: jax.Array
              ) -> tuple[jax.Array, DecodeState]:
    """Processes a right-padded chunk that continues each request's state.

    Args:
      tokens: int32 [batch, seq].
      state: the requests' state; attention caches must hold
        ``lengths + seq`` positions.
      n_valid: int32 [batch], real tokens in each row.

    Returns:
      (logits f32 [batch, seq, vocab], state advanced by ``n_valid`` tokens).
    """
    x, state = self._prefill_hidden(tokens, state, n_valid)
    return self.logits(x), state

  def prefill_last(self, tokens: jax.Array, state: DecodeState, n_valid: jax.Array
                   ) -> tuple[jax.Array, DecodeState]:
    """``prefill`` with the output head applied only at each row's last valid token,
    so no [batch, seq, vocab] logits exist (chunked prefill of long prompts).

    Returns:
      (logits f32 [batch, vocab] at position ``n_valid - 1`` of each row, undefined
      for rows with ``n_valid == 0``; the advanced state).
    """
    x, state = self._prefill_hidden(tokens, state, n_valid)
    last = x[jnp.arange(x.shape[0]), jnp.maximum(n_valid - 1, 0)]
    return self.logits(last), state

  def _prefill_hidden(self, tokens, state, n_valid):
    """The blocks of ``prefill``: (hidden [batch, seq, d_model], advanced state)."""
    chunk = Chunk.make(state.lengths, n_valid, tokens.shape[1])
    x = self.embed(tokens)
    caches = []
    for block, cache in zip(self.blocks, state.layers):
      x, cache = block.prefill(x, cache, chunk)
      caches.append(cache)
    return x, DecodeState(layers=tuple(caches), lengths=state.lengths + n_valid)

  def step(self, tokens: jax.Array, state: DecodeState) -> tuple[jax.Array, DecodeState]:
    """One decode step: tokens int32 [batch] -> (logits f32 [batch, vocab], state)."""
    x = self.embed(tokens)
    caches = []
    for block, cache in zip(self.blocks, state.layers):
      x, cache = block.step(x, cache, state.lengths)
      caches.append(cache)
    return self.logits(x), DecodeState(layers=tuple(caches), lengths=state.lengths + 1)
