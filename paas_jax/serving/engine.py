"""The serving engines: batched chunked prefill and a continuous-batching decode pool.

The boundary follows JetStream:

* ``PrefillEngine.prefill(requests)`` turns prompts into per-request
  ``DecodeState``s (batch 1) plus the first sampled token;
* ``DecodeEngine.insert(prefix, slot)`` places one such state into a slot of
  the decode pool;
* ``DecodeEngine.generate()`` runs one decode step for every slot and returns
  one sampled token per slot;
* ``DecodeEngine.free(slot)`` releases the slot and its pages.

The decode pool (``SlotPool``) keeps full-attention KV (``A``) and MLA latents
(``M``) in a shared **page pool** addressed through per-slot page tables (read
by ``pallas_kernels.paged_attention``), and keeps fixed-size state (sliding
window ring buffers ``S``, recurrent states ``G``/``m``) in **slot-indexed**
arrays. Everything is a pytree of fixed shape, so the decode step compiles
once for the pool size.

Token exactness: sampling is keyed by ``(seed, absolute position)`` with the
same ``sample_tokens`` as ``api.generate``, so a request produces the tokens of
single-process generation whatever batch it runs in.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from paas_jax.models import api
from paas_jax.models.config import ModelConfig
from paas_jax.models.kinds import PagedKV, PagedLatent, kind_spec
# Request validation lives in the JAX-free ``validation`` module (the broker uses it);
# re-exported here because the engine raises these errors and takes these params.
from paas_jax.serving.validation import (MAX_REQUEST_ID_CHARS, MAX_SEED, EngineError,  # noqa: F401
                                         InvalidRequestError, RequestParams,
                                         check_request_identity, make_sampling,
                                         validate_request)
from paas_jax.state import (CAPACITY_ALIGN, AttentionCache, DecodeState, MLACache, init_state,
                            round_up)


class PoolExhaustedError(EngineError):
  """No slot or not enough pages right now (retry later or queue)."""


# -- configuration ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes of the prefill and decode engines.

  Attributes:
    n_slots: decode slots (requests decoded together in one step).
    max_ctx: longest context (prompt + generated) a slot holds; 0 means the
      model's ``max_seq_len``. Rounded up to a whole number of pages.
    page_size: positions per KV page.
    num_pages: pages in the shared pool; 0 means enough for every slot to hold
      ``max_ctx`` (no oversubscription). Smaller pools admit fewer long requests.
    prefill_buckets: padded chunk lengths prefill compiles for (increasing
      multiples of 64); the largest is the chunk length: longer prompts are
      prefilled in several chunks.
    prefill_max_batch: prompts prefilled together; batches are padded to this
      many rows so that one compilation per bucket serves every batch.
  """

  n_slots: int = 8
  max_ctx: int = 0
  page_size: int = 16
  num_pages: int = 0
  prefill_buckets: tuple[int, ...] = (64, 256)
  prefill_max_batch: int = 4
  # Hybrid prefix cache (``HybridPrefixCache``): block size in tokens, 0 = off.
  # With it on, prompts are prefilled one at a time by ``api.cached_prefill``.
  prefix_block: int = 0
  prefix_cache_bytes: int = 256 << 20

  def __post_init__(self):
    if self.n_slots < 1:
      raise ValueError(f"EngineConfig.n_slots must be >= 1, got {self.n_slots}")
    if self.page_size < 1:
      raise ValueError(f"EngineConfig.page_size must be >= 1, got {self.page_size}")
    b = tuple(self.prefill_buckets)
    if not b or any(x < CAPACITY_ALIGN or x % CAPACITY_ALIGN for x in b) or list(b) != sorted(
        set(b)):
      raise ValueError(f"EngineConfig.prefill_buckets must be increasing multiples of "
                       f"{CAPACITY_ALIGN}, got {b}")
    if self.prefill_max_batch < 1:
      raise ValueError("EngineConfig.prefill_max_batch must be >= 1")
    if self.max_ctx < 0 or self.num_pages < 0:
      raise ValueError("EngineConfig.max_ctx and num_pages must be >= 0")
    if self.prefix_block < 0 or self.prefix_cache_bytes <= 0:
      raise ValueError("EngineConfig.prefix_block must be >= 0 and prefix_cache_bytes > 0")

  @property
  def prefill_chunk(self) -> int:
    return self.prefill_buckets[-1]


# -- prefill engine ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PrefillInput:
  request_id: str
  prompt: tuple[int, ...]
  params: RequestParams
  # Prefix cache: entries made only for this request's outgoing transfer (the
  # prompt's last block and its checkpoint) are tagged with this owner, to be
  # released after the transfer; None keeps every entry (shared, LRU).
  cache_owner: str | None = None


@dataclasses.dataclass
class PrefillOutput:
  """One request's prefill result.

  Attributes:
    state: batch-1 state holding the whole prompt (capacity rounded up).
    first_token: the token sampled from the last prompt position.
    prefill_s: wall time of the batch that computed it.
  """

  request_id: str
  state: DecodeState
  first_token: int
  prompt_len: int
  prefill_s: float
  batch_size: int
  cached_tokens: int = 0  # prompt tokens reused from the prefix cache


@jax.jit
def _sample_rows(logits, seeds, positions, temperature, top_k, top_p):
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
  return api.sample_tokens(logits, keys, temperature, top_k, top_p)


def sample_rows(logits, params: Sequence[RequestParams], positions: Sequence[int]) -> np.ndarray:
  """Samples one token per row, each with its own settings (as ``api.sample``)."""
  n = logits.shape[0]
  pad = n - len(params)
  params = list(params) + [RequestParams()] * pad
  positions = list(positions) + [0] * pad
  tok = _sample_rows(
      logits, jnp.asarray([p.seed for p in params], jnp.uint32),
      jnp.asarray(positions, jnp.int32),
      jnp.asarray([p.sampling.temperature for p in params], jnp.float32),
      jnp.asarray([p.sampling.top_k for p in params], jnp.int32),
      jnp.asarray([p.sampling.top_p for p in params], jnp.float32))
  return np.asarray(tok)


class PrefillEngine:
  """Batched, chunked prefill with a small, fixed set of compiled shapes.

  A batch is padded to ``prefill_max_batch`` rows; its prompts are
  right-padded and processed in chunks of at most ``prefill_chunk`` tokens,
  each chunk padded to the smallest bucket that holds it, continuing one state
  whose capacity is the engine's whole context. So each bucket compiles once.

  ``layer_sink(layer_index, cache)`` (optional) receives each layer of the
  **last** chunk as soon as it is computed (batched, device arrays), for
  pipelining the state transfer with the computation of the next layer.
  """

  def __init__(self, model: api.Model, config: EngineConfig = EngineConfig()):
    self.model = model
    self.config = config
    self.max_ctx = min(config.max_ctx or model.config.max_seq_len, model.config.max_seq_len)
    chunk = config.prefill_chunk
    self.capacity = -(-self.max_ctx // chunk) * chunk
    self._lock = threading.Lock()
    self.prefix_cache = None
    self.prefix_released_bytes = 0
    # Per prompt, what the cache saved (the cache's own lookup counters also
    # count the second lookup of a prompt whose shared part was cached just
    # before its transfer-owned tail, so they overstate reuse).
    self.prefix_prompts = 0
    self.prefix_prompts_hit = 0
    self.prefix_reused_tokens = 0
    self._pending_release: list[str] = []
    # Prefixes received from the other region (cross-cluster prefix transfer),
    # waiting for the engine to be idle: (tokens, batch-1 state).
    self._pending_imports: list[tuple[tuple[int, ...], DecodeState]] = []
    self.prefix_imported_bytes = 0
    self._release_lock = threading.Lock()
    if config.prefix_block:
      from paas_jax.state.prefix_cache import HybridPrefixCache  # pylint: disable=g-import-not-at-top
      self.prefix_cache = HybridPrefixCache(model.config, block_size=config.prefix_block,
                                            capacity_bytes=config.prefix_cache_bytes)

  def cached_prefix_tokens(self, prompt: Sequence[int]) -> int:
    """Longest prefix of ``prompt`` the prefix cache would reuse (0 without one)."""
    if self.prefix_cache is None or not prompt:
      return 0
    # No lock: a probe must not wait for a running prefill. Membership tests on
    # the cache's dicts are atomic, so the answer is at worst slightly stale.
    try:
      return self.prefix_cache.match_length(prompt)
    except RuntimeError:  # a dict resized under us; report a miss
      return 0

  def cached_prefix_tokens_hashed(self, hashes: Sequence[bytes]) -> int:
    """``cached_prefix_tokens`` from the prompt's block hashes (a broker's
    ``prefix_probe_hashes``: blocks of prompt[:len-1]); tokens, 0 without a cache."""
    if self.prefix_cache is None or not hashes:
      return 0
    try:  # no lock, as above
      return self.prefix_cache.match_length_hashes(hashes)
    except RuntimeError:
      return 0

  def release_prefix(self, owner: str) -> int:
    """Drops the prefix-cache entries tagged with ``owner``; returns bytes freed now.

    Never waits for a running prefill (a transfer's commit must not): when the
    engine is busy the release is queued and done before the next prompt.
    """
    if self.prefix_cache is None:
      return 0
    with self._release_lock:
      self._pending_release.append(owner)
    if not self._lock.acquire(blocking=False):
      return 0
    try:
      return self._drain_releases()
    finally:
      self._lock.release()

  def _drain_releases(self) -> int:
    """Runs queued releases, then queued imports; the caller holds ``_lock``.

    Returns the bytes freed by the releases.
    """
    with self._release_lock:
      owners, self._pending_release = self._pending_release, []
      imports, self._pending_imports = self._pending_imports, []
    freed = sum(self.prefix_cache.release(o) for o in owners)
    self.prefix_released_bytes += freed
    for tokens, state in imports:
      self.prefix_imported_bytes += self.prefix_cache.insert(tokens, state)
    return freed

  def import_prefix(self, tokens: Sequence[int], state: DecodeState) -> bool:
    """Adds a prefix shipped from the other region to the prefix cache.

    Args:
      tokens: the prefix, a whole number of cache blocks.
      state: batch-1 state after exactly ``tokens`` (attention capacity >= len).

    Like ``release_prefix`` it never waits for a running prefill (it runs in a
    transfer's Commit): when the engine is busy the insert is queued and done
    when that prefill ends, and in any case before the next prompt, so every
    prompt submitted after this call sees the prefix. Returns True if it is
    already in the cache.
    """
    if self.prefix_cache is None:
      raise EngineError("this engine has no prefix cache")
    tokens = tuple(int(t) for t in tokens)
    block = self.prefix_cache.block_size
    length = int(np.asarray(state.lengths).reshape(-1)[0])
    if state.batch_size != 1 or length != len(tokens) or not tokens or len(tokens) % block:
      raise InvalidRequestError(
          f"a prefix import needs a batch-1 state of a whole number of {block}-token blocks "
          f"matching its tokens; got batch {state.batch_size}, {length} state tokens, "
          f"{len(tokens)} token ids")
    with self._release_lock:
      self._pending_imports.append((tokens, state))
    if not self._lock.acquire(blocking=False):
      return False
    try:
      self._drain_releases()
      return True
    finally:
      self._lock.release()

  def export_prefix(self, prompt: Sequence[int], max_tokens: int = 0,
                    timeout_s: float = 10.0) -> tuple[int, DecodeState | None]:
    """The longest cached prefix of ``prompt`` for the other region.

    Returns:
      (matched tokens, a batch-1 host (numpy) state holding exactly them,
      attention capacity = matched), or (0, None) when nothing is cached. At
      most ``max_tokens`` (> 0) tokens, rounded down to a block.

    Reading the cache waits for a running prefill (the cache is not safe to
    read while ``cached_prefill`` updates it), at most ``timeout_s``
    (``TimeoutError``).
    """
    if self.prefix_cache is None:
      raise EngineError("this engine has no prefix cache")
    tokens = list(prompt)
    if max_tokens > 0:
      # match_length keeps one token unmatched: cut one past the cap.
      cap = (max_tokens // self.prefix_cache.block_size) * self.prefix_cache.block_size
      tokens = tokens[:cap + 1]
    if not self._lock.acquire(timeout=max(timeout_s, 0.0)):
      raise TimeoutError(f"the prefill engine stayed busy for {timeout_s:.2f} s")
    try:
      self._drain_releases()
      matched, state = self.prefix_cache.lookup(tokens)
    finally:
      self._lock.release()
    if state is None:
      return 0, None
    return matched, jax.tree_util.tree_map(np.asarray, state)

  def prefill(self, inputs: Sequence[PrefillInput], layer_sink=None, *, chunk_sink=None,
              resume: tuple[int, DecodeState] | None = None) -> list[PrefillOutput]:
    """Prefills a batch of prompts.

    Args:
      layer_sink: ``(layer, cache)`` per layer of the last chunk (see the class).
      chunk_sink: ``(layer, cache, start, n_valid)`` per layer of **every** chunk
        as soon as it is computed: batched device cache, the chunk's first token
        ``start`` and int32 [batch] valid tokens per row (``chunk_stream``).
      resume: ``(n, state)``: continue one prompt from a committed batch-1 state
        holding its first ``n`` tokens, in chunks ``[n + k * prefill_chunk, ...)``.
        Token-exact against an uninterrupted prefill that followed the same chunk
        grid: any ``n`` that was a chunk end of it (a commit point), e.g. a
        multiple of ``prefill_chunk``, or ``reused + k * chunk`` after a prefix
        cache hit of ``reused`` tokens (``_prefill_cached_streaming``).

    With the prefix cache and ``chunk_sink`` (one prompt), the cached prefix is
    restored and streamed first (``_prefill_cached_streaming``); with ``resume``
    the prefix cache is not consulted.
    """
    if not inputs:
      return []
    if len(inputs) > self.config.prefill_max_batch:
      raise ValueError(f"at most {self.config.prefill_max_batch} prompts per prefill batch")
    for x in inputs:
      if not 0 < len(x.prompt) < self.max_ctx:
        raise InvalidRequestError(f"prompt of {len(x.prompt)} tokens; this engine prefills "
                                  f"1 to {self.max_ctx - 1}")
    if resume is not None:
      if len(inputs) != 1:
        raise ValueError("resume takes one prompt per call")
      if not 0 <= resume[0] < len(inputs[0].prompt):
        raise InvalidRequestError(f"resume point {resume[0]} is not inside the prompt of "
                                  f"{len(inputs[0].prompt)} tokens")
      with self._lock:
        return self._prefill(list(inputs), layer_sink, chunk_sink, resume)
    with self._lock:
      if self.prefix_cache is not None:
        if chunk_sink is not None:
          if len(inputs) != 1:
            raise ValueError("a chunk sink with the prefix cache takes one prompt per call")
          return [self._prefill_cached_streaming(inputs[0], layer_sink, chunk_sink)]
        return self._prefill_cached(list(inputs), layer_sink)
      return self._prefill(list(inputs), layer_sink, chunk_sink)

  def _prefill_cached_streaming(self, x: PrefillInput, layer_sink, chunk_sink) -> PrefillOutput:
    """Chunk-streamed prefill of one prompt through the prefix cache.

    The longest cached prefix ``[0, reused)`` is restored and handed to
    ``chunk_sink`` first as one chunk (cached blocks are sent like computed
    ones: the decode side needs them); the rest is prefilled in
    ``prefill_chunk`` chunks continuing from it (the grid ``reused + k *
    chunk``, so a resume from any commit point follows the same chunks).
    Chunk ends on a block boundary (all of them when the chunk is a multiple of
    the block) go into the prefix cache, shared (no owner): the next prompt
    with this prefix reuses them.
    """
    self._drain_releases()
    tokens = list(x.prompt)
    reused, cached = self.prefix_cache.lookup(tokens, capacity=self.capacity)
    self.prefix_prompts += 1
    self.prefix_prompts_hit += int(reused > 0)
    self.prefix_reused_tokens += int(reused)
    block = self.prefix_cache.block_size

    def on_chunk_state(end: int, state: DecodeState) -> None:
      if end % block == 0 and end < len(tokens):
        row = jax.tree_util.tree_map(lambda a: a[0:1], state)
        self.prefix_cache.insert(tokens[:end], row)
    out = self._prefill([x], layer_sink, chunk_sink,
                        (reused, cached) if reused else None, on_chunk_state=on_chunk_state,
                        send_resumed=True)[0]
    out.cached_tokens = int(reused)
    self._drain_releases()
    return out

  def _prefill_cached(self, inputs: list[PrefillInput], layer_sink) -> list[PrefillOutput]:
    """One prompt at a time through ``api.cached_prefill`` (exact, see the model tests).

    ``layer_sink`` gets each layer once the prompt is done, batched like the
    inputs (one row per input) only when there is a single input; the batcher
    runs cached prefills one job at a time.
    """
    if layer_sink is not None and len(inputs) != 1:
      raise ValueError("a layer sink with the prefix cache takes one prompt per call")
    t0 = time.perf_counter()
    self._drain_releases()
    block = self.prefix_cache.block_size
    outputs = []
    for x in inputs:
      tokens = list(x.prompt)
      # What was reusable when the request arrived (what it actually saved).
      reused = self.prefix_cache.match_length(tokens)
      self.prefix_prompts += 1
      self.prefix_prompts_hit += int(reused > 0)
      self.prefix_reused_tokens += int(reused)
      keep = ((len(tokens) - 1) // block) * block if x.cache_owner is not None else 0
      if keep > reused:
        # The shared part first (owner None), then the tail owned by the transfer.
        api.cached_prefill(self.model, tokens[:keep], self.prefix_cache,
                           capacity=self.capacity)
      logits, state, _ = api.cached_prefill(self.model, tokens, self.prefix_cache,
                                            owner=x.cache_owner, capacity=self.capacity)
      first = sample_rows(logits, [x.params], [len(tokens)])
      if layer_sink is not None:
        for i, cache in enumerate(state.layers):
          layer_sink(i, cache)
      host = jax.tree_util.tree_map(np.asarray, state)
      outputs.append(PrefillOutput(
          request_id=x.request_id, state=_select_row(host, 0, round_up(len(tokens))),
          first_token=int(first[0]), prompt_len=len(tokens), prefill_s=0.0,
          batch_size=len(inputs), cached_tokens=int(reused)))
    elapsed = time.perf_counter() - t0
    for o in outputs:
      o.prefill_s = elapsed
    # Releases and imports that arrived during this prefill: now, not at the
    # next prompt (the prefix probe should see an import as soon as possible).
    self._drain_releases()
    return outputs

  def _chunk_len(self, size: int) -> int:
    return next(b for b in self.config.prefill_buckets if b >= size)

  def _prefill(self, inputs: list[PrefillInput], layer_sink, chunk_sink=None,
               resume=None, *, on_chunk_state=None,
               send_resumed: bool = False) -> list[PrefillOutput]:
    """The chunked prefill (``prefill``'s arguments); ``on_chunk_state(end,
    state)`` after every chunk (batched device state, row 0 holds ``end``
    tokens); ``send_resumed``: hand the resumed prefix ``[0, n)`` to
    ``chunk_sink`` as one chunk before computing (a cache hit that must still
    travel)."""
    t0 = time.perf_counter()
    cfg, model = self.config, self.model
    n = len(inputs)
    batch = cfg.prefill_max_batch
    lens = np.zeros((batch,), np.int32)
    lens[:n] = [len(x.prompt) for x in inputs]
    longest = int(lens.max())
    tokens = np.zeros((batch, longest), np.int32)
    for i, x in enumerate(inputs):
      tokens[i, :lens[i]] = x.prompt
    state = init_state(model.config, batch, self.capacity)
    start = 0
    if resume is not None:
      start, state = resume[0], _with_row(state, resume[1], resume[0])
      if send_resumed and chunk_sink is not None and start:
        n_cached = np.zeros((batch,), np.int32)
        n_cached[0] = start
        for layer_idx, cache in enumerate(state.layers):
          chunk_sink(layer_idx, cache, 0, n_cached)
    last_rows = np.zeros((n, model.config.vocab_size), np.float32)
    while start < longest:
      size = min(cfg.prefill_chunk, longest - start)
      seq = self._chunk_len(size)
      chunk = np.zeros((batch, seq), np.int32)
      chunk[:, :size] = tokens[:, start:start + size]
      n_valid = np.clip(lens - start, 0, size).astype(np.int32)
      final = start + size >= longest
      lw = api.LayerwisePrefill(model, chunk, state, lengths=n_valid)
      for layer_idx, cache in lw:
        if final and layer_sink is not None:
          layer_sink(layer_idx, cache)
        if chunk_sink is not None:
          chunk_sink(layer_idx, cache, start, n_valid)
      state = lw.state
      if on_chunk_state is not None:
        on_chunk_state(start + size, state)
      ends = lens[:n] - 1 - start
      rows = [i for i in range(n) if 0 <= ends[i] < size]
      if rows:
        logits = np.asarray(lw.logits)
        for i in rows:
          last_rows[i] = logits[i, ends[i]]
      start += size
    first = sample_rows(jnp.asarray(_pad_rows(last_rows, batch)), [x.params for x in inputs],
                        [int(l) for l in lens[:n]])
    host = jax.tree_util.tree_map(np.asarray, state)
    elapsed = time.perf_counter() - t0
    outputs = []
    for i, x in enumerate(inputs):
      outputs.append(PrefillOutput(
          request_id=x.request_id, state=_select_row(host, i, round_up(int(lens[i]))),
          first_token=int(first[i]), prompt_len=int(lens[i]), prefill_s=elapsed,
          batch_size=n))
    return outputs

  def warmup(self) -> float:
    """Compiles every bucket (and sampling); returns seconds spent."""
    t0 = time.perf_counter()
    for b in self.config.prefill_buckets:
      size = min(b, self.max_ctx - 1)
      self.prefill([PrefillInput("warmup", (0,) * size, RequestParams())])
    if self.prefix_cache is not None:
      # Cached prefill runs chunks of up to one block: compile every chunk
      # bucket (8, 16, ... block) with and without a restored prefix, then
      # start from an empty cache.
      block = self.prefix_cache.block_size
      sizes = sorted({min(api.prefill_bucket(n), block) for n in range(1, block + 1)})
      for size in sizes:
        for prompt_len in (size, block + size):
          if prompt_len < self.max_ctx:
            self.prefill([PrefillInput("warmup", (0,) * prompt_len, RequestParams(),
                                       cache_owner="warmup")])
      from paas_jax.state.prefix_cache import HybridPrefixCache  # pylint: disable=g-import-not-at-top
      with self._lock:
        self.prefix_cache = HybridPrefixCache(self.model.config, block_size=block,
                                              capacity_bytes=self.config.prefix_cache_bytes)
    return time.perf_counter() - t0


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  if x.shape[0] >= rows:
    return x
  return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)])


def _with_row(state: DecodeState, prefix: DecodeState, length: int) -> DecodeState:
  """``state`` (batched, device) with row 0 replaced by the batch-1 ``prefix``
  holding ``length`` tokens (growing caches copied into the first positions)."""
  def put(dst, src):
    src = jnp.asarray(src)
    if dst.ndim >= 2 and src.shape[1:] != dst.shape[1:]:  # a growing cache: first positions
      src = src[:, :length]
      return dst.at[0:1, :src.shape[1]].set(src.astype(dst.dtype))
    return dst.at[0:1].set(src.astype(dst.dtype))
  layers = tuple(jax.tree_util.tree_map(put, d, p) for d, p in zip(state.layers, prefix.layers))
  return DecodeState(layers=layers, lengths=state.lengths.at[0].set(length))


def _select_row(state: DecodeState, row: int, capacity: int) -> DecodeState:
  """Row ``row`` of a batched (host) state as a batch-1 state with ``capacity`` positions."""
  def take(cache):
    if isinstance(cache, (AttentionCache, MLACache)):
      return jax.tree_util.tree_map(lambda x: x[row:row + 1, :capacity], cache)
    return jax.tree_util.tree_map(lambda x: x[row:row + 1], cache)
  return DecodeState(layers=tuple(take(c) for c in state.layers),
                     lengths=state.lengths[row:row + 1])


# -- the decode pool --------------------------------------------------------------

@struct.dataclass
class SlotPool:
  """The decode engine's whole device state (JetStream's ``decode_state``).

  Attributes:
    layers: per layer a ``PagedKV``/``PagedLatent`` (page pool) or a slot-indexed
      ``SlidingWindowCache``/``GatedDeltaCache``/``Mamba2Cache`` ``[n_slots, ...]``.
    lengths: int32 [n_slots], tokens in the cache of each slot.
    page_table: int32 [n_slots, max_pages]; page ids owned by each slot. Entries
      past a slot's pages hold 0: a valid page (so a kernel may read it safely)
      whose keys lie past the slot's length and are masked; writes never go
      there because a slot only writes positions it reserved.
    page_count: int32 [n_slots], pages owned by each slot (writes past them drop).
    tokens: int32 [n_slots], the next input token of each slot (last sampled).
    active: bool [n_slots].
    seeds (uint32), temperature, top_k, top_p: per-slot sampling settings.
  """

  layers: tuple
  lengths: jax.Array
  page_table: jax.Array
  page_count: jax.Array
  tokens: jax.Array
  active: jax.Array
  seeds: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array


class PageAllocator:
  """Free list of KV pages (host side)."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))

  @property
  def free_pages(self) -> int:
    return len(self._free)

  def alloc(self, n: int) -> list[int]:
    if n > len(self._free):
      raise PoolExhaustedError(f"need {n} KV pages, {len(self._free)} free")
    return [self._free.pop() for _ in range(n)]

  def release(self, pages: Sequence[int]) -> None:
    self._free.extend(reversed(list(pages)))


def _keep_active(active, new, old):
  """Rows of inactive slots keep their old value (so empty slots stay inert)."""
  def sel(n, o):
    mask = active.reshape((-1,) + (1,) * (n.ndim - 1))
    return jnp.where(mask, n, o)
  return jax.tree_util.tree_map(sel, new, old)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _generate_core(graph, params, pool: SlotPool):
  model = nnx.merge(api.graphdef_of(graph), params)
  lengths, active = pool.lengths, pool.active
  x = model.embed(pool.tokens)
  layers = []
  for block, cache in zip(model.blocks, pool.layers):
    h_in = block.mixer_norm(x)
    if isinstance(cache, (PagedKV, PagedLatent)):
      ps = jax.tree_util.tree_leaves(cache)[0].shape[1]
      num_pages = jax.tree_util.tree_leaves(cache)[0].shape[0]
      rows = jnp.arange(lengths.shape[0])
      index = lengths // ps
      page = pool.page_table[rows, jnp.minimum(index, pool.page_table.shape[1] - 1)]
      owned = active & (index < pool.page_count)
      write_page = jnp.where(owned, page, num_pages)  # out of range -> dropped
      h, *pages = block.mixer.paged_step(h_in, *jax.tree_util.tree_leaves(cache), lengths,
                                         pool.page_table, write_page)
      new_cache = type(cache)(*pages)
    else:
      h, new_cache = block.mixer.step(h_in, cache, lengths)
      new_cache = _keep_active(active, new_cache, cache)
    x = block.feed_forward(x + h)
    layers.append(new_cache)
  logits = model.logits(x)
  positions = lengths + 1
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(pool.seeds, positions)
  tokens = api.sample_tokens(logits, keys, pool.temperature, pool.top_k, pool.top_p)
  tokens = jnp.where(active, tokens, 0)
  new_pool = pool.replace(layers=tuple(layers), lengths=jnp.where(active, positions, lengths),
                          tokens=tokens)
  return new_pool, tokens


@functools.partial(jax.jit, donate_argnums=0)
def _insert_core(pool: SlotPool, prefix_layers: tuple, length, slot, page_row, write_row, token,
                 seed, temperature, top_k, top_p):
  """Writes one request into ``slot``.

  ``page_row`` [max_pages]: the slot's pages, ``num_pages`` past them (the
  page table row). ``write_row`` [n_write]: the pages written, the slot's
  pages then ``num_pages`` (dropped); growing caches arrive as
  [1, n_write * page_size, ...], so the work follows the request's pages,
  not the pool's max context.
  """
  layers = []
  for cache, src in zip(pool.layers, prefix_layers):
    if isinstance(cache, (PagedKV, PagedLatent)):
      ps = jax.tree_util.tree_leaves(cache)[0].shape[1]

      def put(pages, x):
        x = x[0].reshape((write_row.shape[0], ps) + x.shape[2:])
        return pages.at[write_row].set(x.astype(pages.dtype), mode="drop")
      dst_leaves, treedef = jax.tree_util.tree_flatten(cache)
      src_leaves = jax.tree_util.tree_leaves(src)
      layers.append(jax.tree_util.tree_unflatten(
          treedef, [put(d, x) for d, x in zip(dst_leaves, src_leaves)]))
    else:
      layers.append(jax.tree_util.tree_map(
          lambda dst, x: dst.at[slot].set(x[0].astype(dst.dtype)), cache, src))
  return pool.replace(
      layers=tuple(layers), lengths=pool.lengths.at[slot].set(length),
      page_table=pool.page_table.at[slot].set(jnp.where(page_row < num_pages_of(pool),
                                                         page_row, 0)),
      page_count=pool.page_count.at[slot].set(jnp.sum(page_row < num_pages_of(pool))),
      tokens=pool.tokens.at[slot].set(token),
      active=pool.active.at[slot].set(True), seeds=pool.seeds.at[slot].set(seed),
      temperature=pool.temperature.at[slot].set(temperature),
      top_k=pool.top_k.at[slot].set(top_k), top_p=pool.top_p.at[slot].set(top_p))


def num_pages_of(pool: SlotPool) -> int:
  for cache in pool.layers:
    if isinstance(cache, (PagedKV, PagedLatent)):
      return jax.tree_util.tree_leaves(cache)[0].shape[0]
  return 0


@functools.partial(jax.jit, donate_argnums=0)
def _free_core(pool: SlotPool, slot, empty_row):
  return pool.replace(active=pool.active.at[slot].set(False),
                      lengths=pool.lengths.at[slot].set(0),
                      page_table=pool.page_table.at[slot].set(empty_row),
                      page_count=pool.page_count.at[slot].set(0),
                      tokens=pool.tokens.at[slot].set(0))


def init_pool(config: ModelConfig, n_slots: int, num_pages: int, page_size: int,
              max_pages: int) -> SlotPool:
  """An empty pool: zero pages, zero slot states, all slots inactive."""
  dense = init_state(config, n_slots, 0)
  layers = []
  for kind, cache in zip(config.layer_kinds, dense.layers):
    paged = kind_spec(kind).paged
    layers.append(cache if paged is None else paged.pool_type(**{
        name: jnp.zeros(shape, dtype)
        for name, (shape, dtype) in paged.pool_shapes(config, num_pages, page_size).items()}))
  return SlotPool(
      layers=tuple(layers), lengths=jnp.zeros((n_slots,), jnp.int32),
      page_table=jnp.zeros((n_slots, max_pages), jnp.int32),
      page_count=jnp.zeros((n_slots,), jnp.int32),
      tokens=jnp.zeros((n_slots,), jnp.int32), active=jnp.zeros((n_slots,), bool),
      seeds=jnp.zeros((n_slots,), jnp.uint32), temperature=jnp.zeros((n_slots,), jnp.float32),
      top_k=jnp.zeros((n_slots,), jnp.int32), top_p=jnp.ones((n_slots,), jnp.float32))


class DecodeEngine:
  """A fixed pool of decode slots over a paged KV pool.

  Not thread-safe: one scheduler thread owns it (``DecodeScheduler``).
  """

  def __init__(self, model: api.Model, config: EngineConfig = EngineConfig()):
    self.model = model
    self.config = config
    mc = model.config
    max_ctx = min(config.max_ctx or mc.max_seq_len, mc.max_seq_len)
    self.page_size = config.page_size
    self.max_pages = -(-max_ctx // config.page_size)
    self.max_ctx = self.max_pages * config.page_size
    self.num_pages = config.num_pages or config.n_slots * self.max_pages
    self.n_slots = config.n_slots
    self.has_pages = any(kind_spec(k).paged is not None for k in mc.layer_kinds)
    self.pool = init_pool(mc, self.n_slots, self.num_pages, self.page_size, self.max_pages)
    self.allocator = PageAllocator(self.num_pages)
    self._slot_pages: dict[int, list[int]] = {}
    self._free_slots = list(range(self.n_slots - 1, -1, -1))
    self._empty_row = jnp.zeros((self.max_pages,), jnp.int32)

  # -- capacity --------------------------------------------------------------------

  @property
  def free_slots(self) -> int:
    return len(self._free_slots)

  @property
  def free_pages(self) -> int:
    return self.allocator.free_pages

  def pages_needed(self, total_tokens: int) -> int:
    return -(-total_tokens // self.page_size) if self.has_pages else 0

  def can_admit(self, total_tokens: int) -> bool:
    return bool(self._free_slots) and self.pages_needed(total_tokens) <= self.free_pages

  def fits_ever(self, total_tokens: int) -> bool:
    return total_tokens <= self.max_ctx and self.pages_needed(total_tokens) <= self.num_pages

  def reserve(self, total_tokens: int) -> int:
    """Takes a free slot and the pages for ``total_tokens`` positions; returns the slot."""
    if not self.fits_ever(total_tokens):
      raise InvalidRequestError(f"a request of {total_tokens} tokens (prompt + new) does not "
                                f"fit a decode slot of {self.max_ctx} tokens")
    if not self._free_slots:
      raise PoolExhaustedError("no free decode slot")
    pages = self.allocator.alloc(self.pages_needed(total_tokens))
    slot = self._free_slots.pop()
    self._slot_pages[slot] = pages
    return slot

  # -- JetStream boundary ----------------------------------------------------------

  def insert(self, prefix: DecodeState, slot: int, first_token: int,
             params: RequestParams) -> None:
    """Places a batch-1 prefilled state into a reserved ``slot``.

    ``first_token`` (sampled from the prefill logits) is the slot's next input.
    """
    if slot not in self._slot_pages:
      raise EngineError(f"slot {slot} was not reserved")
    length = int(np.asarray(prefix.lengths).reshape(-1)[0])
    pages = self._slot_pages[slot]
    if self.has_pages and len(pages) * self.page_size < length + 1:
      raise EngineError(f"slot {slot} holds {len(pages) * self.page_size} positions, "
                        f"the state has {length}")
    row = np.full((self.max_pages,), self.num_pages, np.int32)
    row[:len(pages)] = pages
    # Only the slot's own pages are written, their count bucketed to a power
    # of two (a handful of insert compiles), so the cost follows the request.
    n_write = min(self.max_pages, 1 << max(len(pages) - 1, 0).bit_length())
    write_row = row[:n_write]
    src = tuple(self._pad_layer(c, n_write * self.page_size) for c in prefix.layers)
    s = params.sampling
    self.pool = _insert_core(self.pool, src, jnp.int32(length), jnp.int32(slot),
                             jnp.asarray(row), jnp.asarray(write_row), jnp.int32(first_token),
                             jnp.uint32(params.seed),
                             jnp.float32(s.temperature), jnp.int32(s.top_k),
                             jnp.float32(s.top_p))

  def _pad_layer(self, cache, positions: int):
    """Growing caches padded/cut to ``positions`` (the pages written)."""
    if not isinstance(cache, (AttentionCache, MLACache)):
      return cache

    def fit(x):
      x = np.asarray(x)
      out = np.zeros((1, positions) + x.shape[2:], x.dtype)
      n = min(x.shape[1], positions)
      out[:, :n] = x[:, :n]
      return out
    return jax.tree_util.tree_map(fit, cache)

  def generate(self) -> np.ndarray:
    """One decode step for every slot; returns int32 [n_slots] (0 for empty slots)."""
    # The pre-hashed graph: hashing a whole GraphDef per step costs ms.
    self.pool, tokens = _generate_core(self.model.static_graph, self.model.params, self.pool)
    return np.asarray(tokens)

  def free(self, slot: int) -> None:
    pages = self._slot_pages.pop(slot, None)
    if pages is None:
      return
    self.allocator.release(pages)
    self.pool = _free_core(self.pool, jnp.int32(slot), self._empty_row)
    self._free_slots.append(slot)

  def warmup(self) -> float:
    """Compiles insert, generate and free; returns seconds spent."""
    t0 = time.perf_counter()
    slot = self.reserve(2)
    state = init_state(self.model.config, 1, CAPACITY_ALIGN)
    state = state.replace(lengths=jnp.ones((1,), jnp.int32))
    self.insert(state, slot, 0, RequestParams())
    self.generate()
    self.free(slot)
    self.generate()
    return time.perf_counter() - t0
