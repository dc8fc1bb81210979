"""AIPerf (NVIDIA's stock benchmark client) against paas-jax's OpenAI API.

  # AIPerf is an optional extra in its own venv (it pins its own dependencies):
  python3.11 -m venv /work/venvs/aiperf && /work/venvs/aiperf/bin/pip install aiperf
  .venv/bin/python experiments/make_qwen3_next_checkpoint.py --out=runs/qwen3_next_small
  .venv/bin/python experiments/bench_aiperf.py --checkpoint=runs/qwen3_next_small \
      --aiperf=/work/venvs/aiperf/bin/aiperf --modes=single,two

Starts paas-jax on the checkpoint (bf16, the OpenAI gateway; ``single``: every
prompt prefilled in the PD region, ``two``: PrfaaS routing over the emulated
link) and runs ``aiperf profile`` against it unchanged: synthetic text prompts
tokenized by the checkpoint's own tokenizer (a local folder: nothing is
downloaded), streaming completions, Poisson arrivals at ``--rate``,
``ignore_eos`` so every request generates ``--osl`` tokens. AIPerf counts
tokens with its own copy of the tokenizer and compares them with the server's
``usage``: prompts must agree exactly; completions are judged by ``usage``
(a random model's text does not re-tokenize to the ids it was decoded from,
so AIPerf's own output count and its mismatch warning are expected to differ).

The run is a compatibility check as much as a benchmark. It fails (exit 1)
unless every request completed without error, the server's prompt counts
equal AIPerf's own tokenization of the prompts, and every completion has
exactly ``--osl`` tokens. Writes AIPerf's artifacts under ``--out/<mode>`` and
a summary JSON (TTFT, ITL, request latency, throughput, the checks).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

# pylint: disable=g-import-not-at-top,wrong-import-position  (after the path fix above)
from experiments.serve_load import paas_cluster
from paas_jax.jsonutil import write_json

flags.DEFINE_string("checkpoint", None, "HF checkpoint served by paas-jax.", required=True)
flags.DEFINE_string("aiperf", "aiperf", "The aiperf executable.")
flags.DEFINE_string("client_tokenizer", None, "Tokenizer folder AIPerf counts with (default: "
                    "the checkpoint's). Another model's is the prompt-count check's negative "
                    "control.")
flags.DEFINE_list("modes", ["single", "two"], "paas-jax deployments: single and/or two.")
flags.DEFINE_integer("request_count", 16, "Requests per mode.")
flags.DEFINE_float("rate", 1.0, "Request rate (requests/s, Poisson).")
flags.DEFINE_integer("isl", 200, "Mean synthetic prompt length (tokens).")
flags.DEFINE_integer("isl_stddev", 50, "Prompt length standard deviation.")
flags.DEFINE_integer("osl", 32, "Output tokens per request.")
flags.DEFINE_integer("context", 1024, "paas-jax max context.")
flags.DEFINE_integer("n_slots", 8, "paas-jax decode slots.")
flags.DEFINE_float("threshold", 150, "Two-region offload threshold (tokens).")
flags.DEFINE_string("bandwidth", "1gbit", "Emulated PrfaaS->PD link (two-region).")
flags.DEFINE_float("rtt_ms", 10.0, "Link round-trip time (two-region).")
flags.DEFINE_float("timeout_s", 900.0, "Limit for one aiperf run.")
flags.DEFINE_string("out", "runs/bench_aiperf", "Output directory.")
FLAGS = flags.FLAGS

METRICS = ("time_to_first_token", "inter_token_latency", "request_latency",
           "output_token_throughput", "request_throughput", "usage_prompt_tokens",
           "usage_completion_tokens", "usage_prompt_tokens_diff_pct")


def served_model(url: str) -> str:
  import urllib.request  # pylint: disable=g-import-not-at-top  (only here)
  with urllib.request.urlopen(f"{url}/models", timeout=30) as r:
    return json.loads(r.read())["data"][0]["id"]


def run_aiperf(url: str, model: str, artifacts: pathlib.Path) -> dict:
  cmd = [FLAGS.aiperf, "profile", "--model", model, "--url", url.removesuffix("/v1"),
         "--endpoint-type", "completions", "--streaming", "--tokenizer",
         FLAGS.client_tokenizer or FLAGS.checkpoint,
         "--synthetic-input-tokens-mean", str(FLAGS.isl),
         "--synthetic-input-tokens-stddev", str(FLAGS.isl_stddev),
         "--output-tokens-mean", str(FLAGS.osl), "--extra-inputs", "ignore_eos:true",
         "--request-count", str(FLAGS.request_count),
         "--request-rate", str(FLAGS.rate), "--output-artifact-dir", str(artifacts),
         "--ui-type", "none"]
  env = dict(os.environ, HF_HUB_DISABLE_TELEMETRY="1")
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FLAGS.timeout_s, env=env)
  (artifacts / "aiperf_stdout.txt").write_text(proc.stdout + proc.stderr)
  export = artifacts / "profile_export_aiperf.json"
  if proc.returncode != 0 or not export.exists():
    raise RuntimeError(f"aiperf failed (rc {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
  return json.loads(export.read_text())


def summarize(export: dict) -> dict:
  """AIPerf's aggregate metrics plus the compatibility checks."""
  metric = {k: {q: export[k].get(q) for q in ("avg", "p50", "p90", "p99", "unit")}
            for k in METRICS if isinstance(export.get(k), dict)}
  completed = int(export.get("request_count", {}).get("avg", 0))
  completion = export.get("usage_completion_tokens", {})
  checks = {
      "all_completed": completed == FLAGS.request_count,
      "no_errors": not export.get("error_summary"),
      "prompt_tokens_match_client_tokenizer":
          export.get("usage_prompt_tokens_diff_pct", {}).get("max") == 0.0,
      "every_completion_has_osl_tokens":
          completion.get("min") == completion.get("max") == FLAGS.osl,
  }
  return {"completed": completed, "metrics": metric, "checks": checks}


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  report = {"checkpoint": FLAGS.checkpoint, "request_count": FLAGS.request_count,
            "rate": FLAGS.rate, "isl": FLAGS.isl, "osl": FLAGS.osl, "modes": {}}
  for mode in FLAGS.modes:
    cluster = paas_cluster(FLAGS.checkpoint, mode, FLAGS.threshold, out,
                           n_slots=FLAGS.n_slots, context=FLAGS.context,
                           bandwidth=FLAGS.bandwidth, rtt_ms=FLAGS.rtt_ms)
    try:
      artifacts = out / f"aiperf_{mode}"
      artifacts.mkdir(exist_ok=True)
      export = run_aiperf(cluster.http_url, served_model(cluster.http_url), artifacts)
    finally:
      cluster.stop()
    report["modes"][mode] = summarize(export)
    print(mode, json.dumps(report["modes"][mode]["checks"]), flush=True)
  write_json(out / "bench_aiperf.json", report)
  print(json.dumps(report, indent=1))
  ok = all(all(m["checks"].values()) for m in report["modes"].values())
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  app.run(main)
