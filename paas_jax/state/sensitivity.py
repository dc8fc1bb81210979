"""Does a model's output depend on its decode state? Corruptions and checks.

A test model whose greedy tokens do not depend on the state cannot catch a
lost or wrong state: with a tied head and unit-scale embeddings, the tiny
configs echoed the last prompt token and decoded the same text from another
request's state. This module measures that (``measure``), corrupts a handed-off
state one layer kind at a time (``corrupt``), and runs the checks the serving
tests use against a reference that shares nothing with the serving path
(``reference``: one full single-process prefill of prompt + generated tokens,
and plain greedy ``api.generate``; no paging, transport, batching or prefix
cache).

Checks (each returns True when the state passes):
  * ``check_tokens``: greedy tokens decoded from the state equal the reference's;
  * ``check_logits``: teacher-forced logits of the first ``LOGIT_STEPS`` steps
    are within ``LOGIT_ATOL`` of the reference's;
  * ``check_probe``: the production ``logit_probe`` made from the reference's
    logits accepts the state's first step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.models import api
from paas_jax.models.kinds import REGISTRY, KindSpec, StatePositions, kind_spec
from paas_jax.state import logit_probe
from paas_jax.state.cache import DecodeState

# Teacher-forced steps compared, and their tolerance (f32 logits; prefill and
# decode kernels differ by ~1e-5 on the tiny configs).
LOGIT_STEPS = 3
LOGIT_ATOL = 2e-3
# The KV block a "drop the last block" corruption loses (the decode pool's page).
KV_BLOCK = 16

CORRUPTIONS = ("zero", "drop_last_block", "shift", "swap")
CHECKS = ("tokens", "logits", "probe")


def corruptions_for(spec: KindSpec) -> tuple[str, ...]:
  """The corruptions that apply to a layer kind: a SUMMARY state (recurrent)
  has no per-position entries, so no KV block to drop."""
  if spec.positions is StatePositions.SUMMARY:
    return tuple(c for c in CORRUPTIONS if c != "drop_last_block")
  return CORRUPTIONS


# layer_pattern letter -> the corruptions that apply to it (from the kind registry).
APPLIES = {kind.value: corruptions_for(spec) for kind, spec in REGISTRY.items()}


def random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
  """``n`` prompts of ``length`` uniform random tokens (deterministic for ``seed``)."""
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(n)]


# -- reference (independent of serving) -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reference:
  """One prompt's ground truth.

  Attributes:
    tokens: greedy tokens from ``api.generate`` (prefill + plain decode).
    step_logits: f32 [LOGIT_STEPS, vocab]: logits after feeding tokens[0..],
      from one full prefill of prompt + tokens (no decode step involved).
  """

  prompt: tuple[int, ...]
  tokens: tuple[int, ...]
  step_logits: np.ndarray

  def probe(self, dtype: str) -> logit_probe.LogitProbe:
    return logit_probe.fingerprint(self.step_logits[0], self.tokens[0], dtype)


def reference(model: api.Model, prompt: Sequence[int], n_new: int) -> Reference:
  tokens = api.generate(model, list(prompt), n_new).tokens
  full = list(prompt) + list(tokens[:LOGIT_STEPS])
  logits, _ = api.prefill(model, np.asarray(full, np.int32))
  start = len(prompt)
  return Reference(tuple(prompt), tuple(tokens),
                   np.asarray(logits[0, start:start + LOGIT_STEPS], np.float32))


# -- decoding from a given state ---------------------------------------------------------

def greedy_from(model: api.Model, state: DecodeState, first_tokens: Sequence[int],
                n_new: int) -> np.ndarray:
  """int [batch, n_new]: the first tokens, then greedy decode from ``state``."""
  token = np.asarray(first_tokens, np.int32)
  out = [token]
  for _ in range(n_new - 1):
    logits, state = api.decode_step(model, state, jnp.asarray(token))
    token = np.asarray(logits).argmax(axis=-1).astype(np.int32)
    out.append(token)
  return np.stack(out, axis=1)


def forced_logits(model: api.Model, state: DecodeState, tokens: np.ndarray,
                  steps: int = LOGIT_STEPS) -> np.ndarray:
  """f32 [batch, steps, vocab]: logits of decode steps fed ``tokens`` [batch, >=steps]."""
  out = []
  for j in range(steps):
    logits, state = api.decode_step(model, state, jnp.asarray(tokens[:, j], jnp.int32))
    out.append(np.asarray(logits, np.float32))
  return np.stack(out, axis=1)


# -- checks --------------------------------------------------------------------------------

# The checks run each request of the handed-off state on its own (batch 1), as
# the probe does, so a model compiles one prefill and one step shape in all.

def check_tokens(model, state, refs: Sequence[Reference]) -> bool:
  for i, r in enumerate(refs):
    got = greedy_from(model, state.select(i), [r.tokens[0]], len(r.tokens))[0]
    if not np.array_equal(got, r.tokens):
      return False
  return True


def logit_error(model, state, refs: Sequence[Reference]) -> float:
  """Max |logit - reference| over the teacher-forced steps of every request."""
  err = 0.0
  for i, r in enumerate(refs):
    got = forced_logits(model, state.select(i), np.asarray([r.tokens]))[0]
    err = max(err, float(np.max(np.abs(got - r.step_logits))))
  return err


def check_logits(model, state, refs: Sequence[Reference], atol: float = LOGIT_ATOL) -> bool:
  return logit_error(model, state, refs) <= atol


def check_probe(model, state, refs: Sequence[Reference]) -> bool:
  return all(logit_probe.check_state(model, state.select(i), r.probe(model.config.dtype)).ok
             for i, r in enumerate(refs))


CHECK_FNS: dict[str, Callable] = {"tokens": check_tokens, "logits": check_logits,
                                  "probe": check_probe}


# -- corruptions (on host copies: numpy, so that no small program compiles per shape) --------

def to_host(state: DecodeState) -> DecodeState:
  return jax.tree_util.tree_map(np.asarray, state)


def _np_zeroed(x, index):
  """``x`` (a host array) with positions ``index`` of axis 1 zeroed, copied."""
  x = np.array(x)
  x[:, index] = 0
  return x


def _jnp_zeroed(x, index):
  """The same for a traced array."""
  return x.at[:, index].set(0)


def _zero_main(cache, spec: KindSpec, zeros_like=np.zeros_like):
  """The layer's state with its main arrays zeroed: the kind's
  ``summary_fields`` (the recurrent state), or every array (all KV)."""
  if spec.summary_fields:
    return cache.replace(**{f: zeros_like(getattr(cache, f)) for f in spec.summary_fields})
  return jax.tree_util.tree_map(zeros_like, cache)


def _drop_last_block(cache, spec: KindSpec, length: int, block: int, zeroed=_np_zeroed):
  """Zeroes the positions of the last (partial) KV block ``[start, length)``."""
  start = ((length - 1) // block) * block
  if spec.positions is StatePositions.LINEAR:
    return jax.tree_util.tree_map(lambda x: zeroed(x, slice(start, length)), cache)
  if spec.positions is StatePositions.RING:
    window = jax.tree_util.tree_leaves(cache)[0].shape[1]
    slots = np.asarray(sorted({p % window for p in range(max(start, length - window), length)}))
    return jax.tree_util.tree_map(lambda x: zeroed(x, slots), cache)
  raise ValueError(f"{type(cache).__name__} has no KV blocks")


def _shift(cache, stale_cache, spec: KindSpec, length: int):
  """Off by one token: KV one position late (an offset bug), or the recurrent
  state of the prompt without its last token (a stale checkpoint)."""
  if spec.positions is StatePositions.LINEAR:
    def roll(x):
      x = np.array(x)
      x[:, 1:length] = x[:, :length - 1].copy()
      x[:, 0] = 0
      return x
    return jax.tree_util.tree_map(roll, cache)
  if spec.positions is StatePositions.RING:
    return jax.tree_util.tree_map(lambda x: np.roll(x, 1, axis=1), cache)
  return stale_cache


def _swap(cache):
  return jax.tree_util.tree_map(lambda x: np.asarray(x)[[1, 0]], cache)


def corrupt(state: DecodeState, kinds: Sequence[str], kind: str, corruption: str, *,
            stale: DecodeState | None = None, block: int = KV_BLOCK) -> DecodeState:
  """``state`` (batch 2, equal lengths, host arrays: ``to_host``) with
  ``corruption`` applied to every layer of ``kind`` (``kinds``: the config's
  layer kinds) and nothing else.

  ``stale``: the state of the same prompts without their last token (needed by
  "shift" on recurrent layers).
  """
  if corruption not in corruptions_for(kind_spec(kind)):
    raise ValueError(f"corruption {corruption!r} does not apply to layer kind {kind!r}")
  length = int(np.asarray(state.lengths)[0])
  spec = kind_spec(kind)
  layers = []
  for i, (k, cache) in enumerate(zip(kinds, state.layers)):
    if k != kind:
      layers.append(cache)
    elif corruption == "zero":
      layers.append(_zero_main(cache, spec))
    elif corruption == "drop_last_block":
      layers.append(_drop_last_block(cache, spec, length, block))
    elif corruption == "shift":
      if stale is None:
        raise ValueError("shift needs the stale state")
      layers.append(_shift(cache, stale.layers[i], spec, length))
    elif corruption == "swap":
      layers.append(_swap(cache))
    else:
      raise ValueError(f"unknown corruption {corruption!r}")
  return state.replace(layers=tuple(layers))


def damage(state: DecodeState, kinds: Sequence[str], block: int = KV_BLOCK) -> DecodeState:
  """A lost/truncated batch-1 state, for fault injection: every recurrent
  (SUMMARY) state zeroed and the last KV block of every other layer dropped."""
  host = to_host(state)
  return _damaged(host, kinds, int(np.asarray(host.lengths)[0]), block, np.zeros_like,
                  _np_zeroed)


def damage_traced(state: DecodeState, kinds: Sequence[str], length: int,
                  block: int = KV_BLOCK) -> DecodeState:
  """``damage`` as a traceable function, for a state that lives sharded over
  several processes (a decode slice's: jit it with the state's shardings and
  run it on every process). ``length`` (the prompt's) is static: no process
  can read the sharded ``lengths`` back on its own."""
  return _damaged(state, kinds, length, block, jnp.zeros_like, _jnp_zeroed)


def _damaged(state, kinds, length: int, block: int, zeros_like, zeroed):
  specs = [kind_spec(k) for k in kinds]
  layers = tuple(_zero_main(c, s, zeros_like) if s.positions is StatePositions.SUMMARY
                 else _drop_last_block(c, s, length, block, zeroed)
                 for s, c in zip(specs, state.layers))
  return state.replace(layers=layers)


# -- the whole picture for one model ---------------------------------------------------------

@dataclasses.dataclass
class Handoff:
  """Two requests' handed-off state (batch 2, one prefill) and their references."""

  state: DecodeState
  stale: DecodeState
  refs: list[Reference]


def handoff(model: api.Model, prompts: Sequence[Sequence[int]], n_new: int) -> Handoff:
  """The true state of two equal-length prompts, the stale one (last token
  missing) and each prompt's reference."""
  if len(prompts) != 2 or len(prompts[0]) != len(prompts[1]):
    raise ValueError("handoff takes two prompts of equal length")
  def batch_of_two(rows):
    return jax.tree_util.tree_map(lambda *x: np.concatenate(x, axis=0), *rows)
  states = [to_host(api.prefill(model, np.asarray(p, np.int32))[1]) for p in prompts]
  stales = [to_host(api.prefill(model, np.asarray(p[:-1], np.int32))[1]) for p in prompts]
  if states[0].capacity:
    stales = [s.grow(states[0].capacity) for s in stales]
  refs = [reference(model, p, n_new) for p in prompts]
  return Handoff(batch_of_two(states), batch_of_two(stales), refs)


def negative_controls(model: api.Model, h: Handoff, checks: Sequence[str] = CHECKS
                      ) -> dict[str, dict[str, bool]]:
  """{"<kind>/<corruption>": {check: caught}} plus "true": {check: passed}."""
  kinds = model.config.layer_kinds
  table = {"true": {c: CHECK_FNS[c](model, h.state, h.refs) for c in checks}}
  for kind in sorted(set(kinds)):
    for corruption in APPLIES[kind]:
      bad = corrupt(h.state, kinds, kind, corruption, stale=h.stale)
      table[f"{kind}/{corruption}"] = {c: not CHECK_FNS[c](model, bad, h.refs)
                                       for c in checks}
  return table


def measure(model: api.Model, prompts: Sequence[Sequence[int]], n_new: int) -> dict:
  """How much the greedy output depends on the state, over ``prompts``.

  Returns counts over the prompts: ``first_equals_last`` (first greedy token ==
  last prompt token), ``wrong_state_same`` (greedy decode from the next
  prompt's state, fed this prompt's first token, gives this prompt's output),
  ``zero_state_same`` (same from an all-zero state of the right length).
  """
  outs, states = [], []
  for p in prompts:
    logits, state = api.prefill(model, np.asarray(p, np.int32))
    first = int(np.asarray(logits[0, -1]).argmax())
    outs.append(greedy_from(model, state, [first], n_new)[0])
    states.append(to_host(state))
  n = len(prompts)
  wrong = zero = 0
  for i in range(n):
    other = states[(i + 1) % n]
    wrong += bool(np.array_equal(greedy_from(model, other, [outs[i][0]], n_new)[0], outs[i]))
    zeroed = jax.tree_util.tree_map(np.zeros_like, states[i]).replace(
        lengths=states[i].lengths)
    zero += bool(np.array_equal(greedy_from(model, zeroed, [outs[i][0]], n_new)[0], outs[i]))
  return {"prompts": n, "new_tokens": n_new,
          "first_equals_last": sum(int(o[0] == p[-1]) for o, p in zip(outs, prompts)),
          "wrong_state_same": wrong, "zero_state_same": zero}
