"""Nemotron-H import: config translation and weight layout.

The family registry, and the notes on parity conventions shared by all
families, are in ``hf_families``.
"""

from __future__ import annotations

from paas_jax.checkpoints.hf_layout import (Family, HFImportError, check_activation, conv1d, copy,
                                            embedding_and_head, expert_specs, linear, mlp_specs,
                                            pick_prefix, sigmoid_router_specs)
from paas_jax.models import (AttentionConfig, Mamba2Config, ModelConfig, MoEConfig)
from paas_jax.models.config import LayerKind


class NemotronH(Family):
  """Nemotron-H: Mamba2 + attention + MLP/MoE blocks, each block one operation.

  Conventions (transformers ``modeling_nemotron_h``):
  * a Hugging Face block is ``x + op(norm(x))`` with a single op; paas-jax
    fuses each mixer block (Mamba2 ``M`` / attention ``*``) with an immediately
    following feed-forward block (MLP ``-`` / MoE ``E``) into one layer, which
    computes the same thing; a mixer followed by another mixer gets no FFN
    (``ffn_pattern`` ``-``). A feed-forward block with no mixer before it has
    no paas-jax counterpart and is refused;
  * attention has no positional encoding (NoPE) and no biases;
  * MLPs and experts are ``down(relu(up(x))**2)``;
  * Mamba2: conv bias, gate-then-grouped RMSNorm, D skip; the chunked scan
    clamps the time step to ``>= time_step_min``. (transformers' single-token
    decode path does not clamp; paas-jax clamps in both, so decode can differ
    from transformers' by that clamp when a time step falls below it.)
  * router: sigmoid + ``e_score_correction_bias``, group-limited, normalised,
    times ``routed_scaling_factor``; shared experts ungated.
  """

  model_type = "nemotron_h"
  architecture = "NemotronHForCausalLM"
  ignored_prefixes = ("mtp.",)

  # hybrid_override_pattern symbols (Nemotron's syntax, not layer_pattern letters).
  PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
  LAYER_TYPES = {"linear_attention": LayerKind.MAMBA2, "full_attention": LayerKind.ATTENTION}
  MIXER_SPECS = {LayerKind.MAMBA2: "_mamba2_specs", LayerKind.ATTENTION: "_attention_specs"}
  FFNS = {"mlp": "d", "moe": "e"}
  # Older config keys that transformers' NemotronHConfig still accepts.
  LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
            "mamba_dt_min": "time_step_min", "mamba_conv_bias": "use_conv_bias",
            "mamba_chunk_size": "chunk_size"}

  def _normalized(self, hf: dict) -> dict:
    hf = dict(hf)
    for old, new in self.LEGACY.items():
      if old in hf:
        hf[new] = hf.pop(old)
    return hf

  def block_types(self, hf: dict) -> list[str]:
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None and hf.get("hybrid_override_pattern"):
      pattern = hf["hybrid_override_pattern"]
      bad = sorted(set(pattern) - set(self.PATTERN))
      if bad:
        raise HFImportError(f"unsupported hybrid_override_pattern symbols {bad}")
      types = [self.PATTERN[c] for c in pattern]
    if not types:
      raise HFImportError("config.json has neither layers_block_type nor "
                          "hybrid_override_pattern")
    for t in types:
      if t not in self.LAYER_TYPES and t not in self.FFNS:
        raise HFImportError(f"unsupported Nemotron-H block type {t!r}")
    return list(types)

  def fused_layers(self, hf: dict) -> list[tuple[int, int | None]]:
    """(mixer block index, FFN block index or None) for each paas-jax layer."""
    layers: list[list] = []
    for j, t in enumerate(self.block_types(hf)):
      if t in self.LAYER_TYPES:
        layers.append([j, None])
      elif layers and layers[-1][1] is None:
        layers[-1][1] = j
      else:
        raise HFImportError(
            f"Nemotron-H block {j} ({t}) does not follow a mixer block; paas-jax "
            "layers are a mixer with an optional feed-forward network")
    return [tuple(x) for x in layers]

  def model_config(self, hf, *, name, dtype, max_seq_len):
    hf = self._normalized(hf)
    types = self.block_types(hf)
    layers = self.fused_layers(hf)
    check_activation(hf, "mlp_hidden_act", "relu2", "relu2")
    check_activation(hf, "mamba_hidden_act", "silu", "silu")
    if hf.get("mlp_bias"):
      raise HFImportError("unsupported mlp_bias=True (paas-jax MLPs have no biases)")
    if hf.get("moe_latent_size") is not None:
      raise HFImportError("unsupported moe_latent_size (latent MoE projections)")
    kinds = tuple(self.LAYER_TYPES[types[j]].value for j, _ in layers)
    ffn = tuple("-" if k is None else self.FFNS[types[k]] for _, k in layers)
    moe = None
    if "e" in ffn:
      moe = MoEConfig(
          n_experts=hf.get("n_routed_experts", 8), top_k=hf.get("num_experts_per_tok", 2),
          d_expert=hf.get("moe_intermediate_size", 7688), n_shared_experts=1,
          d_shared=hf.get("moe_shared_expert_intermediate_size", 7688), router="sigmoid",
          normalize_top_k=hf.get("norm_topk_prob", True), score_correction_bias=True,
          n_groups=hf.get("n_group", 1), top_k_groups=hf.get("topk_group", 1),
          routed_scale=float(hf.get("routed_scaling_factor", 1.0)), router_in_fp32=True)
    attention = mamba2 = None
    if LayerKind.ATTENTION.value in kinds:
      attention = AttentionConfig(
          n_heads=hf.get("num_attention_heads", 32),
          n_kv_heads=hf.get("num_key_value_heads") or hf.get("num_attention_heads", 32),
          head_dim=hf.get("head_dim") or hf.get("attention_head_dim") or 128,
          use_rope=False)
    if LayerKind.MAMBA2.value in kinds:
      mamba2 = Mamba2Config(
          n_heads=hf.get("mamba_num_heads", 128), head_dim=hf.get("mamba_head_dim", 64),
          d_state=hf.get("ssm_state_size", 128), n_groups=hf.get("n_groups", 8),
          conv_kernel=hf.get("conv_kernel", 4), chunk_size=hf.get("chunk_size", 128),
          conv_bias=hf.get("use_conv_bias", True), proj_bias=hf.get("use_bias", False),
          dt_min=float(hf.get("time_step_min", 0.001)))
    return ModelConfig(
        name=name, vocab_size=hf.get("vocab_size", 131072), d_model=hf["hidden_size"],
        n_layers=len(layers), layer_pattern=kinds, d_ff=hf.get("intermediate_size", 21504),
        attention=attention, mamba2=mamba2, moe=moe, ffn_pattern=ffn,
        ffn_activation="relu2", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=False, dtype=dtype, param_dtype=dtype,
        max_seq_len=max_seq_len or hf.get("max_position_embeddings", 4096))

  def _mamba2_specs(self, hf, config, src, p, m):
    del hf, src
    s, mx = config.mamba2, f"{p}.mixer"
    specs = [linear(m + ("in_proj",), f"{mx}.in_proj.weight"),
             conv1d(m + ("conv",), f"{mx}.conv1d.weight"),
             copy(m + ("A_log",), f"{mx}.A_log"), copy(m + ("D",), f"{mx}.D"),
             copy(m + ("dt_bias",), f"{mx}.dt_bias"),
             copy(m + ("norm_scale",), f"{mx}.norm.weight"),
             linear(m + ("out_proj",), f"{mx}.out_proj.weight")]
    if s.conv_bias:
      specs.append(copy(m + ("conv", "bias"), f"{mx}.conv1d.bias"))
    if s.proj_bias:
      specs += [copy(m + ("in_proj", "bias"), f"{mx}.in_proj.bias"),
                copy(m + ("out_proj", "bias"), f"{mx}.out_proj.bias")]
    return specs

  def _attention_specs(self, hf, config, src, p, m):
    del hf, config, src
    return [linear(m + (proj,), f"{p}.mixer.{proj}.weight")
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]

  def tensor_specs(self, hf, config, src):
    hf = self._normalized(hf)
    root = pick_prefix(src, ("backbone.", "model."), "embeddings.weight")
    specs = embedding_and_head(root, "embeddings", "norm_f", hf, src)
    types = self.block_types(hf)
    for i, (mixer_block, ffn_block) in enumerate(self.fused_layers(hf)):
      t, m = ("blocks", i), ("blocks", i, "mixer")
      p = f"{root}layers.{mixer_block}"
      specs.append(copy(t + ("mixer_norm", "scale"), f"{p}.norm.weight"))
      specs += self.mixer_specs(config.layer_kinds[i], hf, config, src, p, m)
      if ffn_block is None:
        continue
      q, f = f"{root}layers.{ffn_block}", t + ("ffn",)
      specs.append(copy(t + ("ffn_norm", "scale"), f"{q}.norm.weight"))
      if types[ffn_block] == "mlp":
        specs += mlp_specs(f, f"{q}.mixer", "relu2")
      else:
        specs += sigmoid_router_specs(f, f"{q}.mixer")
        specs += expert_specs(f, f"{q}.mixer", config.moe.n_experts, "relu2", src,
                              ("gate_proj", "up_proj", "down_proj"))
        specs += mlp_specs(f + ("shared",), f"{q}.mixer.shared_experts", "relu2")
    return specs
