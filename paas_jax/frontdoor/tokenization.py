"""Text around the token stream: chat templates and stop strings.

Token ids are the broker's business (it encodes text prompts with the served
checkpoint's tokenizer and decodes the tokens it streams). The gateway only
turns chat messages into one prompt string and cuts the streamed text at stop
strings.

Chat: a checkpoint's own template (``chat_template`` of its
``tokenizer_config.json``, reported by the broker) is rendered with jinja2 in
a sandbox, as transformers' ``apply_chat_template`` does, with
``add_generation_prompt=True``. Without one, the documented plain template::

  <role>: <content>\\n        (one line block per message, in order)
  assistant:                 (the generation prompt)
"""

from __future__ import annotations

import json

import jinja2
from jinja2 import sandbox

PLAIN_TEMPLATE_NAME = "plain"


class TemplateError(ValueError):
  """The checkpoint's chat template failed on these messages (its own
  ``raise_exception``, or a template bug): a 400 for the caller."""


def _raise(message):
  raise TemplateError(message)


class ChatTemplate:
  """Renders messages to the prompt text.

  Args:
    template: the jinja source (None: the plain template).
    special: ``bos_token`` / ``eos_token`` strings the template may use.
  """

  def __init__(self, template: str | None = None, special: dict | None = None):
    self.source = template
    self.special = dict(special or {})
    self._compiled = None
    if template:
      env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      env.globals["raise_exception"] = _raise
      env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                      ensure_ascii=False)
      try:
        self._compiled = env.from_string(template)
      except jinja2.TemplateError as e:
        raise TemplateError(f"the checkpoint's chat template does not compile: {e}") from None

  @property
  def name(self) -> str:
    return "checkpoint" if self._compiled is not None else PLAIN_TEMPLATE_NAME

  def render(self, messages: list[dict]) -> str:
    """messages: [{"role": str, "content": str}] -> prompt text."""
    if self._compiled is None:
      return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    try:
      return self._compiled.render(messages=messages, add_generation_prompt=True,
                                   **self.special)
    except TemplateError:
      raise
    except jinja2.TemplateError as e:
      raise TemplateError(f"chat template: {e}") from None


class StopStrings:
  """Cuts streamed text at the first stop string.

  ``feed(text)`` returns (text safe to send now, stopped). Text that could be
  the beginning of a stop string is held back until it is decided; ``flush()``
  releases it at the end of the stream.
  """

  def __init__(self, stops: tuple[str, ...]):
    self.stops = tuple(s for s in stops if s)
    self._pending = ""
    self.stopped = False

  def feed(self, text: str) -> tuple[str, bool]:
    if self.stopped:
      return "", True
    if not self.stops:
      return text, False
    buf = self._pending + text
    cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
    if cut >= 0:
      self._pending = ""
      self.stopped = True
      return buf[:cut], True
    # Hold back the longest tail that is a proper prefix of some stop string.
    hold = 0
    for s in self.stops:
      for k in range(min(len(s) - 1, len(buf)), 0, -1):
        if buf.endswith(s[:k]):
          hold = max(hold, k)
          break
    self._pending = buf[len(buf) - hold:] if hold else ""
    return buf[:len(buf) - hold], False

  def flush(self) -> str:
    out, self._pending = ("" if self.stopped else self._pending), ""
    return out
