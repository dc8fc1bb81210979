"""Imported models compute what transformers computes (issue 4).

Tiny random models of Kimi Linear (KDA + NoPE MLA, grouped sigmoid MoE with a
balancing bias), Qwen3-Next (Gated DeltaNet + gated GQA with partial RoPE,
softmax MoE with a gated shared expert, a dense layer) and Nemotron-H (Mamba2
+ NoPE GQA + relu² MLP / MoE, a lone mixer block) are saved by transformers,
imported, and compared in fp32: logits on a ragged batch of prompts, prefill
followed by 16 decode steps, and greedy generation. Chunked prefill of the
imported models is checked against one-shot prefill as well.
"""

import numpy as np
import pytest

from paas_jax.models import api
from tests.checkpoints.hf_tiny import FAMILIES, relative_error

TOL = 1e-4  # max abs logit difference relative to the logit scale (fp32)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_logits_match_transformers(tiny_models, family):
  tiny = tiny_models[family]
  prompts = tiny.prompts
  lengths = [len(p) for p in prompts]
  assert len(set(lengths)) == len(lengths)  # a ragged batch
  batch = np.zeros((len(prompts), max(lengths)), np.int32)
  for i, p in enumerate(prompts):
    batch[i, :len(p)] = p
  logits, _ = api.prefill(tiny.imported.model, batch, lengths=lengths)
  for i, p in enumerate(prompts):
    assert relative_error(logits[i, :len(p)], tiny.hf_logits(p)) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_16_decode_steps_match_transformers(tiny_models, family):
  import torch
  tiny = tiny_models[family]
  prompt = tiny.prompts[1]
  feed = np.random.RandomState(7).randint(0, tiny.imported.model.config.vocab_size, size=16)
  with torch.no_grad():
    out = tiny.hf(torch.tensor([prompt]), use_cache=True)
    cache, want = out.cache, [out.logits[0, -1].numpy()]
    for token in feed:
      out = tiny.hf(torch.tensor([[int(token)]]), cache=cache, use_cache=True)
      cache = out.cache
      want.append(out.logits[0, -1].numpy())
  logits, state = api.prefill(tiny.imported.model, prompt)
  got = [logits[0, -1]]
  for token in feed:
    step_logits, state = api.decode_step(tiny.imported.model, state, [int(token)])
    got.append(step_logits[0])
  errors = [relative_error(g, w) for g, w in zip(got, want)]
  assert max(errors) <= TOL, errors


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(tiny_models, family):
  tiny = tiny_models[family]
  prompt = tiny.prompts[1]
  n = 24
  assert api.generate(tiny.imported.model, prompt, n).tokens == tiny.hf_greedy(prompt, n)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_continues_exactly(tiny_models, family):
  """Prefill resumed from a state (what PrfaaS ships) matches the whole prompt."""
  tiny = tiny_models[family]
  tokens = np.concatenate(tiny.prompts)
  # Chunks of 9..16 tokens share the padded prefill shape of the other tests.
  state, pieces = None, []
  for chunk in np.array_split(tokens, 2):
    logits, state = api.prefill(tiny.imported.model, chunk, state)
    pieces.append(logits[0])
  assert relative_error(np.concatenate(pieces), tiny.hf_logits(tokens)) <= TOL


def test_import_maps_each_family_onto_the_right_options(tiny_models):
  kimi = tiny_models["kimi_linear"].imported.model.config
  assert kimi.layer_kinds == ("G", "M", "G", "M") and kimi.ffn_kinds == ("d", "e", "e", "e")
  assert kimi.gated_delta.gate == "kda" and kimi.gated_delta.output_gate_rank == 8
  assert not kimi.mla.use_rope and kimi.mla.latent_norm_eps == 1e-6
  assert (kimi.moe.router, kimi.moe.n_groups, kimi.moe.score_correction_bias) == (
      "sigmoid", 2, True)
  assert kimi.moe.routed_scale == pytest.approx(2.446)

  qwen = tiny_models["qwen3_next"].imported.model.config
  assert qwen.layer_kinds == ("G", "A", "G", "A") and qwen.ffn_kinds == ("e", "d", "e", "e")
  assert qwen.norm_plus_one and qwen.attention.output_gate and qwen.attention.qk_norm
  assert qwen.attention.rope_fraction == 0.5 and qwen.gated_delta.gate == "gdn"
  assert qwen.moe.shared_gate and qwen.moe.shared_width == 24 and qwen.moe.router == "softmax"

  nemo = tiny_models["nemotron_h"].imported.model.config
  # Six Hugging Face blocks M - * E M M fuse into four mixer(+FFN) layers.
  assert nemo.layer_kinds == ("m", "A", "m", "m") and nemo.ffn_kinds == ("d", "e", "-", "-")
  assert nemo.ffn_activation == "relu2" and not nemo.attention.use_rope
  assert nemo.mamba2.conv_bias and nemo.mamba2.dt_min == pytest.approx(0.001)
  for model in (kimi, qwen, nemo):
    assert not model.tie_embeddings and model.param_dtype == "float32"
