"""Qwen3-Next import: config translation and weight layout.

The family registry, and the notes on parity conventions shared by all
families, are in ``hf_families``.
"""

from __future__ import annotations

import numpy as np

from paas_jax.checkpoints.hf_layout import (Family, HFImportError, TensorSpec, check_activation,
                                            conv1d, copy, embedding_and_head, expert_specs, linear,
                                            mlp_specs, require)
from paas_jax.models import (AttentionConfig, GatedDeltaConfig, ModelConfig, MoEConfig)
from paas_jax.models.config import LayerKind


class Qwen3Next(Family):
  """Qwen3-Next: Gated DeltaNet + gated GQA, softmax-routed MoE with a gated shared expert.

  Conventions (transformers ``modeling_qwen3_next``):
  * every ``Qwen3NextRMSNorm`` (block, final, q/k norms) scales by ``1 + w``;
    the GDN output norm (``RMSNormGated``) uses a plain ``w`` and a SiLU gate;
  * ``q_proj`` yields per head ``[query, gate]`` (our output-gate layout);
  * partial RoPE rotates the first ``head_dim * partial_rotary_factor``
    channels with ``rotate_half`` (our half-split ``apply_rope``);
  * ``in_proj_qkvz`` is grouped per key head: ``[q(dk), k(dk), v(g*dv), z(g*dv)]``
    with ``g = n_v_heads / n_k_heads``; ``in_proj_ba`` likewise ``[b(g), a(g)]``;
  * layer ``i`` is MoE unless listed in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0``.
  """

  model_type = "qwen3_next"
  architecture = "Qwen3NextForCausalLM"
  ignored_prefixes = ("mtp.",)
  LAYER_TYPES = {"linear_attention": LayerKind.GATED_DELTA,
                 "full_attention": LayerKind.ATTENTION}
  MIXER_SPECS = {LayerKind.GATED_DELTA: "_gated_delta_specs",
                 LayerKind.ATTENTION: "_attention_specs"}

  def model_config(self, hf, *, name, dtype, max_seq_len):
    n_layers = require(hf, "num_hidden_layers", "layer count")
    layer_types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else
        "full_attention" for i in range(n_layers)]
    for t in layer_types:
      if t not in self.LAYER_TYPES:
        raise HFImportError(f"unsupported Qwen3-Next layer type {t!r}")
    check_activation(hf, "hidden_act", "silu", "silu")
    rope = dict(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type") or (hf.get("rope_scaling") or {}).get(
        "rope_type", (hf.get("rope_scaling") or {}).get("type", "default"))
    if rope_type != "default":
      raise HFImportError(f"unsupported rope_type {rope_type!r} (paas-jax implements "
                          "plain RoPE only)")
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    rope_fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    n_experts = hf.get("num_experts", 0)
    sparse_step = hf.get("decoder_sparse_step", 1)
    mlp_only = set(hf.get("mlp_only_layers") or [])
    ffn = tuple("e" if n_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0
                else "d" for i in range(n_layers))
    moe = None
    if "e" in ffn:
      shared = require(hf, "shared_expert_intermediate_size", "shared expert width")
      moe = MoEConfig(n_experts=n_experts, top_k=hf["num_experts_per_tok"],
                      d_expert=hf["moe_intermediate_size"], n_shared_experts=1,
                      d_shared=shared, shared_gate=True, router="softmax",
                      normalize_top_k=hf.get("norm_topk_prob", True))
    return ModelConfig(
        name=name, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=n_layers, layer_pattern=self.layer_pattern(layer_types),
        d_ff=hf["intermediate_size"],
        attention=AttentionConfig(
            n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
            head_dim=hf.get("head_dim", 256), rope_theta=float(rope_theta),
            rope_fraction=float(rope_fraction), output_gate=True, qk_norm=True,
            bias=hf.get("attention_bias", False)),
        gated_delta=GatedDeltaConfig(
            n_k_heads=hf["linear_num_key_heads"], n_v_heads=hf["linear_num_value_heads"],
            head_k_dim=hf["linear_key_head_dim"], head_v_dim=hf["linear_value_head_dim"],
            gate="gdn", conv_kernel=hf.get("linear_conv_kernel_dim", 4)),
        moe=moe, ffn_pattern=ffn, norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_plus_one=True, tie_embeddings=False, dtype=dtype, param_dtype=dtype,
        max_seq_len=max_seq_len or hf.get("max_position_embeddings", 32768))

  def _gated_delta_specs(self, hf, config, src, p, m):
    del hf, src
    g = config.gated_delta
    group = g.n_v_heads // g.n_k_heads
    la = f"{p}.linear_attn"

    def split_qkvz(w):
      w = w.T.reshape(w.shape[1], g.n_k_heads, -1)
      cuts = np.cumsum([g.head_k_dim, g.head_k_dim, group * g.head_v_dim])
      return tuple(x.reshape(x.shape[0], -1) for x in np.split(w, cuts, axis=-1))

    def split_ba(w):
      w = w.T.reshape(w.shape[1], g.n_k_heads, -1)
      return tuple(x.reshape(x.shape[0], -1) for x in np.split(w, 2, axis=-1))

    return [
        TensorSpec(tuple(m + (n, "kernel") for n in ("q_proj", "k_proj", "v_proj",
                                                      "z_proj")),
                   (f"{la}.in_proj_qkvz.weight",), split_qkvz),
        TensorSpec((m + ("b_proj", "kernel"), m + ("a_proj", "kernel")),
                   (f"{la}.in_proj_ba.weight",), split_ba),
        conv1d(m + ("conv",), f"{la}.conv1d.weight"),
        copy(m + ("A_log",), f"{la}.A_log"),
        copy(m + ("dt_bias",), f"{la}.dt_bias"),
        copy(m + ("o_norm", "scale"), f"{la}.norm.weight"),
        linear(m + ("o_proj",), f"{la}.out_proj.weight")]

  def _attention_specs(self, hf, config, src, p, m):
    del hf, src
    sa, specs = f"{p}.self_attn", []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      specs.append(linear(m + (proj,), f"{sa}.{proj}.weight"))
      if config.attention.bias:
        specs.append(copy(m + (proj, "bias"), f"{sa}.{proj}.bias"))
    return specs + [copy(m + ("q_norm", "scale"), f"{sa}.q_norm.weight"),
                    copy(m + ("k_norm", "scale"), f"{sa}.k_norm.weight")]

  def tensor_specs(self, hf, config, src):
    specs = embedding_and_head("model.", "embed_tokens", "norm", hf, src)
    for i, (kind, ffn_kind) in enumerate(zip(config.layer_kinds, config.ffn_kinds)):
      p, t = f"model.layers.{i}", ("blocks", i)
      specs += [copy(t + ("mixer_norm", "scale"), f"{p}.input_layernorm.weight"),
                copy(t + ("ffn_norm", "scale"), f"{p}.post_attention_layernorm.weight")]
      specs += self.mixer_specs(kind, hf, config, src, p, t + ("mixer",))
      f, mp = t + ("ffn",), f"{p}.mlp"
      if ffn_kind == "d":
        specs += mlp_specs(f, mp, "swiglu")
      else:
        specs += [linear(f + ("router",), f"{mp}.gate.weight"),
                  linear(f + ("shared_gate",), f"{mp}.shared_expert_gate.weight")]
        specs += mlp_specs(f + ("shared",), f"{mp}.shared_expert", "swiglu")
        specs += expert_specs(f, mp, config.moe.n_experts, "swiglu", src,
                              ("gate_proj", "up_proj", "down_proj"))
    return specs
