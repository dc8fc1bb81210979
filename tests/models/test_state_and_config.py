"""State sizing (issue 2 item iv), config validation (item v), input checks."""

import dataclasses

import numpy as np
import pytest

from paas_jax.models import (AttentionConfig, GatedDeltaConfig, Mamba2Config, ModelConfig,
                             list_configs, load_config)
from paas_jax.models import api
from paas_jax.state import init_state, state_bytes
from tests.models.conftest import get_model, sweep


@pytest.mark.parametrize("name, seq_len", sweep([1, 37, 130], 37))
def test_analytic_state_bytes_equal_real_nbytes(name, seq_len):
  model = get_model(name)
  toks = np.random.RandomState(seq_len).randint(0, model.config.vocab_size, size=seq_len)
  _, state = api.prefill(model, toks)
  trimmed = state.trim()
  analytic = state_bytes(model.config, seq_len)
  assert trimmed.nbytes == analytic.total
  # Fixed part: a state with no tokens holds exactly the fixed bytes.
  assert init_state(model.config, 1, 0).nbytes == analytic.fixed


@pytest.mark.parametrize("name", list_configs())
def test_every_shipped_config_sizes_consistently(name):
  """Shape-only paper configs too: the closed form matches allocated shapes."""
  import jax
  from paas_jax.state import abstract_state
  config = load_config(name)
  for seq_len in (0, 1000):
    tree = abstract_state(config, 1, seq_len)
    real = sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
               for x in jax.tree_util.tree_leaves(tree))
    assert real == state_bytes(config, seq_len).total


def _base(**changes):
  cfg = dict(name="bad", vocab_size=32, d_model=32, n_layers=2, layer_pattern="GA", d_ff=64,
             attention=AttentionConfig(n_heads=4, n_kv_heads=2),
             gated_delta=GatedDeltaConfig(n_k_heads=2, n_v_heads=2, head_k_dim=8,
                                          head_v_dim=8))
  cfg.update(changes)
  return ModelConfig(**cfg)


@pytest.mark.parametrize("changes, field", [
    (dict(layer_pattern="GX"), "layer_pattern"),
    (dict(attention=AttentionConfig(n_heads=5, n_kv_heads=1)), "AttentionConfig.n_heads"),
    (dict(attention=AttentionConfig(n_heads=4, n_kv_heads=3)), "AttentionConfig.n_kv_heads"),
    (dict(layer_pattern="SA", attention=AttentionConfig(n_heads=4, n_kv_heads=2, window=0)),
     "AttentionConfig.window"),
    (dict(layer_pattern="SA", attention=AttentionConfig(n_heads=4, n_kv_heads=2, window=-3)),
     "AttentionConfig.window"),
    (dict(layer_pattern="mA"), "ModelConfig.mamba2"),
    (dict(layer_pattern="mA", mamba2=Mamba2Config(n_heads=3, head_dim=8, d_state=8,
                                                  n_groups=2)), "Mamba2Config.n_groups"),
    (dict(d_model=0), "ModelConfig.d_model"),
    (dict(n_layers=3), "ModelConfig.layer_pattern"),
    (dict(gated_delta=GatedDeltaConfig(n_k_heads=2, n_v_heads=2, head_k_dim=8, head_v_dim=8,
                                       gate="lstm")), "GatedDeltaConfig.gate"),
])
def test_bad_config_raises_value_error_naming_field(changes, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    _base(**changes)


def test_config_round_trips_through_dict_and_fingerprint():
  config = load_config("tiny_kda_mla")
  again = ModelConfig.from_dict(config.to_dict())
  assert again == config
  assert again.fingerprint() == config.fingerprint()
  assert dataclasses.replace(config, name="renamed").fingerprint() == config.fingerprint()
  assert dataclasses.replace(config, d_ff=256).fingerprint() != config.fingerprint()


def test_unknown_config_name_lists_available():
  with pytest.raises(ValueError, match="tiny_gdn_gqa"):
    load_config("no_such_model")


def test_bad_inputs_raise_value_error():
  model = api.Model.create(load_config("tiny_dense_gqa"))
  with pytest.raises(ValueError, match="vocab|lie in"):
    api.prefill(model, [1, 2, 999])
  with pytest.raises(ValueError, match="empty"):
    api.prefill(model, np.zeros((1, 0), np.int32))
  with pytest.raises(ValueError, match="max_seq_len"):
    api.prefill(model, np.ones(model.config.max_seq_len + 1, np.int32))
  _, state = api.prefill(model, [1, 2, 3])
  with pytest.raises(ValueError, match="one token per request"):
    api.decode_step(model, state, [1, 2])
  with pytest.raises(ValueError, match="max_new_tokens"):
    api.generate(model, [1, 2], 0)
