"""Bearer tokens at the broker's public API.

Clients send ``authorization: Bearer <token>`` (``channel_credentials(...,
token=...)`` does it on every call). The server interceptor answers:

* UNAUTHENTICATED: no ``authorization`` header, more than one, or one that is
  not ``Bearer <b64token>`` (RFC 6750 syntax);
* PERMISSION_DENIED: a well-formed token that is not in the token set.

Tokens are never stored or compared in the clear: the set keeps SHA-256
digests and every check compares the presented token's digest with every
stored digest with ``hmac.compare_digest`` (constant time, and the same
number of comparisons whichever token matches), so the answer time says
nothing about how close a guess was.

Token files hold one token per line, optionally named (``alice:<token>``);
``#`` starts a comment. ``$PAAS_JAX_API_TOKENS`` holds the same entries
separated by commas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import pathlib
import re
import secrets
from typing import Iterable, Sequence

import grpc

from paas_jax.security import interceptors
from paas_jax.security.tls import SecurityConfigError

log = logging.getLogger("paas_jax.security")

TOKENS_ENV = "PAAS_JAX_API_TOKENS"
AUTH_HEADER = "authorization"
# RFC 6750 b64token, bounded (gRPC caps all headers at 8 KiB anyway).
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]{16,1024}=*")
_BEARER = re.compile(r"(?i:bearer) +(\S+)")


def generate_token(nbytes: int = 32) -> str:
  """A fresh random token (URL-safe base64, inside the b64token alphabet)."""
  return secrets.token_urlsafe(nbytes)


def write_token_files(out: str | os.PathLike, name: str = "client") -> str:
  """Writes a fresh token to ``client.token`` and appends it to ``api_tokens.txt``."""
  out = pathlib.Path(out)
  token = generate_token()
  for path, line, mode in ((out / "api_tokens.txt", f"{name}:{token}\n", "a"),
                           (out / f"{name}.token", f"{token}\n", "w")):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC),
                 0o600)
    with os.fdopen(fd, mode) as f:
      f.write(line)
  return token


def _digest(token: str) -> bytes:
  return hashlib.sha256(token.encode("utf-8")).digest()


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The outcome of one token check; ``code`` is None when allowed."""

  code: grpc.StatusCode | None
  reason: str
  principal: str = ""

  @property
  def ok(self) -> bool:
    return self.code is None


class TokenSet:
  """Accepted tokens (their digests) and the names they stand for."""

  def __init__(self, entries: Iterable[tuple[str, str]] = ()):
    self._entries: list[tuple[bytes, str]] = []
    for name, token in entries:
      self.add(token, name)

  def add(self, token: str, name: str = "") -> None:
    if not _B64TOKEN.fullmatch(token):
      raise SecurityConfigError("a token must be 16-1024 characters of "
                                "[A-Za-z0-9-._~+/] (optionally '='-padded)")
    self._entries.append((_digest(token), name or f"token{len(self._entries)}"))

  def __len__(self) -> int:
    return len(self._entries)

  @staticmethod
  def _parse(items: Iterable[str], where: str) -> list[tuple[str, str]]:
    out = []
    for lineno, raw in enumerate(items, 1):
      line = raw.split("#", 1)[0].strip()
      if not line:
        continue
      name, sep, token = line.rpartition(":")
      if not sep:
        name, token = "", line
      if not _B64TOKEN.fullmatch(token):
        raise SecurityConfigError(f"{where}, entry {lineno}: not a valid token")
      out.append((name.strip(), token))
    return out

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> "TokenSet":
    try:
      text = pathlib.Path(path).read_text()
    except OSError as e:
      raise SecurityConfigError(f"cannot read token file {path}: {e.strerror or e}") from None
    tokens = cls(cls._parse(text.splitlines(), str(path)))
    if not tokens:
      raise SecurityConfigError(f"token file {path} holds no tokens")
    return tokens

  @classmethod
  def from_env(cls, var: str = TOKENS_ENV) -> "TokenSet":
    value = os.environ.get(var, "")
    tokens = cls(cls._parse(value.split(","), f"${var}"))
    if not tokens:
      raise SecurityConfigError(f"${var} holds no tokens")
    return tokens

  @classmethod
  def load(cls, path: str | os.PathLike | None = None, var: str = TOKENS_ENV) -> "TokenSet":
    """From ``path`` if given, else from ``$var``."""
    return cls.from_file(path) if path else cls.from_env(var)

  def check_header(self, values: Sequence[str]) -> Verdict:
    """Judges the ``authorization`` header values of one call."""
    if not values:
      return Verdict(grpc.StatusCode.UNAUTHENTICATED, "missing")
    if len(values) > 1:
      return Verdict(grpc.StatusCode.UNAUTHENTICATED, "malformed")
    m = _BEARER.fullmatch(values[0].strip())
    if m is None or not _B64TOKEN.fullmatch(m.group(1)):
      return Verdict(grpc.StatusCode.UNAUTHENTICATED, "malformed")
    presented = _digest(m.group(1))
    principal = ""
    for digest, name in self._entries:  # no early exit: constant work per check
      if hmac.compare_digest(presented, digest):
        principal = name
    if not principal:
      return Verdict(grpc.StatusCode.PERMISSION_DENIED, "wrong")
    return Verdict(None, "ok", principal)


_MESSAGES = {
    "missing": "missing credentials: send 'authorization: Bearer <token>'",
    "malformed": "malformed authorization header: expected 'Bearer <token>'",
    "wrong": "the bearer token is not valid for this service",
}


class BearerTokenInterceptor(grpc.ServerInterceptor):
  """Refuses calls without a valid bearer token.

  Args:
    tokens: accepted tokens.
    exempt: method-name prefixes served without a token (default: the
      health service, for load balancers and the broker's own probes).
    on_result: optional ``f(method, verdict)`` for metrics / audit logs.
  """

  def __init__(self, tokens: TokenSet, *,
               exempt: Sequence[str] = (interceptors.HEALTH_PREFIX,),
               on_result=None):
    if not len(tokens):
      raise SecurityConfigError("BearerTokenInterceptor needs at least one token")
    self.tokens = tokens
    self.exempt = tuple(exempt)
    self._on_result = on_result

  def intercept_service(self, continuation, handler_call_details):
    method = handler_call_details.method
    if interceptors.matches(method, self.exempt):
      return continuation(handler_call_details)
    verdict = self.tokens.check_header(
        interceptors.metadata_values(handler_call_details, AUTH_HEADER))
    if self._on_result is not None:
      try:
        self._on_result(method, verdict)
      except Exception:  # pylint: disable=broad-except
        log.exception("auth on_result hook raised")
    if verdict.ok:
      return continuation(handler_call_details)
    log.warning("refused %s: %s token (%s)", method, verdict.reason, verdict.code.name)
    return interceptors.refuse(continuation(handler_call_details), verdict.code,
                               _MESSAGES[verdict.reason])


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
  """Per-call metadata carrying ``token`` (for callers that cannot use call
  credentials, e.g. tests on a plaintext channel)."""
  return ((AUTH_HEADER, f"Bearer {token}"),)


def read_token(path: str | os.PathLike | None = None, var: str = "PAAS_JAX_API_TOKEN"
               ) -> str | None:
  """A client's own token: the first entry of ``path``, else ``$var``, else None."""
  if path:
    entries = TokenSet._parse(pathlib.Path(path).read_text().splitlines(), str(path))
    if not entries:
      raise SecurityConfigError(f"token file {path} holds no token")
    return entries[0][1]
  value = os.environ.get(var, "").strip()
  return value or None
