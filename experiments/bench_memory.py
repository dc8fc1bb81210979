"""Peak prefill memory vs prompt length: one-shot ``api.prefill`` vs ``prefill_chunked``.

  python experiments/bench_memory.py --json_out=runs/bench_memory.json
  python experiments/bench_memory.py --lengths=1024,2048 --baseline_lengths=1024,2048  # quick

Each point runs in a fresh subprocess. The process first compiles (and, for the
one-shot path, runs once) at the point's exact shapes, then resets the kernel's
peak-RSS mark (``/proc/self/clear_refs``), prefills the prompt and reads the
peak (``VmHWM``). Reported: the peak's growth over the RSS just before the
prefill, i.e. what the prefill allocated (state, activations, logits). glibc's
mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_``) so that freed buffers go
back to the OS between the warm-up and the measured call.

The target (issue #17): peak growth with prompt length at most 2x the growth of
the state itself. The one-shot baseline is skipped at 32K by default: its f32
logits alone are 4 GB and the issue measured ~12 GB at 32K, too much for the
shared 24 GB machine.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "hybrid_100m", "Model config.")
flags.DEFINE_list("lengths", ["4096", "16384", "32768"], "Prompt lengths of the chunked path.")
flags.DEFINE_list("baseline_lengths", ["4096", "16384"], "Prompt lengths of one-shot prefill.")
flags.DEFINE_integer("chunk", 512, "Chunk of prefill_chunked.")
flags.DEFINE_string("json_out", "runs/bench_memory.json", "Output JSON.")
flags.DEFINE_string("worker", "", "Internal: run one point, 'oneshot:LEN' or 'chunked:LEN'.")
flags.DEFINE_integer("timeout_s", 3000, "Per-point subprocess timeout.")

MMAP_THRESHOLD = str(128 * 1024)


def _status_mib(key: str) -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) / 1024
  raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS


def run_point(mode: str, length: int) -> dict:
  """Inside the worker: warm up at the point's shapes, then measure one prefill."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from paas_jax.models import api, load_config  # pylint: disable=g-import-not-at-top
  from paas_jax.models.chunked_prefill import prefill_chunked  # pylint: disable=g-import-not-at-top
  from paas_jax.state import init_state, round_up, state_bytes  # pylint: disable=g-import-not-at-top

  config = load_config(FLAGS.model)
  model = api.Model.create(config, seed=0)
  tokens = np.random.RandomState(0).randint(0, config.vocab_size, (1, length)).astype(np.int32)
  if mode == "oneshot":
    def prefill():
      return api.prefill(model, tokens)
    jax.block_until_ready(prefill())  # compile + one run at the same shapes
  elif mode == "chunked":
    def prefill():
      return prefill_chunked(model, tokens, chunk=FLAGS.chunk)
    # Two chunks into a state of the prompt's capacity compile both chunk steps
    # (caller's state, then donated) at the measured shapes.
    warm_state = init_state(config, 1, round_up(length))
    jax.block_until_ready(prefill_chunked(model, tokens[:, :2 * FLAGS.chunk], warm_state,
                                          chunk=FLAGS.chunk))
    del warm_state
  else:
    raise ValueError(f"unknown mode {mode!r}")
  gc.collect()
  before = _status_mib("VmRSS")
  _reset_peak()
  t0 = time.perf_counter()
  out = prefill()
  jax.block_until_ready(out)
  seconds = time.perf_counter() - t0
  peak = _status_mib("VmHWM")
  logits, state = out
  sb = state_bytes(config, length)
  return {"mode": mode, "length": length, "rss_before_mib": before, "peak_mib": peak,
          "growth_mib": peak - before, "state_mib": sb.total / 2**20,
          "state_alloc_mib": state.nbytes / 2**20,
          "logits_mib": logits.size * logits.dtype.itemsize / 2**20,
          "prefill_s": seconds, "tokens_per_s": length / seconds,
          "backend": jax.default_backend()}


def spawn(mode: str, length: int) -> dict:
  env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
  cmd = [sys.executable, os.path.abspath(__file__), f"--worker={mode}:{length}",
         f"--model={FLAGS.model}", f"--chunk={FLAGS.chunk}"]
  t0 = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=FLAGS.timeout_s)
  if done.returncode != 0:
    return {"mode": mode, "length": length, "error": done.stderr[-2000:],
            "returncode": done.returncode}
  row = json.loads(done.stdout.strip().splitlines()[-1])
  row["process_s"] = time.perf_counter() - t0
  return row


def growth_ratio(rows: list[dict]) -> dict | None:
  """(peak growth between the shortest and longest point) / (state growth there)."""
  ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["length"])
  if len(ok) < 2:
    return None
  lo, hi = ok[0], ok[-1]
  state = hi["state_mib"] - lo["state_mib"]
  peak = hi["growth_mib"] - lo["growth_mib"]
  return {"from": lo["length"], "to": hi["length"], "peak_growth_mib": peak,
          "state_growth_mib": state, "ratio": peak / state if state else None}


def summarize(rows: list[dict]) -> dict:
  """The JSON result: every point, one-shot vs chunked side by side, growth vs state."""
  by = {(r["mode"], r["length"]): r for r in rows if "error" not in r}
  side_by_side = [{"length": n, "oneshot_growth_mib": by["oneshot", n]["growth_mib"],
                   "chunked_growth_mib": by["chunked", n]["growth_mib"],
                   "chunked_over_oneshot": by["chunked", n]["growth_mib"]
                                           / by["oneshot", n]["growth_mib"]}
                  for (mode, n) in sorted(by) if mode == "oneshot" and ("chunked", n) in by]
  return {"model": FLAGS.model, "chunk": FLAGS.chunk, "rows": rows,
          "side_by_side": side_by_side,
          "growth_vs_state": {m: growth_ratio([r for r in rows if r["mode"] == m])
                              for m in ("oneshot", "chunked")},
          "target": "peak growth between lengths <= 2x the state's growth"}


def main(argv):
  del argv
  from paas_jax.jsonutil import write_json  # pylint: disable=g-import-not-at-top
  if FLAGS.worker:
    mode, length = FLAGS.worker.split(":")
    print(json.dumps(run_point(mode, int(length))))
    return
  rows = []
  points = ([("oneshot", int(n)) for n in FLAGS.baseline_lengths]
            + [("chunked", int(n)) for n in FLAGS.lengths])
  for mode, length in points:
    row = spawn(mode, length)
    rows.append(row)
    if "error" in row:
      print(f"{mode:8s} {length:6d}: FAILED rc={row['returncode']}: {row['error'][-300:]}",
            flush=True)
    else:
      print(f"{mode:8s} {length:6d}: peak growth {row['growth_mib']:8.0f} MiB "
            f"(state {row['state_mib']:6.0f} MiB, logits {row['logits_mib']:6.0f} MiB), "
            f"{row['tokens_per_s']:6.0f} tok/s", flush=True)
    write_json(FLAGS.json_out, summarize(rows))  # a long sweep keeps what it measured
  result = summarize(rows)
  side_by_side = result["side_by_side"]
  for s in side_by_side:
    print(f"{s['length']:6d}: chunked / one-shot peak growth = {s['chunked_over_oneshot']:.3f}")
  for mode, g in result["growth_vs_state"].items():
    if g and g["ratio"] is not None:
      print(f"{mode}: peak growth {g['from']}->{g['to']} = {g['peak_growth_mib']:.0f} MiB, "
            f"state growth {g['state_growth_mib']:.0f} MiB, ratio {g['ratio']:.2f}")
  write_json(FLAGS.json_out, result)


if __name__ == "__main__":
  app.run(main)
