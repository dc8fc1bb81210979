"""Kernel-test collection tweaks.

Interpret-mode Pallas runs cost seconds each on CPU, so an interpreted test
class may list in ``SLOW_IN_INTERPRET`` the test names (or parametrized ids)
that duplicate coverage already given by its other cases; those get the
``slow`` marker and only run with ``-m slow`` (the compiled, on-hardware
classes always run them).
"""

import pytest


@pytest.hookimpl(tryfirst=True)  # before the "-m 'not slow'" deselection
def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    cls = getattr(item, "cls", None)
    if cls is None or not getattr(cls, "INTERPRET", False):
      continue
    slow = getattr(cls, "SLOW_IN_INTERPRET", ())
    if item.name in slow or getattr(item, "originalname", None) in slow:
      item.add_marker(pytest.mark.slow)
