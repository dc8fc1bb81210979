"""Kimi Linear import: config translation and weight layout.

The family registry, and the notes on parity conventions shared by all
families, are in ``hf_families``.
"""

from __future__ import annotations

import numpy as np

from paas_jax.checkpoints.hf_layout import (Family, HFImportError, TensorSpec, check_activation,
                                            conv1d, copy, embedding_and_head, expert_specs, linear,
                                            mlp_specs, one_output, pick_prefix, require,
                                            sigmoid_router_specs)
from paas_jax.models import (GatedDeltaConfig, MLAConfig, ModelConfig, MoEConfig)
from paas_jax.models.config import LayerKind


class KimiLinear(Family):
  """Kimi Linear: KDA + MLA (NoPE), sigmoid-routed MoE with shared experts.

  Conventions (transformers ``modeling_kimi_linear``):
  * MLA applies no rotary embedding at all (the "rope" channels are plain);
    its q/kv latent norms use the RMSNorm default eps 1e-6, not ``rms_norm_eps``;
  * KDA: per-channel log-decay ``-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)``,
    output gate ``g_b(g_a(x))`` through a ``head_dim`` bottleneck, sigmoid-gated
    output norm;
  * router: sigmoid scores, ``e_score_correction_bias`` for the choice only,
    group-limited top-k, normalised, times ``routed_scaling_factor``;
  * the first ``first_k_dense_replace`` layers (or ``mlp_layer_types``) are dense.
  """

  model_type = "kimi_linear"
  architecture = "KimiLinearForCausalLM"
  LAYER_TYPES = {"linear_attention": LayerKind.GATED_DELTA, "full_attention": LayerKind.MLA}
  MIXER_SPECS = {LayerKind.GATED_DELTA: "_kda_specs", LayerKind.MLA: "_mla_specs"}

  # transformers' KimiLinearConfig.attribute_map: either spelling may appear.
  ALIASES = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
             "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group",
             "n_shared_experts": "num_shared_experts",
             "max_position_embeddings": "model_max_length"}

  def _get(self, hf, key, default=None):
    if key in hf:
      return hf[key]
    return hf.get(self.ALIASES.get(key, key), default)

  def model_config(self, hf, *, name, dtype, max_seq_len):
    n_layers = require(hf, "num_hidden_layers", "layer count")
    linear_cfg = hf.get("linear_attn_config") or {}
    head_dim = linear_cfg.get("head_dim", hf.get("linear_head_dim", 128))
    n_heads = linear_cfg.get("num_heads", hf.get("linear_num_heads", 32))
    conv_kernel = linear_cfg.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))
    layer_types = hf.get("layer_types")
    if layer_types is None:
      if "full_attn_layers" in linear_cfg and "kda_layers" in linear_cfg:
        layer_types = [None] * n_layers
        for layer in linear_cfg["full_attn_layers"]:  # 1-based in the checkpoint config
          layer_types[layer - 1] = "full_attention"
        for layer in linear_cfg["kda_layers"]:
          layer_types[layer - 1] = "linear_attention"
      else:
        layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                       for i in range(n_layers)]
    if any(t not in self.LAYER_TYPES for t in layer_types):
      raise HFImportError(f"Kimi Linear layer_types must be linear_attention or "
                          f"full_attention, got {layer_types}")
    mlp_types = hf.get("mlp_layer_types") or [
        "dense" if i < hf.get("first_k_dense_replace", 1) else "sparse"
        for i in range(n_layers)]
    check_activation(hf, "hidden_act", "silu", "silu")
    ffn = tuple("e" if t == "sparse" else "d" for t in mlp_types)
    moe = None
    if "e" in ffn:
      moe = MoEConfig(
          n_experts=self._get(hf, "num_local_experts", 256),
          top_k=self._get(hf, "num_experts_per_tok", 8),
          d_expert=hf.get("moe_intermediate_size", 1024),
          n_shared_experts=self._get(hf, "n_shared_experts", 1),
          router="sigmoid", normalize_top_k=self._get(hf, "norm_topk_prob", True),
          score_correction_bias=True, n_groups=self._get(hf, "n_group", 1),
          top_k_groups=hf.get("topk_group", 1),
          routed_scale=float(hf.get("routed_scaling_factor", 2.446)), router_in_fp32=True)
    return ModelConfig(
        name=name, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=n_layers, layer_pattern=self.layer_pattern(layer_types),
        d_ff=hf.get("intermediate_size", 9216),
        mla=MLAConfig(
            n_heads=hf["num_attention_heads"], kv_lora_rank=hf.get("kv_lora_rank", 512),
            qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
            v_head_dim=hf.get("v_head_dim") or 128, q_lora_rank=hf.get("q_lora_rank") or 0,
            use_rope=False, bias=hf.get("attention_bias", False), latent_norm_eps=1e-6),
        gated_delta=GatedDeltaConfig(
            n_k_heads=n_heads, n_v_heads=n_heads, head_k_dim=head_dim, head_v_dim=head_dim,
            gate="kda", conv_kernel=conv_kernel, output_gate_rank=head_dim),
        moe=moe, ffn_pattern=ffn, norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=False, dtype=dtype, param_dtype=dtype,
        max_seq_len=max_seq_len or self._get(hf, "max_position_embeddings", 1_048_576))

  def _kda_specs(self, hf, config, src, p, m):
    del hf
    g, sa, specs = config.gated_delta, f"{p}.self_attn", []
    # The Hub layout keeps the forget gate's tensors on the attention
    # module and three separate q/k/v convolutions.
    gate = pick_prefix(src, (f"{sa}.", f"{sa}.forget_gate."), "f_a_proj.weight")
    for ours, theirs in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                         ("b_proj", "b_proj"), ("z_a", "g_a_proj"), ("z_b", "g_b_proj"),
                         ("o_proj", "o_proj")):
      specs.append(linear(m + (ours,), f"{sa}.{theirs}.weight"))
    specs += [linear(m + ("f_a",), f"{gate}f_a_proj.weight"),
              linear(m + ("f_b",), f"{gate}f_b_proj.weight"),
              copy(m + ("A_log",), f"{gate}A_log", shape=(g.n_v_heads,)),
              copy(m + ("dt_bias",), f"{gate}dt_bias"),
              copy(m + ("o_norm", "scale"), f"{sa}.o_norm.weight")]
    if f"{sa}.q_conv1d.weight" in src or f"{sa}.conv1d.weight" not in src:
      specs.append(TensorSpec(
          (m + ("conv", "weight"),),
          tuple(f"{sa}.{x}_conv1d.weight" for x in "qkv"),
          one_output(lambda *ws: np.concatenate([w[:, 0, :] for w in ws], axis=0).T)))
    else:
      specs.append(conv1d(m + ("conv",), f"{sa}.conv1d.weight"))
    return specs

  def _mla_specs(self, hf, config, src, p, m):
    del hf, src
    mla, sa, specs = config.mla, f"{p}.self_attn", []
    if mla.q_lora_rank:
      specs += [linear(m + ("q_a",), f"{sa}.q_a_proj.weight"),
                copy(m + ("q_a_norm", "scale"), f"{sa}.q_a_layernorm.weight"),
                linear(m + ("q_b",), f"{sa}.q_b_proj.weight")]
      if mla.bias:
        specs.append(copy(m + ("q_a", "bias"), f"{sa}.q_a_proj.bias"))
    else:
      specs.append(linear(m + ("q_b",), f"{sa}.q_proj.weight"))
    specs += [linear(m + ("kv_a",), f"{sa}.kv_a_proj_with_mqa.weight"),
              copy(m + ("kv_a_norm", "scale"), f"{sa}.kv_a_layernorm.weight"),
              linear(m + ("kv_b",), f"{sa}.kv_b_proj.weight"),
              linear(m + ("o_proj",), f"{sa}.o_proj.weight")]
    if mla.bias:
      specs += [copy(m + ("kv_a", "bias"), f"{sa}.kv_a_proj_with_mqa.bias"),
                copy(m + ("o_proj", "bias"), f"{sa}.o_proj.bias")]
    return specs

  def tensor_specs(self, hf, config, src):
    specs = embedding_and_head("model.", "embed_tokens", "norm", hf, src)
    for i, (kind, ffn_kind) in enumerate(zip(config.layer_kinds, config.ffn_kinds)):
      p, t = f"model.layers.{i}", ("blocks", i)
      specs += [copy(t + ("mixer_norm", "scale"), f"{p}.input_layernorm.weight"),
                copy(t + ("ffn_norm", "scale"), f"{p}.post_attention_layernorm.weight")]
      specs += self.mixer_specs(kind, hf, config, src, p, t + ("mixer",))
      f = t + ("ffn",)
      # The Hub layout names every layer's feed-forward block ``block_sparse_moe``.
      if ffn_kind == "d":
        mp = pick_prefix(src, (f"{p}.mlp", f"{p}.block_sparse_moe"), ".gate_proj.weight")
        specs += mlp_specs(f, mp, "swiglu")
      else:
        mp = pick_prefix(src, (f"{p}.block_sparse_moe", f"{p}.mlp"), ".gate.weight")
        specs += sigmoid_router_specs(f, mp)
        specs += expert_specs(f, mp, config.moe.n_experts, "swiglu", src, ("w1", "w3", "w2"))
        if config.moe.shared_width:
          specs += mlp_specs(f + ("shared",), f"{mp}.shared_experts", "swiglu")
    return specs
