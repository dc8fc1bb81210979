"""How Hugging Face checkpoint tensors become paas-jax parameters: the shared pieces.

``TensorSpec`` (targets, sources, build) and its builders (``linear``, ``copy``,
``conv1d``, MLP / expert / router specs), config helpers, and the ``Family``
base class the families (``hf_qwen3_next``, ``hf_kimi_linear``,
``hf_nemotron_h``; registry in ``hf_families``) implement.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from paas_jax.models import ModelConfig
from paas_jax.models.config import LayerKind

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


def one_output(fn: Callable[..., np.ndarray]) -> Callable[..., tuple[np.ndarray, ...]]:
  return lambda *xs: (fn(*xs),)


def linear(target: Path, name: str) -> TensorSpec:
  """torch ``nn.Linear`` weight [out, in] -> flax kernel [in, out]."""
  return TensorSpec((target + ("kernel",),), (name,), one_output(lambda w: w.T))


def copy(target: Path, name: str, shape: Sequence[int] | None = None) -> TensorSpec:
  """A tensor taken as is (optionally reshaped, e.g. Kimi's A_log [1, 1, H, 1])."""
  return TensorSpec((target,), (name,),
                    one_output(lambda w: w if shape is None else w.reshape(shape)))


def conv1d(target: Path, name: str) -> TensorSpec:
  """Depthwise ``nn.Conv1d`` weight [channels, 1, kernel] -> [kernel, channels]."""
  return TensorSpec((target + ("weight",),), (name,), one_output(lambda w: w[:, 0, :].T))


def require(hf: dict, key: str, what: str):
  if hf.get(key) is None:
    raise HFImportError(f"config.json has no {key!r} ({what})")
  return hf[key]


def check_activation(hf: dict, key: str, expected: str, default: str) -> None:
  got = hf.get(key, default)
  if got != expected:
    raise HFImportError(f"unsupported {key}={got!r}: paas-jax implements {expected!r} "
                        "for this architecture")


def pick_prefix(src, candidates: Sequence[str], probe: str) -> str:
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
  # Hub layer type -> the LayerKind it imports as.
  LAYER_TYPES: dict[str, LayerKind] = {}
  # LayerKind -> method name building that kind's mixer TensorSpecs:
  # ``(hf, config, src, layer_prefix, mixer_path) -> list[TensorSpec]``.
  MIXER_SPECS: dict[LayerKind, str] = {}

  def layer_pattern(self, layer_types: Sequence[str]) -> tuple[str, ...]:
    """``ModelConfig.layer_pattern`` letters of the Hub ``layer_types``."""
    return tuple(self.LAYER_TYPES[t].value for t in layer_types)

  def mixer_specs(self, kind: str, hf: dict, config: ModelConfig, src, layer_prefix: str,
                  mixer: Path) -> list[TensorSpec]:
    """The mixer tensors of one layer of ``kind`` (a ``layer_pattern`` letter)."""
    name = self.MIXER_SPECS.get(LayerKind(kind))
    if name is None:
      raise HFImportError(f"{self.model_type} has no weight layout for layer kind "
                          f"{LayerKind(kind).name} ({kind!r})")
    return getattr(self, name)(hf, config, src, layer_prefix, mixer)

  def model_config(self, hf: dict, *, name: str, dtype: str,
                   max_seq_len: int | None) -> ModelConfig:
    raise NotImplementedError

  def tensor_specs(self, hf: dict, config: ModelConfig, src) -> list[TensorSpec]:
    raise NotImplementedError


def embedding_and_head(config_prefix: str, embed: str, final_norm: str, hf: dict,
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
