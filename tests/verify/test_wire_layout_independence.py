"""What the Begin handshake need not cover: the decode side's KV page size.

The codec stores every leaf as its logical array (``[batch, seq, heads,
head_dim]`` for KV, the full recurrent state for G/m layers), never as pages, so
the same bytes mean the same thing to decode pools of any page size. (Likewise
for TP head order: shards are written at their global offsets and restored into
any other sharding, see ``tests/codec/test_sharded.py`` and
``tests/codec/test_shard_plan.py``.) Shown by restoring one encoded state into
paged pools of three page sizes and decoding token-exact against the
single-process reference; the negative control decodes a damaged restore through
the same check and is caught.
"""

from __future__ import annotations

import numpy as np
import pytest

from paas_jax.codec import MemoryStore, decode_state, encode_state
from paas_jax.models import api, load_config
from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.validation import RequestParams
from paas_jax.state import abstract_state, sensitivity
from tests import verify

NEW_TOKENS = 8
GREEDY = api.SamplingParams(0.0, 0, 1.0)


def _decode_in_pool(model: api.Model, state, first_token: int, page_size: int) -> list[int]:
  """Greedy tokens from a batch-1 restored ``state`` inserted into a paged pool."""
  engine = DecodeEngine(model, EngineConfig(n_slots=2, max_ctx=64, page_size=page_size))
  length = int(np.asarray(state.lengths).reshape(-1)[0])
  slot = engine.reserve(length + NEW_TOKENS)
  engine.insert(state, slot, first_token, RequestParams(GREEDY, seed=0,
                                                        max_new_tokens=NEW_TOKENS))
  tokens = [first_token]
  while len(tokens) < NEW_TOKENS:
    tokens.append(int(engine.generate()[slot]))
  return tokens


@pytest.mark.parametrize("name", ["tiny_gdn_gqa", "tiny_kda_mla"])
def test_one_wire_state_decodes_the_same_for_every_page_size(name):
  model, cfg = verify.model(name), load_config(name)
  prompt = verify.prompts(name, 1, seed=7)[0]
  reference = list(api.generate(model, prompt, NEW_TOKENS, sampling=GREEDY).tokens)
  _, state = api.prefill(model, np.asarray(prompt, np.int32))
  store = MemoryStore()
  encode_state(state, store, model_id=cfg.name, config_fingerprint=cfg.fingerprint())
  received = decode_state(store, like=abstract_state(cfg, 1, state.capacity))

  for page_size in (8, 16, 32):
    assert _decode_in_pool(model, received, reference[0], page_size) == reference, page_size

  # Negative control: the same comparison catches a lost/truncated state.
  damaged = sensitivity.damage(received, cfg.layer_kinds)
  assert _decode_in_pool(model, damaged, reference[0], 16) != reference
