"""Tiny random Hugging Face models of the three imported families, for parity tests.

transformers and torch are test-only dependencies: this module is imported by
the checkpoint tests alone.

Weights are redrawn after transformers' initialisation (std 0.02 would leave
every logit near zero and every routing decision a coin toss): projections get
unit-gain fan-in scaling, norm scales a +-0.1 jitter around their init, MoE
balancing biases +-0.1. Decay parameters (``A_log``, ``dt_bias``, ``D``) keep
transformers' initial ranges, which are the ones trained models start from;
Mamba2 time steps are kept away from the ``time_step_min`` clamp, which
transformers applies in its chunked prefill but not in its decode step.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB = 64
WORDS = ("the model reads a long prompt in one region and decodes in another region "
         "while the state moves over the network with linear attention layers keeping "
         "it small kimi qwen nemotron mamba delta rule gate experts route tokens to "
         "few of many").split()


def make_tokenizer() -> Tokenizer:
  """A word-level tokenizer whose vocabulary is exactly ``VOCAB`` ids."""
  vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
  for w in WORDS:
    vocab.setdefault(w, len(vocab))
  for i in range(len(vocab), VOCAB):
    vocab[f"w{i}"] = i
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
  return tok


PROMPTS = ("the model reads a long prompt",
           "kimi qwen nemotron mamba delta rule gate experts route tokens to few",
           "state moves over the network")


def qwen3_next():
  from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
  cfg = Qwen3NextConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
      layer_types=["linear_attention", "full_attention", "linear_attention",
                   "full_attention"],
      linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
      linear_num_key_heads=2, linear_num_value_heads=4,  # 2 value heads per key head
      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
      shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1],
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                       "partial_rotary_factor": 0.5},
      bos_token_id=1, eos_token_id=2, pad_token_id=0)
  return Qwen3NextForCausalLM(cfg)


def kimi_linear():
  from transformers import KimiLinearConfig, KimiLinearForCausalLM
  cfg = KimiLinearConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
      layer_types=["linear_attention", "full_attention", "linear_attention",
                   "full_attention"],
      mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
      kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
      v_head_dim=8, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
      n_group=2, topk_group=1, routed_scaling_factor=2.446,
      linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
      pad_token_id=0, bos_token_id=1, eos_token_id=2)
  return KimiLinearForCausalLM(cfg)


def nemotron_h():
  from transformers import NemotronHConfig, NemotronHForCausalLM
  cfg = NemotronHConfig(
      vocab_size=VOCAB, hidden_size=32,
      # Mamba2, MLP, attention, MoE, Mamba2, Mamba2: pairs fuse, the fifth stands alone.
      layers_block_type=["linear_attention", "mlp", "full_attention", "moe",
                         "linear_attention", "linear_attention"],
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
      ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, conv_kernel=4,
      chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
      moe_shared_expert_intermediate_size=24, routed_scaling_factor=1.5,
      pad_token_id=0, bos_token_id=1, eos_token_id=2)
  return NemotronHForCausalLM(cfg)


BUILDERS = {"kimi_linear": kimi_linear, "qwen3_next": qwen3_next, "nemotron_h": nemotron_h}
FAMILIES = tuple(BUILDERS)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
  """Redraws the weights (see module docstring)."""
  gen = torch.Generator().manual_seed(seed)

  def randn(shape):
    return torch.randn(shape, generator=gen)

  for name, p in model.named_parameters():
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("A_log", "D"):
      continue
    if leaf == "dt_bias":
      if "mixer" in name:  # Mamba2: softplus(dt_bias) in [0.01, 0.1]
        dt = torch.exp(torch.rand(p.shape, generator=gen) * math.log(10.0) + math.log(0.01))
        p.copy_(dt + torch.log(-torch.expm1(-dt)))
      continue
    if p.ndim == 1:
      p.add_(0.1 * randn(p.shape))
    else:
      p.copy_(randn(p.shape) * p.shape[-1] ** -0.5)
  for name, b in model.named_buffers():
    if name.endswith("e_score_correction_bias"):
      b.copy_(0.1 * randn(b.shape))


def save_family(family: str, directory: pathlib.Path, seed: int = 0):
  """Builds, randomises and saves a tiny model plus tokenizer.json; returns the model."""
  torch.manual_seed(seed)
  model = BUILDERS[family]().eval()
  randomize(model, seed)
  model.save_pretrained(directory)
  make_tokenizer().save(str(directory / "tokenizer.json"))
  return model


def relative_error(ours, ref) -> float:
  """Max abs difference over the logit scale (max |logit|, at least 1)."""
  ref = np.asarray(ref, np.float64)
  return float(np.abs(np.asarray(ours, np.float64) - ref).max() / max(1.0, np.abs(ref).max()))
