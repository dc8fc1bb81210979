"""Hugging Face model families paas-jax imports: the registry (``FAMILIES``, ``family_for``).

Each family (``hf_qwen3_next``, ``hf_kimi_linear``, ``hf_nemotron_h``; shared
pieces in ``hf_layout``) turns a ``config.json`` into a ``ModelConfig`` and
lists, as ``TensorSpec``s, how every paas-jax parameter is built from
checkpoint tensors. The math the configs select was checked against the
transformers implementations (``transformers/models/{qwen3_next,kimi_linear,
nemotron_h}``); each family's class docstring records the conventions that
matter for exact parity.

Tensor names: transformers saves these models in their original (Hub)
layout, e.g. one tensor per expert; its in-memory layout fuses some of them
(``experts.gate_up_proj``, Kimi's ``conv1d``). Both are accepted.

Layer kinds: each family maps its Hub layer types to ``LayerKind`` members
(``LAYER_TYPES``) and its mixer tensors per kind (``MIXER_SPECS``, a table
keyed by ``LayerKind``; ``Family.mixer_specs`` looks it up). Hub tensor names
are a family's knowledge, so these tables live with it, not in the model's kind
registry (``paas_jax.models.kinds`` knows nothing of checkpoints); a kind a
family has no entry for is refused with ``HFImportError``.
"""

from __future__ import annotations

from paas_jax.checkpoints.hf_kimi_linear import KimiLinear
from paas_jax.checkpoints.hf_layout import Family, HFImportError
from paas_jax.checkpoints.hf_nemotron_h import NemotronH
from paas_jax.checkpoints.hf_qwen3_next import Qwen3Next


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
