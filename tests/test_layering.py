"""Layering rules of the package, checked on the source (and in fresh processes).

* The broker and the front door never load JAX (request validation is the
  JAX-free ``serving/validation.py``); the engine does (negative control).
* ``serving/`` never imports ``simulation/`` (the rebalancer and its fit live
  in ``scheduling/``).
* No import cycles between modules of ``paas_jax`` and ``pallas_kernels``,
  counting imports inside functions too (a deferred import hides a cycle, it
  does not remove it).
* No module imports a private (``_name``) definition of another module.
* An import inside a function says why it is deferred (a comment on its line,
  or directly above it or the group of imports it belongs to): only optional
  dependencies, or JAX kept out of a JAX-free process, are deferred.

Each static check runs its detector on a small synthetic package first, so a
detector that can never fire fails here instead of passing silently.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("paas_jax", "pallas_kernels")

_JAX_LOADED = """
import importlib, sys
for name in sys.argv[1:]:
  importlib.import_module(name)
print("jax" in sys.modules, "flax" in sys.modules)
"""


def _loads_jax(*modules: str) -> tuple[bool, bool]:
  r = subprocess.run([sys.executable, "-c", _JAX_LOADED, *modules], capture_output=True,
                     text=True, timeout=300, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  jax, flax = r.stdout.split()
  return jax == "True", flax == "True"


def test_broker_and_front_door_do_not_import_jax():
  assert _loads_jax("paas_jax.serving.broker", "paas_jax.frontdoor.server",
                    "paas_jax.serving.validation", "paas_jax.models") == (False, False)


def test_engine_imports_jax():
  # Negative control: the probe does see JAX where it is loaded.
  assert _loads_jax("paas_jax.serving.decode_engine") == (True, True)


_BACKEND_STARTED = """
import importlib, sys
for name in sys.argv[1:]:
  importlib.import_module(name)
from jax._src import xla_bridge
print(bool(xla_bridge._backends))
"""


def _starts_a_backend(*modules: str) -> bool:
  r = subprocess.run([sys.executable, "-c", _BACKEND_STARTED, *modules], capture_output=True,
                     text=True, timeout=300, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout.split()[-1] == "True"


def test_importing_the_pod_processes_starts_no_jax_backend():
  # A pod process imports everything, then calls jax.distributed.initialize, which
  # refuses once a backend exists: no module may create arrays at import time.
  assert not _starts_a_backend("paas_jax.serving.pod_worker",
                               "paas_jax.serving.pod_prefill_server",
                               "paas_jax.serving.slice_decode_server", "paas_jax.models.api",
                               "paas_jax.serving.decode_engine", "paas_jax.serving.prefill_engine")
  # Negative control: a module-level array does start one.
  assert _starts_a_backend("paas_jax.models.api", "tests.layering_jnp_constant")


def test_validation_without_jax_refuses_bad_requests():
  code = """
import sys
from paas_jax.models import load_config
from paas_jax.serving.validation import (InvalidRequestError, RequestParams, make_sampling,
                                         validate_request)
cfg = load_config("tiny_gdn_gqa")
validate_request(cfg, [1, 2, 3], RequestParams(sampling=make_sampling(0.5, 4, 0)))
for prompt, params in (([], RequestParams()), ([cfg.vocab_size], RequestParams()),
                       ([1], RequestParams(max_new_tokens=0))):
  try:
    validate_request(cfg, prompt, params)
  except InvalidRequestError as e:
    print("refused:", e)
  else:
    raise SystemExit(f"accepted {prompt} {params}")
assert "jax" not in sys.modules
"""
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                     timeout=300, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.count("refused:") == 3


# -- static import graph -------------------------------------------------------------


def _modules(root: pathlib.Path, packages) -> dict[str, pathlib.Path]:
  out = {}
  for pkg in packages:
    for path in (root / pkg).rglob("*.py"):
      if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
        continue  # generated code
      parts = list(path.relative_to(root).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def import_graph(root: pathlib.Path, packages=PACKAGES):
  """(edges module -> set of modules, private imports [(importer, module, name)]).

  Every ``import`` statement counts, at module level or inside a function.
  """
  mods = _modules(root, packages)

  def owner(name: str) -> str | None:
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name or None

  edges: dict[str, set[str]] = {m: set() for m in mods}
  private = []
  for mod, path in mods.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        targets = []
        for a in node.names:
          full = f"{node.module}.{a.name}"
          targets.append(full if full in mods else node.module)
          if (a.name.startswith("_") and full not in mods
              and node.module.startswith(tuple(packages))):
            private.append((mod, node.module, a.name))
      else:
        continue
      for t in targets:
        if t.startswith(tuple(packages)) and (o := owner(t)) and o != mod:
          edges[mod].add(o)
  return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


@pytest.fixture
def broken_package(tmp_path):
  """A package with a deferred-import cycle, a private import and a layering leak."""
  pkg = tmp_path / "paas_jax"
  (pkg / "serving").mkdir(parents=True)
  (pkg / "simulation").mkdir()
  for d in (pkg, pkg / "serving", pkg / "simulation"):
    (d / "__init__.py").write_text("")
  (pkg / "serving" / "kernel.py").write_text(
      "def f():\n  from paas_jax.serving import kernel_gpu\n  return kernel_gpu\n")
  (pkg / "serving" / "kernel_gpu.py").write_text(
      "from paas_jax.serving.kernel import f\nfrom paas_jax.simulation.link import _Trace\n")
  (pkg / "simulation" / "link.py").write_text("class _Trace:\n  pass\n")
  (pkg / "serving" / "explained.py").write_text(
      "def g():\n  # Deferred: optional dependency.\n  import zlib\n  import json\n"
      "  return zlib, json\n\n\ndef h():\n  import json  # Deferred: the reason\n  return json\n")
  return tmp_path


def test_detectors_fire_on_a_broken_package(broken_package):
  edges, private = import_graph(broken_package, ("paas_jax",))
  assert cycles(edges) == [["paas_jax.serving.kernel", "paas_jax.serving.kernel_gpu"]]
  assert private == [("paas_jax.serving.kernel_gpu", "paas_jax.simulation.link", "_Trace")]
  assert "paas_jax.simulation.link" in edges["paas_jax.serving.kernel_gpu"]


def unexplained_deferred_imports(root: pathlib.Path, packages=PACKAGES) -> list[str]:
  """``path:line`` of every import inside a function with no stated reason: no
  comment on its line (besides a pylint directive) and none directly above it
  or above the run of import lines it belongs to."""
  out = []
  for path in _modules(root, packages).values():
    lines = path.read_text().splitlines()
    for fn in ast.walk(ast.parse("\n".join(lines))):
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for node in ast.walk(fn):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
          continue
        inline = lines[node.lineno - 1].partition("#")[2]
        if inline and not inline.strip().startswith("pylint:"):
          continue
        i, reason = node.lineno - 2, False
        while i >= 0:
          above = lines[i].strip()
          if above.startswith("#"):
            reason = True
          elif not above.startswith(("import ", "from ")):
            break
          i -= 1
        if not reason:
          out.append(f"{path.relative_to(root)}:{node.lineno}")
  return sorted(set(out))


def test_deferred_import_detector_fires_on_a_broken_package(broken_package):
  # kernel.f's import says nothing; explained.g's group and h's line do.
  assert unexplained_deferred_imports(broken_package, ("paas_jax",)) == [
      "paas_jax/serving/kernel.py:2"]


def test_every_deferred_import_says_why():
  assert unexplained_deferred_imports(ROOT) == []


def test_no_import_cycles():
  edges, _ = import_graph(ROOT)
  assert len(edges) > 100
  assert cycles(edges) == []


def test_no_private_imports_across_modules():
  _, private = import_graph(ROOT)
  assert private == []


def test_serving_does_not_import_simulation():
  edges, _ = import_graph(ROOT)
  leaks = {m: sorted(t for t in ts if t.startswith("paas_jax.simulation"))
           for m, ts in edges.items() if m.startswith("paas_jax.serving")}
  assert {m: t for m, t in leaks.items() if t} == {}
