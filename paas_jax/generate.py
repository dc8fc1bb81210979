"""Single-process generation: prefill, in-process state handoff, decode.

  python -m paas_jax.generate --config=tiny_gdn_gqa --prompt_ids=1,2,3 \
      --max_new_tokens=16 --json
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from paas_jax.checkpoints import load_checkpoint
from paas_jax.models import api, load_config
from paas_jax.serving.tokenizer_files import QWEN_BUNDLED_VOCAB_SIZE, bundled_qwen_vocabulary

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config name or path to a config .py file.")
flags.DEFINE_string("checkpoint", None, "Orbax checkpoint directory (overrides --config).")
flags.DEFINE_list("prompt_ids", None, "Comma-separated prompt token ids.")
flags.DEFINE_string("prompt", None, "Prompt text (needs a checkpoint with a tokenizer).")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate (> 0).")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_integer("top_k", 0, "0 = no top-k filter.")
flags.DEFINE_float("top_p", 1.0, "1 = no nucleus filter.")
flags.DEFINE_integer("seed", 0, "Sampling and (random-init) parameter seed.")
flags.DEFINE_list("stop_tokens", [], "Token ids that end generation.")
flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")


def _load(argv_checkpoint: str | None, config_name: str, seed: int):
  """Returns (Model, tokenizer or None): a checkpoint's own tokenizer; random init of a
  config whose vocabulary covers Qwen's gets Qwen's bundled one."""
  if argv_checkpoint:
    return load_checkpoint(argv_checkpoint)
  model = api.Model.create(load_config(config_name), seed=seed)
  tokenizer = (bundled_qwen_vocabulary() if model.config.vocab_size >= QWEN_BUNDLED_VOCAB_SIZE
               else None)
  return model, tokenizer


def main(argv):
  del argv
  try:
    model, tokenizer = _load(FLAGS.checkpoint, FLAGS.config, FLAGS.seed)
    if FLAGS.prompt_ids:
      prompt = [int(t) for t in FLAGS.prompt_ids]
    elif FLAGS.prompt is not None:
      if tokenizer is None:
        raise ValueError("--prompt needs a --checkpoint that carries a tokenizer (or a "
                         "config whose vocabulary covers Qwen's); use --prompt_ids")
      prompt = tokenizer.encode(FLAGS.prompt).ids
    else:
      raise ValueError("give --prompt_ids or --prompt")
    if not prompt:
      raise ValueError("the prompt is empty")
    sampling = api.SamplingParams(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    result = api.generate(model, prompt, FLAGS.max_new_tokens, sampling=sampling,
                          seed=FLAGS.seed, stop_tokens=[int(t) for t in FLAGS.stop_tokens])
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out = {"tokens": result.tokens, "prefill_s": round(result.prefill_s, 6),
         "decode_tokens_per_s": round(result.decode_tokens_per_s, 3),
         "stop_reason": result.stop_reason, "prompt_ids": prompt}
  if tokenizer is not None:
    out["text"] = tokenizer.decode(result.tokens)
  if FLAGS.json:
    print(json.dumps(out))
  else:
    print(f"prompt ids : {prompt}")
    print(f"new tokens : {result.tokens}")
    if "text" in out:
      print(f"text       : {out['text']}")
    print(f"prefill    : {result.prefill_s * 1e3:.1f} ms (includes compilation on first use)")
    print(f"decode     : {result.decode_tokens_per_s:.1f} tokens/s")
  return 0


if __name__ == "__main__":
  app.run(main)
