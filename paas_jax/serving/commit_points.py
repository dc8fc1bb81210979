"""Decode side of chunk-pipelined transfer: committed segments -> commit points.

Each segment (``chunk_stream``) arrives as a transfer the receiver verified
(every object's size and crc32c, the manifest at Commit) and restored into the
segment template. ``SegmentAssembler.add`` checks it once more against what its
id announces (the manifest's ``lengths`` equal the segment's end, every
growing layer holds exactly ``end - start`` tokens, the layer count matches)
and keeps it on the host. A **commit point** is the end ``n`` of a commit
segment such that segments ``0..k`` all arrived and verified: then full
attention KV ``[0, n)`` is the concatenation of their slices and the fixed-size
state at ``n`` is the commit segment's. A segment that failed (e.g. a chunk
that stayed corrupt past the retry limit) never arrives, so no commit point at
or past it is ever used. ``committed_state`` builds the batch-1 state a local
(PD-P) prefill continues from, or the decode pool inserts when ``n`` is the
whole prompt.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

import jax
import numpy as np

from paas_jax.models.config import ModelConfig
from paas_jax.serving.chunk_stream import (GROWING_CACHES, SegmentId, segment_layers)
from paas_jax.state import DecodeState, init_state, round_up


class SegmentError(ValueError):
  """A segment does not match what its id announces (never used)."""


@dataclasses.dataclass
class _Request:
  segments: dict[int, tuple[SegmentId, tuple]] = dataclasses.field(default_factory=dict)
  rejected: set[int] = dataclasses.field(default_factory=set)


def _growing_tokens(cache) -> int:
  return int(jax.tree_util.tree_leaves(cache)[0].shape[1])


class SegmentAssembler:
  """Per request, the verified segments and the commit points they make.

  Thread-safe: the receiver's ``on_ready``/``on_failure`` add and reject from
  transport threads while the serving side reads commit points.
  """

  def __init__(self, config: ModelConfig):
    self.config = config
    self._lock = threading.Lock()
    self._requests: dict[str, _Request] = {}

  def add(self, transfer_id: str, state: DecodeState) -> SegmentId:
    """Keeps a committed segment (restored ``state``); ``SegmentError`` if it
    does not match its id (then the segment is recorded as rejected)."""
    seg = SegmentId.parse(transfer_id)
    try:
      layers = self._check(seg, state)
    except SegmentError:
      self.reject(transfer_id)
      raise
    with self._lock:
      self._requests.setdefault(seg.request_id, _Request()).segments[seg.index] = (seg, layers)
    return seg

  def _check(self, seg: SegmentId, state: DecodeState) -> tuple:
    want = segment_layers(self.config, seg.commit)
    if len(state.layers) != len(want):
      raise SegmentError(f"segment {seg.wire()} has {len(state.layers)} layers, its id "
                         f"announces {len(want)}")
    lengths = np.asarray(state.lengths).reshape(-1)
    if lengths.shape != (1,) or int(lengths[0]) != seg.end:
      raise SegmentError(f"segment {seg.wire()}: manifest lengths {lengths.tolist()} != "
                         f"its end {seg.end}")
    host = []
    for cache in state.layers:
      cache = jax.tree_util.tree_map(np.asarray, cache)
      if isinstance(cache, GROWING_CACHES) and _growing_tokens(cache) != seg.end - seg.start:
        raise SegmentError(f"segment {seg.wire()}: a KV slice holds {_growing_tokens(cache)} "
                           f"tokens, the segment {seg.end - seg.start}")
      host.append(cache)
    return tuple(host)

  def reject(self, transfer_id: str) -> None:
    """A segment failed (transfer error or check): no commit point at or past it."""
    seg = SegmentId.parse(transfer_id)
    with self._lock:
      req = self._requests.setdefault(seg.request_id, _Request())
      req.rejected.add(seg.index)
      req.segments.pop(seg.index, None)

  def _chain(self, request_id: str, below: int | None) -> tuple[int, list]:
    """(commit point, segments 0..k) of the longest verified prefix; a commit
    point < ``below`` when given. Holds the lock."""
    req = self._requests.get(request_id)
    if req is None:
      return 0, []
    point, chain, run, i, end = 0, [], [], 0, 0
    while i in req.segments and i not in req.rejected:
      seg, layers = req.segments[i]
      if seg.start != end:  # not contiguous: nothing past here is self-consistent
        break
      run.append((seg, layers))
      end = seg.end
      if seg.commit and (below is None or seg.end < below):
        point, chain = seg.end, list(run)
      i += 1
    return point, chain

  def commit_point(self, request_id: str, below: int | None = None) -> int:
    """Tokens of the longest verified self-consistent prefix (0: none)."""
    with self._lock:
      return self._chain(request_id, below)[0]

  def committed_state(self, request_id: str, below: int | None = None,
                      capacity: int = 0) -> tuple[int, DecodeState | None]:
    """(n, batch-1 host state holding exactly the prompt's first n tokens).

    ``below``: the newest commit point strictly before it (a resume that must
    still compute the prompt's last position for the first token passes the
    prompt length). Growing caches get ``capacity`` positions (default
    ``round_up(n)``). (0, None) without a commit point.
    """
    with self._lock:
      point, chain = self._chain(request_id, below)
    if not point:
      return 0, None
    capacity = max(capacity, round_up(point))
    full = init_state(self.config, 1, capacity)
    layers = list(jax.tree_util.tree_map(np.asarray, full.layers))
    positions = {m: j for j, m in enumerate(segment_layers(self.config, True))}
    for i in range(len(layers)):
      if isinstance(layers[i], GROWING_CACHES):
        # Each segment's layer i sits at the same place among its growing layers.
        j = segment_layers(self.config, False).index(i)
        parts = [seg_layers[j] if not seg.commit else seg_layers[positions[i]]
                 for seg, seg_layers in chain]
        layers[i] = jax.tree_util.tree_map(
            lambda dst, *xs: _fill(dst, np.concatenate(xs, axis=1)), layers[i], *parts)
      else:
        seg, seg_layers = chain[-1]
        layers[i] = seg_layers[positions[i]]
    return point, DecodeState(layers=tuple(layers), lengths=np.asarray([point], np.int32))

  def drop(self, request_id: str) -> None:
    with self._lock:
      self._requests.pop(request_id, None)

  def requests(self) -> list[str]:
    with self._lock:
      return list(self._requests)


def _fill(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
  out = np.array(dst)
  out[:, :src.shape[1]] = src.astype(out.dtype)
  return out


def recomputed_tokens(prompt_len: int, resumed_from: int) -> dict[str, Any]:
  """Per-request accounting of a resume: prompt tokens recomputed and saved."""
  return {"resumed_from": int(resumed_from), "recomputed_tokens": prompt_len - resumed_from,
          "saved_tokens": int(resumed_from)}


def resume_point(assembler: SegmentAssembler, earlier_id: str, prompt: Sequence[int],
                 earlier_prompt_len: int | None) -> tuple[int, DecodeState] | None:
  """(n, batch-1 host state of the prompt's first n tokens) to continue from, or
  None (full prefill): no commit point, or the earlier attempt was registered
  for another prompt length (not the same request)."""
  if earlier_prompt_len is None or earlier_prompt_len != len(prompt):
    return None
  n, state = assembler.committed_state(earlier_id, below=len(prompt))
  return (n, state) if n and state is not None else None
