"""Frozen model configuration for hybrid-attention language models.

A model is a stack of ``n_layers`` blocks. Each block has a token mixer chosen by
one character of the layer pattern, followed by a feed-forward network:

  ``A``  full causal attention (GQA/MQA, RoPE, optional output gate and QK-norm)
  ``M``  multi-head latent attention (DeepSeek/Kimi MLA); caches the KV latent only
  ``S``  sliding-window attention; caches a ring buffer of ``window`` positions
  ``G``  gated delta rule linear attention (Gated DeltaNet or KDA gate)
  ``m``  Mamba2 (SSD) mixer

The pattern may be given in full or as a repeating unit such as ``"GGGA"``.
An optional ``ffn_pattern`` picks each block's feed-forward network the same
way: ``d`` dense MLP, ``e`` mixture of experts, ``-`` none (a mixer-only block,
as in Nemotron-H where a Mamba2 or attention block may stand alone).

Options added for checkpoint parity (norm conventions, biases, NoPE attention,
router details...) default to the original behaviour; ``fingerprint()`` leaves
them out while they hold their defaults, so existing fingerprints are unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from typing import ClassVar, Literal

# ml_dtypes registers bfloat16 & co. with numpy, so dtype names resolve without JAX:
# the broker and the front door read configs and must not load JAX.
import ml_dtypes  # noqa: F401  pylint: disable=unused-import
import numpy as np



class LayerKind(str, enum.Enum):
  """The layer kinds; the values are the letters of ``layer_pattern`` (user syntax).

  What a kind is (parameters, cache, prefill and paged decode, prefix-cache rule)
  is its module under ``paas_jax/models/kinds/``; adding a kind is a member here
  (letter and the sub-config it reads) plus that module and its registry line.
  """

  ATTENTION = "A"
  MLA = "M"
  SLIDING = "S"
  GATED_DELTA = "G"
  MAMBA2 = "m"

  @property
  def config_field(self) -> str:
    """The ``ModelConfig`` sub-config this kind's layers read."""
    return _CONFIG_FIELD[self]


_CONFIG_FIELD = {LayerKind.ATTENTION: "attention", LayerKind.MLA: "mla",
                 LayerKind.SLIDING: "attention", LayerKind.GATED_DELTA: "gated_delta",
                 LayerKind.MAMBA2: "mamba2"}
LAYER_KINDS = tuple(k.value for k in LayerKind)
FFN_KINDS = ("d", "e", "-")  # dense MLP, mixture of experts, none
FFN_ACTIVATIONS = ("swiglu", "relu2")


def _fail(field: str, message: str) -> None:
  raise ValueError(f"{field}: {message}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Softmax attention (``A`` and ``S`` layers).

  Attributes:
    n_heads: query heads.
    n_kv_heads: key/value heads; must divide ``n_heads`` (1 = MQA).
    head_dim: per-head width; ``None`` means ``d_model // n_heads``.
    rope_theta: RoPE base.
    rope_fraction: fraction of ``head_dim`` that is rotated (partial RoPE).
    output_gate: Qwen3-Next style sigmoid gate on the attention output.
    qk_norm: RMS-normalise queries and keys per head before RoPE.
    window: sliding window (positions) used by ``S`` layers.
    use_rope: rotate queries and keys; False gives position-free (NoPE)
      attention, as in Nemotron-H, where the Mamba2 layers carry position.
    bias: biases on the q/k/v/o projections.
  """

  _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("use_rope", "bias")

  n_heads: int
  n_kv_heads: int
  head_dim: int | None = None
  rope_theta: float = 10_000.0
  rope_fraction: float = 1.0
  output_gate: bool = False
  qk_norm: bool = False
  window: int = 0
  use_rope: bool = True
  bias: bool = False


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention (``M`` layers).

  The cache holds only ``kv_lora_rank`` latent channels plus the decoupled
  ``qk_rope_head_dim`` RoPE key per token, shared by all heads.

  ``use_rope=False`` leaves that shared key (and the matching query channels)
  unrotated: Kimi Linear's MLA is NoPE, the KDA layers carry position.
  ``bias`` adds biases to the q_a, kv_a and output projections (DeepSeek's
  ``attention_bias``). ``latent_norm_eps`` is the epsilon of the q/kv latent
  RMSNorms when it differs from the model's (``None``: ``norm_eps``).
  """

  _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("use_rope", "bias", "latent_norm_eps")

  n_heads: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  q_lora_rank: int = 0  # 0: queries come from a plain projection.
  rope_theta: float = 10_000.0
  use_rope: bool = True
  bias: bool = False
  latent_norm_eps: float | None = None


@dataclasses.dataclass(frozen=True)
class GatedDeltaConfig:
  """Gated delta rule linear attention (``G`` layers).

  ``gate="gdn"`` is Gated DeltaNet (one log-decay per head, Qwen3-Next);
  ``gate="kda"`` is Kimi Delta Attention (one log-decay per key channel).
  ``n_v_heads`` may exceed ``n_k_heads``; queries and keys are then shared
  by groups of value heads.

  ``output_gate_rank > 0`` computes the output gate through a rank-r
  bottleneck (KDA's ``g_a``/``g_b``) instead of one full projection.
  """

  _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("output_gate_rank",)

  n_k_heads: int
  n_v_heads: int
  head_k_dim: int
  head_v_dim: int
  gate: Literal["gdn", "kda"] = "gdn"
  conv_kernel: int = 4
  chunk_size: int = 64
  output_gate_rank: int = 0


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
  """Mamba2 SSD mixer (``m`` layers).

  ``conv_bias`` / ``proj_bias``: biases on the short convolution and on the
  in/out projections. ``dt_min`` / ``dt_max`` clamp the softplus-ed time step
  (Mamba2's ``dt_limit``; ``dt_max=None``: no upper limit).
  """

  _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("conv_bias", "proj_bias", "dt_min", "dt_max")

  n_heads: int
  head_dim: int
  d_state: int
  n_groups: int = 1
  conv_kernel: int = 4
  chunk_size: int = 64
  conv_bias: bool = False
  proj_bias: bool = False
  dt_min: float = 0.0
  dt_max: float | None = None


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Top-k mixture of experts replacing the dense MLP.

  Routing: ``router`` turns logits into scores (softmax or sigmoid). With
  ``score_correction_bias`` a learned per-expert bias is added to the scores
  for choosing experts only (DeepSeek-V3's balancing bias); the weights stay
  the unbiased scores. ``n_groups > 1`` first keeps the ``top_k_groups``
  groups of experts whose two best scores sum highest. The chosen weights are
  optionally normalised, then multiplied by ``routed_scale``.

  Shared experts: ``d_shared`` is their hidden width (0: ``d_expert *
  n_shared_experts``); ``shared_gate`` scales their output by a per-token
  sigmoid gate (Qwen3-Next).

  ``router_in_fp32`` keeps the router weight in f32 and computes its logits in
  f32 whatever the model dtype (Kimi Linear and Nemotron-H do; with bf16
  logits near-ties flip expert choices).
  """

  _ADDED_FIELDS: ClassVar[tuple[str, ...]] = (
      "score_correction_bias", "n_groups", "top_k_groups", "routed_scale", "d_shared",
      "shared_gate", "router_in_fp32")

  n_experts: int
  top_k: int
  d_expert: int
  n_shared_experts: int = 0
  router: Literal["softmax", "sigmoid"] = "softmax"
  normalize_top_k: bool = True
  score_correction_bias: bool = False
  n_groups: int = 1
  top_k_groups: int = 1
  routed_scale: float = 1.0
  d_shared: int = 0
  shared_gate: bool = False
  router_in_fp32: bool = False

  @property
  def shared_width(self) -> int:
    """Hidden width of the shared experts (0: none)."""
    if not self.n_shared_experts:
      return 0
    return self.d_shared or self.d_expert * self.n_shared_experts


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A hybrid-attention decoder-only language model.

  Attributes:
    name: registry name (also the model id written into state manifests).
    vocab_size: token vocabulary.
    d_model: residual width.
    n_layers: number of blocks.
    layer_pattern: per-layer mixer kinds, full length or a repeating unit.
    d_ff: hidden width of the dense MLP.
    attention / mla / gated_delta / mamba2: per-kind settings; required
      exactly when the pattern uses that kind.
    moe: if set, every block uses a mixture of experts instead of the MLP
      (unless ``ffn_pattern`` says otherwise).
    ffn_pattern: per-layer feed-forward kinds (``FFN_KINDS``), full length or
      a repeating unit; ``None``: ``e`` everywhere with ``moe``, else ``d``.
    ffn_activation: ``swiglu`` (``down(silu(gate(x)) * up(x))``) or ``relu2``
      (``down(relu(up(x))**2)``, Nemotron-H); used by the dense MLP, the
      experts and the shared experts.
    norm_plus_one: RMSNorm scales are stored as offsets from one, the
      effective scale being ``1 + w`` (Qwen3-Next); the gated output norms of
      the recurrent mixers keep plain scales, as in those models.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: share the input embedding with the output head.
    dtype: activation and KV-cache dtype; recurrent states are always f32.
    param_dtype: parameter storage dtype.
    max_seq_len: the longest context a request may use.
  """

  name: str
  vocab_size: int
  d_model: int
  n_layers: int
  layer_pattern: str | tuple[str, ...]
  d_ff: int
  attention: AttentionConfig | None = None
  mla: MLAConfig | None = None
  gated_delta: GatedDeltaConfig | None = None
  mamba2: Mamba2Config | None = None
  moe: MoEConfig | None = None
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"
  max_seq_len: int = 4096
  ffn_pattern: str | tuple[str, ...] | None = None
  ffn_activation: Literal["swiglu", "relu2"] = "swiglu"
  norm_plus_one: bool = False

  _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("ffn_pattern", "ffn_activation",
                                              "norm_plus_one")

  def __post_init__(self):
    self._validate()

  # -- derived ---------------------------------------------------------------

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    """The mixer kind of every layer, ``len == n_layers``."""
    unit = tuple(self.layer_pattern)
    if len(unit) == self.n_layers:
      return unit
    return tuple(unit[i % len(unit)] for i in range(self.n_layers))

  @property
  def ffn_kinds(self) -> tuple[str, ...]:
    """The feed-forward kind of every layer (``FFN_KINDS``), ``len == n_layers``."""
    if self.ffn_pattern is None:
      return ("e" if self.moe is not None else "d",) * self.n_layers
    unit = tuple(self.ffn_pattern)
    return tuple(unit[i % len(unit)] for i in range(self.n_layers))

  @property
  def attention_head_dim(self) -> int:
    assert self.attention is not None
    return self.attention.head_dim or self.d_model // self.attention.n_heads

  @property
  def compute_dtype(self) -> np.dtype:
    return np.dtype(self.dtype)

  @property
  def weight_dtype(self) -> np.dtype:
    return np.dtype(self.param_dtype)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "ModelConfig":
    d = dict(d)
    sub = {"attention": AttentionConfig, "mla": MLAConfig,
           "gated_delta": GatedDeltaConfig, "mamba2": Mamba2Config,
           "moe": MoEConfig}
    for key, typ in sub.items():
      if d.get(key) is not None:
        d[key] = typ(**d[key])
    for key in ("layer_pattern", "ffn_pattern"):
      if isinstance(d.get(key), list):
        d[key] = tuple(d[key])
    return cls(**d)

  def fingerprint(self) -> str:
    """A hash of everything that changes the math or the state layout.

    Two processes may exchange decode states only if their fingerprints match;
    the name is excluded so that renaming a config does not break transfers.
    Computed once per config object (it is frozen): servers pass it with
    every transfer.
    """
    cached = self.__dict__.get("_fingerprint")
    if cached is not None:
      return cached
    d = _without_default_additions(self)
    d.pop("name")
    d["layer_pattern"] = "".join(self.layer_kinds)
    if self.ffn_pattern is not None:
      d["ffn_pattern"] = "".join(self.ffn_kinds)
    blob = json.dumps(d, sort_keys=True).encode()
    fingerprint = hashlib.sha256(blob).hexdigest()[:16]
    object.__setattr__(self, "_fingerprint", fingerprint)
    return fingerprint

  def with_updates(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  # -- validation ------------------------------------------------------------

  def _validate(self) -> None:
    for field in ("vocab_size", "d_model", "n_layers", "d_ff", "max_seq_len"):
      if getattr(self, field) <= 0:
        _fail(f"ModelConfig.{field}", f"must be > 0, got {getattr(self, field)}")
    if not self.layer_pattern:
      _fail("ModelConfig.layer_pattern", "must not be empty")
    for kind in self.layer_pattern:
      if kind not in LAYER_KINDS:
        _fail("ModelConfig.layer_pattern",
              f"unknown layer kind {kind!r}; expected one of {LAYER_KINDS}")
    if len(self.layer_pattern) > self.n_layers:
      _fail("ModelConfig.layer_pattern",
            f"has {len(self.layer_pattern)} entries but n_layers={self.n_layers}")
    if self.n_layers % len(self.layer_pattern):
      _fail("ModelConfig.layer_pattern",
            f"repeating unit of length {len(self.layer_pattern)} does not tile "
            f"n_layers={self.n_layers}")
    if self.ffn_pattern is not None:
      if not self.ffn_pattern:
        _fail("ModelConfig.ffn_pattern", "must not be empty (use None for the default)")
      for kind in self.ffn_pattern:
        if kind not in FFN_KINDS:
          _fail("ModelConfig.ffn_pattern",
                f"unknown feed-forward kind {kind!r}; expected one of {FFN_KINDS}")
      if len(self.ffn_pattern) > self.n_layers or self.n_layers % len(self.ffn_pattern):
        _fail("ModelConfig.ffn_pattern",
              f"{len(self.ffn_pattern)} entries neither match nor tile n_layers={self.n_layers}")
      if "e" in self.ffn_pattern and self.moe is None:
        _fail("ModelConfig.moe", "required by feed-forward kind 'e' in ffn_pattern")
    if self.ffn_activation not in FFN_ACTIVATIONS:
      _fail("ModelConfig.ffn_activation",
            f"must be one of {FFN_ACTIVATIONS}, got {self.ffn_activation!r}")
    for dt_field in ("dtype", "param_dtype"):
      try:
        np.dtype(getattr(self, dt_field))
      except TypeError:
        _fail(f"ModelConfig.{dt_field}", f"unknown dtype {getattr(self, dt_field)!r}")

    kinds = set(self.layer_kinds)
    needs: dict[str, set[str]] = {}
    for kind in LayerKind:
      needs.setdefault(kind.config_field, set())
      if kind.value in kinds:
        needs[kind.config_field].add(kind.value)
    for field, used_by in needs.items():
      if used_by and getattr(self, field) is None:
        _fail(f"ModelConfig.{field}",
              f"required by layer kind(s) {sorted(used_by)} in layer_pattern")

    if self.attention is not None:
      a = self.attention
      if a.n_heads <= 0 or a.n_kv_heads <= 0:
        _fail("AttentionConfig.n_heads", "n_heads and n_kv_heads must be > 0")
      if a.n_heads % a.n_kv_heads:
        _fail("AttentionConfig.n_kv_heads",
              f"n_kv_heads={a.n_kv_heads} must divide n_heads={a.n_heads}")
      if a.head_dim is None and self.d_model % a.n_heads:
        _fail("AttentionConfig.n_heads",
              f"n_heads={a.n_heads} does not divide d_model={self.d_model} "
              "(set head_dim explicitly)")
      head_dim = a.head_dim or self.d_model // a.n_heads
      rot = int(head_dim * a.rope_fraction)
      if a.use_rope and (not 0.0 < a.rope_fraction <= 1.0 or rot % 2):
        _fail("AttentionConfig.rope_fraction",
              f"{a.rope_fraction} must give an even rotary width in (0, head_dim]")
      if "S" in kinds and a.window <= 0:
        _fail("AttentionConfig.window", f"must be > 0 for 'S' layers, got {a.window}")
    if self.mla is not None:
      m = self.mla
      for f in ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim"):
        if getattr(m, f) <= 0:
          _fail(f"MLAConfig.{f}", f"must be > 0, got {getattr(m, f)}")
      if m.qk_rope_head_dim % 2:
        _fail("MLAConfig.qk_rope_head_dim", "must be even")
      if m.latent_norm_eps is not None and m.latent_norm_eps <= 0:
        _fail("MLAConfig.latent_norm_eps", f"must be > 0, got {m.latent_norm_eps}")
    if self.gated_delta is not None:
      g = self.gated_delta
      if g.gate not in ("gdn", "kda"):
        _fail("GatedDeltaConfig.gate", f"must be 'gdn' or 'kda', got {g.gate!r}")
      if g.n_k_heads <= 0 or g.n_v_heads % g.n_k_heads:
        _fail("GatedDeltaConfig.n_v_heads",
              f"n_k_heads={g.n_k_heads} must divide n_v_heads={g.n_v_heads}")
      if g.conv_kernel < 1:
        _fail("GatedDeltaConfig.conv_kernel", "must be >= 1")
      if g.chunk_size <= 0:
        _fail("GatedDeltaConfig.chunk_size", "must be > 0")
      if g.output_gate_rank < 0:
        _fail("GatedDeltaConfig.output_gate_rank", f"must be >= 0, got {g.output_gate_rank}")
    if self.mamba2 is not None:
      s = self.mamba2
      if s.n_groups <= 0 or s.n_heads % s.n_groups:
        _fail("Mamba2Config.n_groups",
              f"n_groups={s.n_groups} must divide n_heads={s.n_heads}")
      if s.conv_kernel < 1:
        _fail("Mamba2Config.conv_kernel", "must be >= 1")
      if s.chunk_size <= 0:
        _fail("Mamba2Config.chunk_size", "must be > 0")
      if s.dt_min < 0 or (s.dt_max is not None and s.dt_max < s.dt_min):
        _fail("Mamba2Config.dt_min", f"need 0 <= dt_min <= dt_max, got {s.dt_min}, {s.dt_max}")
    if self.moe is not None:
      e = self.moe
      if not 0 < e.top_k <= e.n_experts:
        _fail("MoEConfig.top_k", f"must be in [1, n_experts={e.n_experts}], got {e.top_k}")
      if e.n_groups <= 0 or e.n_experts % e.n_groups:
        _fail("MoEConfig.n_groups",
              f"n_groups={e.n_groups} must divide n_experts={e.n_experts}")
      if not 0 < e.top_k_groups <= e.n_groups:
        _fail("MoEConfig.top_k_groups",
              f"must be in [1, n_groups={e.n_groups}], got {e.top_k_groups}")
      if e.top_k > e.top_k_groups * (e.n_experts // e.n_groups):
        _fail("MoEConfig.top_k", f"top_k={e.top_k} exceeds the experts of the "
              f"{e.top_k_groups} kept group(s)")
      if e.d_shared < 0:
        _fail("MoEConfig.d_shared", f"must be >= 0, got {e.d_shared}")


def _without_default_additions(config) -> dict:
  """``dataclasses.asdict`` minus fields added after the first release that
  still hold their defaults (recursively), so that adding an option does not
  change the fingerprint of configs that do not use it."""
  out = {}
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if f.name in getattr(config, "_ADDED_FIELDS", ()) and value == f.default:
      continue
    out[f.name] = (_without_default_additions(value) if dataclasses.is_dataclass(value)
                   else value)
  return out
