"""Imports a Hugging Face model directory into a paas-jax Orbax checkpoint.

  python -m paas_jax.tools.import_hf --hf_dir=/models/Kimi-Linear-48B-A3B-Instruct \
      --out=/ckpt/kimi_linear

Supported: Kimi Linear, Qwen3-Next and Nemotron-H (see
``paas_jax.checkpoints.hf_families``). The checkpoint holds the parameters,
the model config and tokenizer.json; serve it with
``python -m paas_jax.generate --checkpoint=/ckpt/kimi_linear --prompt="..."``.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags

from paas_jax.checkpoints import import_hf, save_checkpoint
from paas_jax.checkpoints.orbax_io import checkpoint_nbytes

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "Hugging Face model directory (config.json, "
                    "*.safetensors, tokenizer.json).")
flags.DEFINE_string("out", None, "Checkpoint directory to write.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "Parameter and activation dtype (default: the checkpoint's).")
flags.DEFINE_integer("max_seq_len", None,
                     "Longest context to serve (default: max_position_embeddings).")
flags.DEFINE_string("name", None, "Model name (default: the directory name).")
flags.DEFINE_bool("overwrite", False, "Replace an existing --out directory.")


def main(argv):
  del argv
  if not FLAGS.hf_dir or not FLAGS.out:
    print("error: give --hf_dir and --out", file=sys.stderr)
    return 2
  t0 = time.perf_counter()
  try:
    imported = import_hf(FLAGS.hf_dir, name=FLAGS.name, dtype=FLAGS.dtype,
                         max_seq_len=FLAGS.max_seq_len)
    path = save_checkpoint(imported.model, FLAGS.out, imported.tokenizer_json,
                           metadata=imported.metadata, overwrite=FLAGS.overwrite,
                           text_files=imported.text_files)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  config = imported.model.config
  unused = imported.metadata["unused_tensors"]
  if unused:
    print(f"warning: {len(unused)} checkpoint tensor(s) not used by the model: "
          f"{', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}", file=sys.stderr)
  print(json.dumps({
      "checkpoint": str(path), "architecture": imported.metadata["source"]["architecture"],
      "layers": "".join(config.layer_kinds), "ffn": "".join(config.ffn_kinds),
      "params": imported.model.n_params, "bytes": checkpoint_nbytes(imported.model),
      "dtype": config.param_dtype, "tokenizer": imported.tokenizer is not None,
      "seconds": round(time.perf_counter() - t0, 2)}))
  return 0


if __name__ == "__main__":
  app.run(main)
