"""Inference API: ``prefill``, ``decode_step``, sampling and ``generate``.

Everything is a pure function of an explicit ``Model`` (config + NNX graph
definition + parameter pytree) and an explicit ``DecodeState``. The jitted
cores are compiled once per (shape, graph) and reused.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paas_jax.models.attention import Chunk
from paas_jax.models.config import ModelConfig
from paas_jax.models.hybrid import HybridLM
from paas_jax.models.layers import MoE
from paas_jax.models.moe_dispatch import DISPATCH_MODES
# The sampler lives in sampler.py; api.sample_tokens & co. stay its public names.
from paas_jax.models.sampler import (sample_tokens, sample_tokens_sorted, sampling_key,
                                     sampling_keys)
from paas_jax.models.sampling_params import SamplingParams
from paas_jax.state import (DecodeState, HybridPrefixCache, LayerCache, init_state,
                            round_up)


@dataclasses.dataclass(frozen=True)
class Model:
  """A model as explicit pytrees: ``params`` is the NNX parameter state.

  ``blocks`` holds each block's own (graphdef, params) view of the same
  arrays, for layer-by-layer prefill.
  """

  config: ModelConfig
  graphdef: nnx.GraphDef
  params: nnx.State
  blocks: tuple[tuple[nnx.GraphDef, nnx.State], ...]

  @classmethod
  def from_module(cls, module: HybridLM) -> "Model":
    graphdef, params = nnx.split(module)
    blocks = tuple(nnx.split(block) for block in module.blocks)
    return cls(config=module.config, graphdef=graphdef, params=params, blocks=blocks)

  @classmethod
  def create(cls, config: ModelConfig, seed: int = 0) -> "Model":
    """A randomly initialised model (deterministic for ``seed``).

    Initialisation runs as one compiled program: eager init would compile a
    small program per parameter shape, which dominates start-up of small models.
    """
    init = nnx.jit(lambda: HybridLM(config, rngs=nnx.Rngs(params=seed)))
    return cls.from_module(init())

  def module(self) -> HybridLM:
    return nnx.merge(self.graphdef, self.params)

  def with_moe_dispatch(self, dispatch: str, impl: str | None = None) -> "Model":
    """The same parameters with every MoE layer evaluated ``dispatch``-wise
    ("sparse" or "dense", see ``layers.MoE``) and, if given, its grouped
    matmul on ``impl``. Arrays are shared, not copied."""
    if dispatch not in DISPATCH_MODES:
      raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
    module = self.module()
    for block in module.blocks:
      if isinstance(block.ffn, MoE):
        block.ffn.dispatch = dispatch
        if impl is not None:
          block.ffn.impl = impl
    return Model.from_module(module)

  def with_kernel_impl(self, impl: str) -> "Model":
    """The same parameters with every kernel op (attention, gated delta, SSD, paged
    decode, grouped matmul) on ``impl`` ("xla", "pallas_interpret", ...; see
    ``pallas_kernels``) instead of "auto". Arrays are shared, not copied."""
    module = self.module()
    for block in module.blocks:
      block.mixer.impl = impl
      if isinstance(block.ffn, MoE):
        block.ffn.impl = impl
    return Model.from_module(module)

  @property
  def n_params(self) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(self.params)))

  @functools.cached_property
  def static_graph(self) -> "HashedGraphDef":
    """The graph definition as a cheap static jit argument (see ``HashedGraphDef``)."""
    return HashedGraphDef(self.graphdef)


class HashedGraphDef:
  """A ``GraphDef`` whose hash is computed once.

  ``jax.jit`` hashes its static arguments on every call; hashing a whole
  model's ``GraphDef`` took ~5 ms per call on these cores, more than a tiny
  model's decode step. Equal graph definitions still compare equal, so
  models with the same structure share compiled programs.
  """

  __slots__ = ("graphdef", "_hash")

  def __init__(self, graphdef: nnx.GraphDef):
    self.graphdef = graphdef
    self._hash = hash(graphdef)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, HashedGraphDef) and self._hash == other._hash
                             and self.graphdef == other.graphdef)


def graphdef_of(graph: "HashedGraphDef | nnx.GraphDef") -> nnx.GraphDef:
  """The ``GraphDef`` of a jit static graph argument (hashed or plain)."""
  return graph.graphdef if isinstance(graph, HashedGraphDef) else graph


# -- jitted cores ---------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=0)
def _prefill_core(graphdef, params, tokens, state, n_valid):
  return nnx.merge(graphdef_of(graphdef), params).prefill(tokens, state, n_valid)


def _step(graphdef, params, tokens, state):
  return nnx.merge(graphdef_of(graphdef), params).step(tokens, state)


_step_core = jax.jit(_step, static_argnums=0)
# The hot-loop form: the state's buffers are donated to the new state.
_step_core_donating = jax.jit(_step, static_argnums=0, donate_argnums=3)

# Host-side upper bound of max(state.lengths) per lengths array (by id; the
# entry dies with the array), so that decode steps need not read the lengths
# back from the device to check the cache capacity.
_MAX_LENGTH_HINTS: dict[int, int] = {}


def _remember_max_length(lengths: jax.Array, value: int) -> None:
  key = id(lengths)
  if key not in _MAX_LENGTH_HINTS:
    weakref.finalize(lengths, _MAX_LENGTH_HINTS.pop, key, None)
  _MAX_LENGTH_HINTS[key] = value


def _max_length(state: DecodeState) -> int:
  """max(state.lengths), from the hint when there is one (no device sync)."""
  hint = _MAX_LENGTH_HINTS.get(id(state.lengths))
  if hint is None:
    hint = int(jnp.max(state.lengths))
    _remember_max_length(state.lengths, hint)
  return hint


@functools.partial(jax.jit, static_argnums=0)
def _embed_core(graphdef, params, tokens):
  return nnx.merge(graphdef, params).embed(tokens)


@functools.partial(jax.jit, static_argnums=0)
def _block_prefill_core(block_graphdef, block_params, x, cache, chunk):
  return nnx.merge(block_graphdef, block_params).prefill(x, cache, chunk)


@functools.partial(jax.jit, static_argnums=0)
def _head_core(graphdef, params, x):
  return nnx.merge(graphdef, params).logits(x)


# -- input checks -----------------------------------------------------------------

def _as_token_batch(tokens, config: ModelConfig) -> jax.Array:
  """Validates tokens and returns int32 [batch, seq] (1-D input becomes batch 1)."""
  if isinstance(tokens, jax.Array):
    arr = tokens
  else:
    arr = np.asarray(tokens)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= config.vocab_size):
      raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got range "
                       f"[{arr.min()}, {arr.max()}]")
  if arr.ndim == 1:
    arr = arr[None, :]
  if arr.ndim != 2:
    raise ValueError(f"tokens must be [seq] or [batch, seq], got shape {arr.shape}")
  if arr.shape[1] == 0:
    raise ValueError("tokens must not be empty")
  return jnp.asarray(arr, jnp.int32)


def _ensure_capacity(state: DecodeState, needed: int, config: ModelConfig) -> DecodeState:
  if needed > config.max_seq_len:
    raise ValueError(f"context of {needed} tokens exceeds max_seq_len="
                     f"{config.max_seq_len} of model {config.name!r}")
  capacity = state.capacity
  if capacity is not None and capacity < needed:
    state = state.grow(min(round_up(needed), max(config.max_seq_len, needed)))
  return state


def prefill_bucket(seq: int) -> int:
  """Padded chunk length for ``seq`` tokens: powers of two up to 512, then
  multiples of 512, so a server compiles a handful of prefill shapes."""
  if seq <= 512:
    return max(8, 1 << (seq - 1).bit_length())
  return -(-seq // 512) * 512


def _prepare_prefill(model: Model, tokens, state: DecodeState | None, lengths):
  """Validates, pads the chunk to its bucket and makes room in the state.

  Returns (tokens [batch, bucket], state, n_valid [batch], seq); padding is
  masked by ``n_valid`` exactly like right padding of ragged rows.
  """
  tokens = _as_token_batch(tokens, model.config)
  batch, seq = tokens.shape
  if state is None:
    state = init_state(model.config, batch, round_up(seq))
    start = 0
  else:
    if state.batch_size != batch:
      raise ValueError(f"state has batch {state.batch_size}, tokens have batch {batch}")
    start = _max_length(state)
  n_valid = (jnp.full((batch,), seq, jnp.int32) if lengths is None
             else jnp.asarray(lengths, jnp.int32))
  if n_valid.shape != (batch,):
    raise ValueError(f"lengths must have shape [{batch}], got {n_valid.shape}")
  state = _ensure_capacity(state, start + seq, model.config)
  bucket = prefill_bucket(seq)
  if bucket > seq:
    tokens = jnp.pad(tokens, ((0, 0), (0, bucket - seq)))
  return tokens, state, n_valid, seq


# -- public API -------------------------------------------------------------------

def prefill(model: Model, tokens, state: DecodeState | None = None, *,
            lengths: Sequence[int] | jax.Array | None = None
            ) -> tuple[jax.Array, DecodeState]:
  """Runs the prompt (or the next chunk of it) through the model.

  Args:
    model: the model.
    tokens: int [seq] or [batch, seq]; rows may be right-padded, see ``lengths``.
    state: state to continue from (chunked prefill); ``None`` starts fresh.
    lengths: int [batch], real tokens per row (default: all of them).

  Returns:
    (logits f32 [batch, seq, vocab], the advanced state).
  """
  fresh = state is None
  start = 0 if fresh else _max_length(state)
  tokens, state, n_valid, seq = _prepare_prefill(model, tokens, state, lengths)
  logits, state = _prefill_core(model.static_graph, model.params, tokens, state, n_valid)
  if lengths is None:  # every row advanced by seq
    _remember_max_length(state.lengths, start + seq)
  elif fresh:
    _remember_max_length(state.lengths, int(np.max(np.asarray(lengths))))
  return logits[:, :seq], state


def decode_step(model: Model, state: DecodeState, tokens, *, donate: bool = False
                ) -> tuple[jax.Array, DecodeState]:
  """One decode step for a batch of requests of possibly different lengths.

  No host sync: the capacity check uses a host-side bound of the lengths
  that ``prefill`` and ``decode_step`` keep for the states they return (a
  state from elsewhere costs one read-back on its first step).

  Args:
    state: the requests' state (``lengths`` may differ per row).
    tokens: int [batch], the last sampled token of each request.
    donate: hand the state's buffers to the new state (no copy of the
      caches); ``state`` must not be used afterwards. Off by default because
      callers keep states (prefix caches, retries); hot loops that own their
      state (``generate``, benchmarks) turn it on.

  Returns:
    (logits f32 [batch, vocab], state advanced by one token per request).
  """
  tokens = _as_token_batch(tokens, model.config)[0] if not isinstance(
      tokens, jax.Array) else tokens.astype(jnp.int32)
  if tokens.shape != (state.batch_size,):
    raise ValueError(f"decode_step takes one token per request: expected shape "
                     f"[{state.batch_size}], got {tokens.shape}")
  start = _max_length(state)
  state = _ensure_capacity(state, start + 1, model.config)
  step = _step_core_donating if donate else _step_core
  logits, state = step(model.static_graph, model.params, tokens, state)
  _remember_max_length(state.lengths, start + 1)
  return logits, state


def decode_step_host_synced(model: Model, state: DecodeState, tokens
                            ) -> tuple[jax.Array, DecodeState]:
  """``decode_step`` as it was before issue #17, kept as the benchmark baseline:
  reads ``max(lengths)`` back from the device every step, hashes the whole
  graph definition as a jit static argument and copies the state."""
  tokens = _as_token_batch(tokens, model.config)[0] if not isinstance(
      tokens, jax.Array) else tokens.astype(jnp.int32)
  state = _ensure_capacity(state, int(jnp.max(state.lengths)) + 1, model.config)
  return _step_core(model.graphdef, model.params, tokens, state)


def cached_prefill(model: Model, tokens: Sequence[int], prefix_cache: HybridPrefixCache, *,
                   owner: str | None = None, capacity: int | None = None
                   ) -> tuple[jax.Array, DecodeState, int]:
  """Prefill of one prompt that reuses and extends a ``HybridPrefixCache``.

  The longest cached prefix is restored; the rest is prefilled in chunks that
  end on block boundaries, so the recurrent layers' state is checkpointed every
  ``block_size`` tokens (chunked prefill is exact, see the model tests).

  ``capacity`` (optional, >= len(tokens)) allocates the state once at that
  size, so a server compiles one prefill shape per chunk bucket instead of one
  per capacity the prompt grows through.

  Returns:
    (logits f32 [1, vocab] of the last prompt token, state, reused tokens).
  """
  tokens = [int(t) for t in tokens]
  _as_token_batch(tokens, model.config)  # validates ids and emptiness
  reused, state = prefix_cache.lookup(tokens, capacity=capacity)
  if state is None and capacity is not None:
    state = init_state(model.config, 1, max(round_up(capacity), round_up(len(tokens))))
  block = prefix_cache.block_size
  pos, logits = reused, None
  while pos < len(tokens):
    end = min(len(tokens), (pos // block + 1) * block)
    logits, state = prefill(model, np.asarray(tokens[pos:end], np.int32), state)
    prefix_cache.insert(tokens[:end], state, owner=owner)
    pos = end
  return logits[:, -1], state, reused


class LayerwisePrefill:
  """Prefill that hands out each layer's cache as soon as it is computed.

  Iterating yields ``(layer_index, layer_cache)`` in layer order; each layer is
  a separate dispatch, so a consumer that serialises or sends layer ``i``
  overlaps with the computation of layer ``i + 1``. After iteration,
  ``logits`` and ``state`` equal what ``prefill`` returns.
  """

  def __init__(self, model: Model, tokens, state: DecodeState | None = None, *,
               lengths=None):
    self.model = model
    self.tokens, self.initial_state, self.n_valid, self.seq = _prepare_prefill(
        model, tokens, state, lengths)
    self.logits: jax.Array | None = None
    self.state: DecodeState | None = None

  def __iter__(self) -> Iterator[tuple[int, LayerCache]]:
    model, state = self.model, self.initial_state
    chunk = Chunk.make(state.lengths, self.n_valid, self.tokens.shape[1])
    x = _embed_core(model.graphdef, model.params, self.tokens)
    caches = []
    for i, ((block_def, block_params), cache) in enumerate(zip(model.blocks, state.layers)):
      x, cache = _block_prefill_core(block_def, block_params, x, cache, chunk)
      caches.append(cache)
      yield i, cache
    self.logits = _head_core(model.graphdef, model.params, x)[:, :self.seq]
    self.state = DecodeState(layers=tuple(caches), lengths=state.lengths + self.n_valid)


# -- sampling ---------------------------------------------------------------------

def sample(logits: jax.Array, params: SamplingParams, seed: int, positions) -> jax.Array:
  """Samples [batch] tokens with one ``SamplingParams`` for the batch.

  ``positions`` int [batch]: the absolute position each sampled token will take.
  """
  keys = sampling_keys(seed, jnp.asarray(positions, jnp.int32).reshape(-1))
  batch = logits.shape[0]
  return sample_tokens(logits, keys, jnp.full((batch,), params.temperature, jnp.float32),
                       jnp.full((batch,), params.top_k, jnp.int32),
                       jnp.full((batch,), params.top_p, jnp.float32))


# -- generation -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GenerationResult:
  tokens: list[int]
  prefill_s: float
  decode_s: float
  stop_reason: str

  @property
  def decode_tokens_per_s(self) -> float:
    steps = max(len(self.tokens) - 1, 0)
    return steps / self.decode_s if self.decode_s > 0 else 0.0


def generate(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, *,
             sampling: SamplingParams = SamplingParams(), seed: int = 0,
             stop_tokens: Sequence[int] = ()) -> GenerationResult:
  """Single-process reference generation: prefill the prompt, then decode.

  The first new token comes from the prefill logits; each further token costs
  one ``decode_step``. This is the ground truth the two-region deployment is
  checked against, token for token.
  """
  if max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
  prompt = list(prompt_ids)
  if len(prompt) + max_new_tokens > model.config.max_seq_len:
    raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                     f"max_seq_len={model.config.max_seq_len}")
  stops = set(stop_tokens)
  t0 = time.perf_counter()
  logits, state = prefill(model, np.asarray(prompt, np.int32))
  token = sample(logits[:, -1], sampling, seed, [len(prompt)])
  out = [int(token[0])]
  prefill_s = time.perf_counter() - t0
  t1 = time.perf_counter()
  reason = "stop_token" if out[0] in stops else "max_tokens"
  while reason == "max_tokens" and len(out) < max_new_tokens:
    logits, state = decode_step(model, state, token, donate=True)
    token = sample(logits, sampling, seed, [len(prompt) + len(out)])
    out.append(int(token[0]))
    if out[-1] in stops:
      reason = "stop_token"
  return GenerationResult(tokens=out, prefill_s=prefill_s,
                          decode_s=time.perf_counter() - t1, stop_reason=reason)
