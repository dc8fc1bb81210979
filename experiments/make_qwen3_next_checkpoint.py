"""A small random Qwen3-Next Hugging Face checkpoint that both paas-jax and vLLM serve.

  .venv/bin/python experiments/make_qwen3_next_checkpoint.py --out=runs/qwen3_next_small

Config (stated, random weights from transformers' init): hidden 256, 4 layers
(Gated DeltaNet, Gated DeltaNet, Gated DeltaNet, full attention), 4 query / 2
KV heads of dim 64, linear attention 2 key / 4 value heads of dim 64, MoE with
8 experts (top 2, 128 wide) plus a 256-wide shared expert, vocabulary 2048,
context 4096, bf16 (vLLM's CPU Gated DeltaNet path requires bf16).

The tokenizer is a byte-level BPE trained on this repository's docs (2048 ids,
special tokens <|endoftext|> <|im_start|> <|im_end|>), with a ChatML template;
generation_config.json sets EOS = <|im_end|>, <|endoftext|>. config.json
carries the served name (``_name_or_path``) so both servers announce the same
model.
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags

flags.DEFINE_string("out", "runs/qwen3_next_small", "Output directory.")
flags.DEFINE_string("name", "paas-jax/qwen3-next-small", "Served model name.")
flags.DEFINE_integer("vocab", 2048, "Vocabulary size.")
flags.DEFINE_integer("seed", 0, "Weight seed.")
FLAGS = flags.FLAGS

REPO = pathlib.Path(__file__).resolve().parents[1]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(vocab: int):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  corpus = [p.read_text(errors="replace") for p in sorted(REPO.glob("**/*.md"))
            if ".venv" not in p.parts]
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(corpus, trainer)
  return tok


def main(argv):
  del argv
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # pylint: disable=g-import-not-at-top
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  tok = make_tokenizer(FLAGS.vocab)
  ids = {t: tok.token_to_id(t) for t in SPECIAL}
  torch.manual_seed(FLAGS.seed)
  cfg = Qwen3NextConfig(
      vocab_size=FLAGS.vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
      layer_types=["linear_attention"] * 3 + ["full_attention"],
      linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
      linear_num_key_heads=2, linear_num_value_heads=4,
      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
      shared_expert_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
      max_position_embeddings=4096, tie_word_embeddings=False,
      bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
      pad_token_id=ids["<|endoftext|>"], dtype="bfloat16")
  model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
  model.save_pretrained(out)
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
      "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
      "model_max_length": 4096, "add_bos_token": False}, indent=1))
  (out / "generation_config.json").write_text(json.dumps({
      "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
      "pad_token_id": ids["<|endoftext|>"]}, indent=1))
  hf = json.loads((out / "config.json").read_text())
  hf["_name_or_path"] = FLAGS.name
  (out / "config.json").write_text(json.dumps(hf, indent=1))
  n = sum(p.numel() for p in model.parameters())
  print(json.dumps({"out": str(out), "name": FLAGS.name, "params": n,
                    "special_ids": ids}))


if __name__ == "__main__":
  app.run(main)
