"""Hugging Face model families paas-jax imports: config translation and weight layout.

Each family turns a ``config.json`` into a ``ModelConfig`` and lists, as
``TensorSpec``s, how every paas-jax parameter is built from checkpoint tensors.
The math the configs select was checked against the transformers
implementations (``transformers/models/{qwen3_next,kimi_linear,nemotron_h}``);
the notes below record the conventions that matter for exact parity.

Tensor names: transformers saves these models in their original (Hub)
layout, e.g. one tensor per expert; its in-memory layout fuses some of them
(``experts.gate_up_proj``, Kimi's ``conv1d``). Both are accepted.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from paas_jax.models import (AttentionConfig, GatedDeltaConfig, Mamba2Config, MLAConfig,
                             ModelConfig, MoEConfig)

Path = tuple  # a parameter's path in the model's pure parameter dict


class HFImportError(ValueError):
  """A model directory that paas-jax cannot import (the message says why)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """Builds the parameters at ``targets`` from the checkpoint tensors ``sources``.

  ``build(*arrays)`` receives the source arrays in order and returns one
  array per target, already in paas-jax layout (e.g. ``[in, out]`` kernels).
  """

  targets: tuple[Path, ...]
  sources: tuple[str, ...]
  build: Callable[..., tuple[np.ndarray, ...]]


def _one(fn: Callable[..., np.ndarray]) -> Callable[..., tuple[np.ndarray, ...]]:
  return lambda *xs: (fn(*xs),)


def linear(target: Path, name: str) -> TensorSpec:
  """torch ``nn.Linear`` weight [out, in] -> flax kernel [in, out]."""
  return TensorSpec((target + ("kernel",),), (name,), _one(lambda w: w.T))


def copy(target: Path, name: str, shape: Sequence[int] | None = None) -> TensorSpec:
  """A tensor taken as is (optionally reshaped, e.g. Kimi's A_log [1, 1, H, 1])."""
  return TensorSpec((target,), (name,),
                    _one(lambda w: w if shape is None else w.reshape(shape)))


def conv1d(target: Path, name: str) -> TensorSpec:
  """Depthwise ``nn.Conv1d`` weight [channels, 1, kernel] -> [kernel, channels]."""
  return TensorSpec((target + ("weight",),), (name,), _one(lambda w: w[:, 0, :].T))


def _require(hf: dict, key: str, what: str):
  if hf.get(key) is None:
    raise HFImportError(f"config.json has no {key!r} ({what})")
  return hf[key]


def _check_activation(hf: dict, key: str, expected: str, default: str) -> None:
  got = hf.get(key, default)
  if got != expected:
    raise HFImportError(f"unsupported {key}={got!r}: paas-jax implements {expected!r} "
                        "for this architecture")


def _pick_prefix(src, candidates: Sequence[str], probe: str) -> str:
  """The first prefix ``p`` of ``candidates`` with tensor ``p + probe`` (else the first)."""
  for prefix in candidates:
    if prefix + probe in src:
      return prefix
  return candidates[0]


# -- feed-forward pieces shared by the families ---------------------------------------

def mlp_specs(target: Path, prefix: str, activation: str,
              names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
              ) -> list[TensorSpec]:
  """A dense MLP (``activation`` swiglu or relu2; relu2 has no gate projection)."""
  gate, up, down = names
  specs = [linear(target + ("up",), f"{prefix}.{up}.weight"),
           linear(target + ("down",), f"{prefix}.{down}.weight")]
  if activation == "swiglu":
    specs.append(linear(target + ("gate",), f"{prefix}.{gate}.weight"))
  return specs


def expert_specs(target: Path, prefix: str, n_experts: int, activation: str, src,
                 per_expert: tuple[str, str, str]) -> list[TensorSpec]:
  """Routed experts as stacked ``w_gate``/``w_up`` [E, d, f] and ``w_down`` [E, f, d].

  ``per_expert`` names the gate, up and down weights of ``experts.<e>`` in the
  Hub layout; the fused transformers layout (``experts.gate_up_proj``
  [E, 2f, d] or ``experts.up_proj`` [E, f, d], ``experts.down_proj`` [E, d, f])
  is used when the per-expert tensors are absent.
  """
  gate, up, down = per_expert
  swiglu = activation == "swiglu"
  roles = (gate, up, down) if swiglu else (up, down)
  names = [[f"{prefix}.experts.{e}.{r}.weight" for e in range(n_experts)] for r in roles]
  targets = tuple(target + (w,) for w in (("w_gate", "w_up", "w_down") if swiglu
                                          else ("w_up", "w_down")))

  def stack_per_expert(*ws):
    groups = [ws[i * n_experts:(i + 1) * n_experts] for i in range(len(roles))]
    return tuple(np.stack([w.T for w in g]) for g in groups)

  fused_in = f"{prefix}.experts.{'gate_up_proj' if swiglu else 'up_proj'}"
  fused_down = f"{prefix}.experts.down_proj"
  if names[0][0] not in src and fused_in in src:
    def split_fused(w_in, w_down):
      w_in = np.swapaxes(w_in, 1, 2)      # [E, d, f] or [E, d, 2f]
      w_down = np.swapaxes(w_down, 1, 2)  # [E, f, d]
      if swiglu:
        f = w_in.shape[-1] // 2
        return w_in[..., :f], w_in[..., f:], w_down
      return w_in, w_down
    return [TensorSpec(targets, (fused_in, fused_down), split_fused)]
  return [TensorSpec(targets, tuple(n for group in names for n in group), stack_per_expert)]


def sigmoid_router_specs(target: Path, prefix: str) -> list[TensorSpec]:
  """DeepSeek-V3 style router: weight [E, d] and ``e_score_correction_bias`` [E]."""
  return [linear(target + ("router",), f"{prefix}.gate.weight"),
          copy(target + ("score_bias",), f"{prefix}.gate.e_score_correction_bias")]


def model_dtype(hf: dict, override: str | None) -> str:
  """Parameter dtype: ``override``, else the checkpoint's (``dtype`` / ``torch_dtype``)."""
  if override:
    return override
  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  if dtype not in ("float32", "bfloat16", "float16"):
    raise HFImportError(f"unsupported checkpoint dtype {dtype!r}")
  return dtype


# -- families -------------------------------------------------------------------------

class Family:
  """One supported architecture."""

  model_type: str = ""
  architecture: str = ""
  # Checkpoint tensors that are not part of the served model (e.g. multi-token
  # prediction heads); they are skipped without a warning.
  ignored_prefixes: tuple[str, ...] = ()

  def model_config(self, hf: dict, *, name: str, dtype: str,
                   max_seq_len: int | None) -> ModelConfig:
    raise NotImplementedError

  def tensor_specs(self, hf: dict, config: ModelConfig, src) -> list[TensorSpec]:
    raise NotImplementedError


def _embedding_and_head(config_prefix: str, embed: str, final_norm: str, hf: dict,
                        src) -> list[TensorSpec]:
  """Embedding, final norm and output head; a tied head becomes an untied copy
  (paas-jax's tied head carries a scale that Hugging Face models do not have)."""
  specs = [copy(("embed", "embedding"), f"{config_prefix}{embed}.weight"),
           copy(("final_norm", "scale"), f"{config_prefix}{final_norm}.weight")]
  if "lm_head.weight" in src or not hf.get("tie_word_embeddings", False):
    specs.append(linear(("lm_head",), "lm_head.weight"))
  else:
    specs.append(linear(("lm_head",), f"{config_prefix}{embed}.weight"))
  return specs


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

  def model_config(self, hf, *, name, dtype, max_seq_len):
    n_layers = _require(hf, "num_hidden_layers", "layer count")
    layer_types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else
        "full_attention" for i in range(n_layers)]
    kinds = {"linear_attention": "G", "full_attention": "A"}
    for t in layer_types:
      if t not in kinds:
        raise HFImportError(f"unsupported Qwen3-Next layer type {t!r}")
    _check_activation(hf, "hidden_act", "silu", "silu")
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
      shared = _require(hf, "shared_expert_intermediate_size", "shared expert width")
      moe = MoEConfig(n_experts=n_experts, top_k=hf["num_experts_per_tok"],
                      d_expert=hf["moe_intermediate_size"], n_shared_experts=1,
                      d_shared=shared, shared_gate=True, router="softmax",
                      normalize_top_k=hf.get("norm_topk_prob", True))
    return ModelConfig(
        name=name, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=n_layers, layer_pattern=tuple(kinds[t] for t in layer_types),
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

  def tensor_specs(self, hf, config, src):
    specs = _embedding_and_head("model.", "embed_tokens", "norm", hf, src)
    g, a = config.gated_delta, config.attention
    group = g.n_v_heads // g.n_k_heads
    for i, (kind, ffn_kind) in enumerate(zip(config.layer_kinds, config.ffn_kinds)):
      p, t = f"model.layers.{i}", ("blocks", i)
      specs += [copy(t + ("mixer_norm", "scale"), f"{p}.input_layernorm.weight"),
                copy(t + ("ffn_norm", "scale"), f"{p}.post_attention_layernorm.weight")]
      m = t + ("mixer",)
      if kind == "G":
        la = f"{p}.linear_attn"

        def split_qkvz(w, g=g, group=group):
          w = w.T.reshape(w.shape[1], g.n_k_heads, -1)
          cuts = np.cumsum([g.head_k_dim, g.head_k_dim, group * g.head_v_dim])
          return tuple(x.reshape(x.shape[0], -1) for x in np.split(w, cuts, axis=-1))

        def split_ba(w, g=g):
          w = w.T.reshape(w.shape[1], g.n_k_heads, -1)
          return tuple(x.reshape(x.shape[0], -1) for x in np.split(w, 2, axis=-1))

        specs += [
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
      else:
        sa = f"{p}.self_attn"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
          specs.append(linear(m + (proj,), f"{sa}.{proj}.weight"))
          if a.bias:
            specs.append(copy(m + (proj, "bias"), f"{sa}.{proj}.bias"))
        specs += [copy(m + ("q_norm", "scale"), f"{sa}.q_norm.weight"),
                  copy(m + ("k_norm", "scale"), f"{sa}.k_norm.weight")]
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
    n_layers = _require(hf, "num_hidden_layers", "layer count")
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
    kinds = {"linear_attention": "G", "full_attention": "M"}
    if any(t not in kinds for t in layer_types):
      raise HFImportError(f"Kimi Linear layer_types must be linear_attention or "
                          f"full_attention, got {layer_types}")
    mlp_types = hf.get("mlp_layer_types") or [
        "dense" if i < hf.get("first_k_dense_replace", 1) else "sparse"
        for i in range(n_layers)]
    _check_activation(hf, "hidden_act", "silu", "silu")
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
        n_layers=n_layers, layer_pattern=tuple(kinds[t] for t in layer_types),
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

  def tensor_specs(self, hf, config, src):
    specs = _embedding_and_head("model.", "embed_tokens", "norm", hf, src)
    g, mla = config.gated_delta, config.mla
    for i, (kind, ffn_kind) in enumerate(zip(config.layer_kinds, config.ffn_kinds)):
      p, t = f"model.layers.{i}", ("blocks", i)
      sa, m = f"{p}.self_attn", t + ("mixer",)
      specs += [copy(t + ("mixer_norm", "scale"), f"{p}.input_layernorm.weight"),
                copy(t + ("ffn_norm", "scale"), f"{p}.post_attention_layernorm.weight")]
      if kind == "G":
        # The Hub layout keeps the forget gate's tensors on the attention
        # module and three separate q/k/v convolutions.
        gate = _pick_prefix(src, (f"{sa}.", f"{sa}.forget_gate."), "f_a_proj.weight")
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
              _one(lambda *ws: np.concatenate([w[:, 0, :] for w in ws], axis=0).T)))
        else:
          specs.append(conv1d(m + ("conv",), f"{sa}.conv1d.weight"))
      else:
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
      f = t + ("ffn",)
      # The Hub layout names every layer's feed-forward block ``block_sparse_moe``.
      if ffn_kind == "d":
        mp = _pick_prefix(src, (f"{p}.mlp", f"{p}.block_sparse_moe"), ".gate_proj.weight")
        specs += mlp_specs(f, mp, "swiglu")
      else:
        mp = _pick_prefix(src, (f"{p}.block_sparse_moe", f"{p}.mlp"), ".gate.weight")
        specs += sigmoid_router_specs(f, mp)
        specs += expert_specs(f, mp, config.moe.n_experts, "swiglu", src, ("w1", "w3", "w2"))
        if config.moe.shared_width:
          specs += mlp_specs(f + ("shared",), f"{mp}.shared_experts", "swiglu")
    return specs


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

  PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
  MIXERS = {"linear_attention": "m", "full_attention": "A"}
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
      if t not in self.MIXERS and t not in self.FFNS:
        raise HFImportError(f"unsupported Nemotron-H block type {t!r}")
    return list(types)

  def fused_layers(self, hf: dict) -> list[tuple[int, int | None]]:
    """(mixer block index, FFN block index or None) for each paas-jax layer."""
    layers: list[list] = []
    for j, t in enumerate(self.block_types(hf)):
      if t in self.MIXERS:
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
    _check_activation(hf, "mlp_hidden_act", "relu2", "relu2")
    _check_activation(hf, "mamba_hidden_act", "silu", "silu")
    if hf.get("mlp_bias"):
      raise HFImportError("unsupported mlp_bias=True (paas-jax MLPs have no biases)")
    if hf.get("moe_latent_size") is not None:
      raise HFImportError("unsupported moe_latent_size (latent MoE projections)")
    kinds = tuple(self.MIXERS[types[j]] for j, _ in layers)
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
    if "A" in kinds:
      attention = AttentionConfig(
          n_heads=hf.get("num_attention_heads", 32),
          n_kv_heads=hf.get("num_key_value_heads") or hf.get("num_attention_heads", 32),
          head_dim=hf.get("head_dim") or hf.get("attention_head_dim") or 128,
          use_rope=False)
    if "m" in kinds:
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

  def tensor_specs(self, hf, config, src):
    hf = self._normalized(hf)
    root = _pick_prefix(src, ("backbone.", "model."), "embeddings.weight")
    specs = _embedding_and_head(root, "embeddings", "norm_f", hf, src)
    types = self.block_types(hf)
    s = config.mamba2
    for i, (mixer_block, ffn_block) in enumerate(self.fused_layers(hf)):
      t, m = ("blocks", i), ("blocks", i, "mixer")
      p = f"{root}layers.{mixer_block}"
      specs.append(copy(t + ("mixer_norm", "scale"), f"{p}.norm.weight"))
      if types[mixer_block] == "linear_attention":
        mx = f"{p}.mixer"
        specs += [linear(m + ("in_proj",), f"{mx}.in_proj.weight"),
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
      else:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
          specs.append(linear(m + (proj,), f"{p}.mixer.{proj}.weight"))
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


FAMILIES: dict[str, Family] = {f.model_type: f for f in (KimiLinear(), Qwen3Next(), NemotronH())}


def family_for(hf: dict) -> Family:
  """The family of a ``config.json``, or an error naming the unsupported architecture."""
  model_type = hf.get("model_type")
  architectures = hf.get("architectures") or []
  family = FAMILIES.get(model_type)
  if family is None:
    by_arch = {f.architecture: f for f in FAMILIES.values()}
    family = next((by_arch[a] for a in architectures if a in by_arch), None)
  if family is None:
    supported = ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES.values())
    raise HFImportError(f"unsupported architecture: model_type={model_type!r}, "
                        f"architectures={architectures}; paas-jax imports {supported}")
  return family
