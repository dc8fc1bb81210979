"""Logit error of bf16 serving against f32, on the same weights.

  .venv/bin/python experiments/bf16_logit_error.py --config=tiny_gdn_gqa
  .venv/bin/python experiments/bf16_logit_error.py --checkpoint=runs/qwen3_next_tiny

The bf16 model is ``serving.common.with_dtype(f32_model, "bfloat16")`` (what
``--dtype=bfloat16`` serves: weights, activations and KV cache in bf16,
recurrent states f32). Reports, over a prefill of ``--prompt_len`` random
tokens and ``--decode_steps`` greedy decode steps (both models fed the f32
model's tokens): max |diff| / max |logit|, mean |diff| / mean |logit|, top-1
agreement, and the state bytes per request of each dtype. Writes JSON.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from absl import app, flags

from paas_jax.models.logit_error import logit_error
from paas_jax.serving import common
from paas_jax.state import init_state, state_bytes

flags.DEFINE_string("config", "tiny_gdn_gqa", "Random-init config (ignored with --checkpoint).")
flags.DEFINE_string("checkpoint", None, "Checkpoint directory (HF or paas-jax).")
flags.DEFINE_integer("seed", 0, "Weight and prompt seed.")
flags.DEFINE_integer("prompt_len", 256, "Prompt tokens.")
flags.DEFINE_integer("decode_steps", 32, "Greedy decode steps compared.")
flags.DEFINE_string("json_out", "runs/bf16_logit_error.json", "Where to write the report.")
FLAGS = flags.FLAGS


def _layer_dtypes(model) -> dict:
  state = init_state(model.config, 1, 16)
  out: dict[str, set] = {}
  for kind, layer in zip(model.config.layer_kinds, state.layers):
    for leaf in jax.tree_util.tree_leaves(layer):
      out.setdefault(kind, set()).add(str(leaf.dtype))
  return {k: sorted(v) for k, v in out.items()}


def main(argv):
  del argv
  common.enable_compilation_cache(common.default_compilation_cache())
  f32, _ = common.load_model(FLAGS.config, FLAGS.seed, FLAGS.checkpoint, "float32")
  bf16 = common.with_dtype(f32, "bfloat16")
  rng = np.random.default_rng(FLAGS.seed)
  prompt = [int(t) for t in rng.integers(0, f32.config.vocab_size, FLAGS.prompt_len)]
  report = {"model": f32.config.name, "prompt_len": FLAGS.prompt_len,
            "decode_steps": FLAGS.decode_steps,
            **logit_error(f32, bf16, prompt, FLAGS.decode_steps),
            "state_dtypes_bf16": _layer_dtypes(bf16),
            "state_bytes_f32": state_bytes(f32.config, FLAGS.prompt_len).total,
            "state_bytes_bf16": state_bytes(bf16.config, FLAGS.prompt_len).total}
  out = pathlib.Path(FLAGS.json_out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2))
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
