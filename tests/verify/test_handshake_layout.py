"""The Begin handshake refuses a state whose bytes would mean something else on
the decode side, one mismatch at a time; lossy link codecs (quantised KV) stay
inside the probe's lossy tolerance while a damaged state does not."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from paas_jax.codec import CodecOptions, MemoryStore, decode_state, encode_state
from paas_jax.models import load_config
from paas_jax.models import api
from paas_jax.state import abstract_state, logit_probe, sensitivity
from paas_jax.transport import StateReceiver, StateSender, TransferError, serve_receiver
from tests import verify


def _replace(sub: str, **changes):
  return lambda c: c.with_updates(**{sub: dataclasses.replace(getattr(c, sub), **changes)})


# What changes the meaning (or the layout) of a state's bytes.
MISMATCHES = {
    "activation/KV dtype": ("tiny_gdn_gqa", lambda c: c.with_updates(dtype="bfloat16")),
    "parameter dtype": ("tiny_gdn_gqa", lambda c: c.with_updates(param_dtype="bfloat16")),
    "conv-state layout (kernel)": ("tiny_gdn_gqa", _replace("gated_delta", conv_kernel=3)),
    "recurrent head layout": ("tiny_gdn_gqa", _replace("gated_delta", n_k_heads=4)),
    "KV head layout": ("tiny_gdn_gqa", _replace("attention", n_kv_heads=1)),
    "KV head dim": ("tiny_gdn_gqa", _replace("attention", head_dim=8)),
    "rope split": ("tiny_gdn_gqa", _replace("attention", rope_fraction=1.0)),
    "ring-buffer window": ("tiny_swa_gqa", _replace("attention", window=16)),
    "MLA latent rank": ("tiny_kda_mla", _replace("mla", kv_lora_rank=16)),
    "SSM state size": ("tiny_mamba2_gqa", _replace("mamba2", d_state=8)),
    "layer order": ("tiny_gdn_gqa", lambda c: c.with_updates(layer_pattern="AGGG")),
}


@pytest.fixture(scope="module")
def receivers():
  servers = {}
  for name in sorted({n for n, _ in MISMATCHES.values()}):
    cfg = load_config(name)
    rx = StateReceiver(models={cfg.name: cfg.fingerprint()},
                       template=lambda info, cfg=cfg: (abstract_state(cfg, 1, 64), None))
    servers[name] = serve_receiver(rx)
  yield servers
  for s in servers.values():
    s.stop(0)


def _begin(server, cfg_name: str, fingerprint: str, n_layers: int):
  with StateSender(server.address) as sender:
    tx = sender.begin(model_id=cfg_name, config_fingerprint=fingerprint, num_layers=n_layers,
                      lengths=[4])
    tx.abort("handshake test")


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_begin_refuses_a_layout_mismatch(receivers, what):
  name, mutate = MISMATCHES[what]
  cfg = load_config(name)
  other = mutate(cfg)
  _begin(receivers[name], cfg.name, cfg.fingerprint(), cfg.n_layers)  # control: accepted
  with pytest.raises(TransferError) as e:
    _begin(receivers[name], cfg.name, other.fingerprint(), other.n_layers)
  assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantised_link_passes_the_lossy_probe_and_damage_does_not(quantization):
  name = "tiny_gdn_gqa"
  model, cfg = verify.model(name), load_config(name)
  prompt = verify.prompts(name, 1, seed=5)[0]
  _, state = api.prefill(model, np.asarray(prompt, np.int32))
  probe = logit_probe.make_probe(model, state, prompt[-1])
  store = MemoryStore()
  encode_state(state, store, model_id=cfg.name, config_fingerprint=cfg.fingerprint(),
               options=CodecOptions(quantization=quantization))
  received = decode_state(store, like=abstract_state(cfg, 1, state.capacity))
  assert logit_probe.check_state(model, received, probe, lossy=True).ok
  damaged = sensitivity.damage(received, cfg.layer_kinds)
  assert not logit_probe.check_state(model, damaged, probe, lossy=True).ok
