"""The prefill engine: batched, chunked prefill (JetStream's ``prefill``).

``PrefillEngine.prefill(requests)`` turns prompts into per-request
``DecodeState``s (batch 1) plus the first sampled token, optionally through the
hybrid prefix cache, streaming each computed layer or chunk to a sink (the
state transfer). ``DecodeEngine`` (``decode_engine.py``) takes those states.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.codec.encode import spans_devices
from paas_jax.models import api
from paas_jax.serving.batch_rows import pad_rows, sample_rows, select_row, with_row
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.logprobs import TokenLogprob
from paas_jax.serving.token_logprob_ops import rows_logprobs
from paas_jax.serving.validation import EngineError, InvalidRequestError, RequestParams
from paas_jax.state import DecodeState, init_state, round_up
from paas_jax.state.prefix_cache import HybridPrefixCache


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
    state: batch-1 state holding the whole prompt (capacity rounded up): numpy
      arrays, or device arrays for leaves spread over several devices (TP).
    first_token: the token sampled from the last prompt position.
    prefill_s: wall time of the batch that computed it.
    first_logprob: the first token's log-probabilities when the request asked
      for them (``RequestParams.logprobs``), else None.
  """

  request_id: str
  state: DecodeState
  first_token: int
  prompt_len: int
  prefill_s: float
  batch_size: int
  cached_tokens: int = 0  # prompt tokens reused from the prefix cache
  first_logprob: TokenLogprob | None = None


def first_logprobs(logits, first, inputs: Sequence[PrefillInput]) -> list[TokenLogprob | None]:
  """Per input, its first token's ``TokenLogprob`` (None unless it asked).

  ``logits`` f32 [batch >= len(inputs), vocab] on the device (the logits
  ``first`` int [batch] was sampled from); no device work when none asked.
  """
  rows = [i for i, x in enumerate(inputs) if x.params.logprobs >= 0]
  out: list[TokenLogprob | None] = [None] * len(inputs)
  if rows:
    got = rows_logprobs(logits, first, rows, [inputs[i].params.logprobs for i in rows])
    for i, lp in zip(rows, got):
      out[i] = lp
  return out



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
      self.prefix_cache = HybridPrefixCache(model.config, block_size=config.prefix_block,
                                            capacity_bytes=config.prefix_cache_bytes)

  def cached_prefix_tokens(self, prompt: Sequence[int]) -> int:
    """Longest prefix of ``prompt`` the prefix cache would reuse (0 without one;
    no lock: ``HybridPrefixCache.probe``)."""
    return 0 if self.prefix_cache is None else self.prefix_cache.probe(prompt)

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
      first_lp = first_logprobs(logits, first, [x])[0]
      if layer_sink is not None:
        for i, cache in enumerate(state.layers):
          layer_sink(i, cache)
      host = _host_unless_sharded(state)
      outputs.append(PrefillOutput(
          request_id=x.request_id, state=select_row(host, 0, round_up(len(tokens))),
          first_token=int(first[0]), prompt_len=len(tokens), prefill_s=0.0,
          batch_size=len(inputs), cached_tokens=int(reused), first_logprob=first_lp))
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
      start, state = resume[0], with_row(state, resume[1], resume[0])
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
    last_logits = jnp.asarray(pad_rows(last_rows, batch))
    first = sample_rows(last_logits, [x.params for x in inputs], [int(l) for l in lens[:n]])
    first_lps = first_logprobs(last_logits, first, inputs)
    host = _host_unless_sharded(state)
    elapsed = time.perf_counter() - t0
    outputs = []
    for i, x in enumerate(inputs):
      outputs.append(PrefillOutput(
          request_id=x.request_id, state=select_row(host, i, round_up(int(lens[i]))),
          first_token=int(first[i]), prompt_len=int(lens[i]), prefill_s=elapsed,
          batch_size=n, first_logprob=first_lps[i]))
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
      with self._lock:
        self.prefix_cache = HybridPrefixCache(self.model.config, block_size=block,
                                              capacity_bytes=self.config.prefix_cache_bytes)
    return time.perf_counter() - t0


def _host_unless_sharded(state: DecodeState) -> DecodeState:
  """One host copy of a batched state, except leaves spread over several devices
  (tensor parallelism): those stay on their devices (rows are sliced there), so
  the prefill side never gathers a sharded state."""
  return jax.tree_util.tree_map(lambda x: x if spans_devices(x) else np.asarray(x), state)
