"""Text <-> token ids at the broker.

Random-init models have no tokenizer; when their vocabulary covers the 256
byte values the broker uses UTF-8 bytes as token ids, so ``--prompt="..."``
works with the tiny configs. A checkpoint's own tokenizer (``encode(text).ids``
/ ``decode(ids)``, as ``tokenizers.Tokenizer``) takes precedence.
"""

from __future__ import annotations

import codecs
from typing import Sequence


class ByteTokenizer:
  """UTF-8 bytes as token ids (needs ``vocab_size >= 256``)."""

  def __init__(self, vocab_size: int):
    if vocab_size < 256:
      raise ValueError(f"byte-level text needs a vocabulary of >= 256 ids, the model has "
                       f"{vocab_size}; send prompt_ids instead")
    self.vocab_size = vocab_size

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decoder(self) -> "StreamDecoder":
    return StreamDecoder()


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

  def encode(self, text: str) -> list[int]:
    enc = self.tok.encode(text)
    return list(getattr(enc, "ids", enc))

  def decoder(self):
    tok = self.tok

    class _Dec:
      def __init__(self):
        self.ids: list[int] = []
        self.shown = ""

      def feed(self, ids):
        self.ids.extend(ids)
        text = tok.decode(self.ids)
        new, self.shown = text[len(self.shown):], text
        return new
    return _Dec()
