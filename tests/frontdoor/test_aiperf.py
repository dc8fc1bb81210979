"""AIPerf, a stock benchmark client, runs unchanged against paas-jax's OpenAI API
(two regions, bf16, the checkpoint's own tokenizer). AIPerf is an optional
extra in its own venv: set ``AIPERF`` to its executable (or put it on PATH)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.checkpoints import hf_tiny

REPO = pathlib.Path(__file__).resolve().parents[2]
AIPERF = os.environ.get("AIPERF") or shutil.which("aiperf")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not AIPERF, reason="aiperf not installed (set AIPERF)")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  d = tmp_path_factory.mktemp("qwen3_next_small")
  subprocess.run([sys.executable, str(REPO / "experiments" / "make_qwen3_next_checkpoint.py"),
                  f"--out={d}"], check=True, capture_output=True, timeout=600)
  return d


def _bench(checkpoint, out, *extra):
  return subprocess.run(
      [sys.executable, str(REPO / "experiments" / "bench_aiperf.py"), f"--checkpoint={checkpoint}",
       f"--aiperf={AIPERF}", "--modes=two", "--request_count=6", "--rate=2", "--isl=120",
       "--osl=12", f"--out={out}", *extra], capture_output=True, text=True, timeout=1500,
      cwd=REPO)


def test_aiperf_against_two_regions(checkpoint, tmp_path):
  r = _bench(checkpoint, tmp_path)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  report = json.loads((tmp_path / "bench_aiperf.json").read_text())["modes"]["two"]
  assert report["completed"] == 6 and all(report["checks"].values())
  assert report["metrics"]["time_to_first_token"]["avg"] > 0


def test_wrong_client_tokenizer_fails_the_prompt_check(checkpoint, tmp_path):
  other = tmp_path / "other_tokenizer"
  other.mkdir()
  hf_tiny.make_tokenizer().save(str(other / "tokenizer.json"))
  (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class":
                                                           "PreTrainedTokenizerFast"}))
  r = _bench(checkpoint, tmp_path / "out", f"--client_tokenizer={other}")
  assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
  checks = json.loads((tmp_path / "out" / "bench_aiperf.json").read_text())["modes"]["two"][
      "checks"]
  assert checks["prompt_tokens_match_client_tokenizer"] is False
