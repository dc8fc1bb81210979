r"""A decode slice's compile cost, with and without precompiling, side by side (#16).

  .venv/bin/python experiments/bench_slice_compile.py \
      --json_out=docs/results/bench_slice_compile.json

The same cluster (region A a prefill pod, region B a decode slice, the relay
and broker) is started ``--pairs`` times with ``--slice_precompile`` and
without, alternating which goes first, the persistent compilation cache off
in every process so that each start compiles from scratch. After each start,
one workload that touches batch widths and context octaves the slice has not
served yet: ``--burst`` requests at once, local and remote, of growing
lengths, then the same again one at a time. The JSON reports per run the
start-up seconds (the slice's ready file: ``startup_s``, ``precompile_s``,
``precompiled_programs``), the workload's wall time and each request's TTFT,
and per pair the ratios precompiled / not; tokens are compared with
single-process generation. The load average goes into the JSON.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paas_jax.client import BrokerClient  # noqa: E402
from paas_jax.models import api  # noqa: E402
from paas_jax.netem import LinkSpec  # noqa: E402
from paas_jax.serving import common  # noqa: E402
from paas_jax.serving.launch import ClusterSpec, LocalCluster  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config (random init, seed 0).")
flags.DEFINE_integer("pairs", 1, "Start pairs (precompiled and not), order alternating.")
flags.DEFINE_integer("burst", 4, "Requests sent at once (the slice's slots).")
flags.DEFINE_integer("max_ctx", 512, "Context per request (more octaves to compile).")
flags.DEFINE_integer("max_new_tokens", 8, "Tokens per request.")
flags.DEFINE_string("json_out", "docs/results/bench_slice_compile.json", "Where to write.")
flags.DEFINE_string("workdir", "runs/bench_slice_compile", "Logs of the processes.")


def _prompts() -> list[tuple[list[int], str]]:
  """Growing lengths (each a new context octave), alternating remote and local."""
  rng = np.random.default_rng(16)
  lengths = [24 + 60 * i for i in range(FLAGS.burst)]
  return [([int(t) for t in rng.integers(1, 256, n)], "remote" if i % 2 else "local")
          for i, n in enumerate(lengths)]


def _run(precompile: bool, workdir: pathlib.Path, reference) -> dict:
  spec = ClusterSpec(config=FLAGS.config, n_slots=FLAGS.burst, max_queue=16,
                     max_ctx=FLAGS.max_ctx, prefill_buckets=(64,), prefill_max_batch=1,
                     threshold=16, prefill_pod=2, decode_slice=2, prefix_block=0,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01), startup_timeout_s=1200,
                     decode_args=() if precompile else ("--noslice_precompile",))
  t0 = time.monotonic()
  cluster = LocalCluster(spec, workdir).start()
  try:
    start_s = time.monotonic() - t0
    ready = dict(cluster.procs["decode"].info)
    prompts = _prompts()
    with BrokerClient(cluster.broker_address, timeout_s=1200) as client:
      def one(i: int, tag: str):
        prompt, route = prompts[i]
        return client.generate(prompt_ids=prompt, max_new_tokens=FLAGS.max_new_tokens,
                               route=route, request_id=f"{tag}{i}")
      t1 = time.monotonic()
      with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        burst = list(pool.map(lambda i: one(i, "burst"), range(len(prompts))))
      burst_s = time.monotonic() - t1
      t2 = time.monotonic()
      serial = [one(i, "serial") for i in range(len(prompts))]
      serial_s = time.monotonic() - t2
    exact = all(out.tokens == reference[i] for outs in (burst, serial)
                for i, out in enumerate(outs))
    return {"precompile": precompile, "cluster_start_s": start_s,
            "slice_startup_s": ready.get("startup_s"),
            "slice_precompile_s": ready.get("precompile_s"),
            "precompiled_programs": ready.get("precompiled_programs"),
            "burst_s": burst_s, "serial_s": serial_s, "workload_s": burst_s + serial_s,
            "total_s": start_s + burst_s + serial_s,
            "burst_ttft_s": [o.ttft_s for o in burst], "serial_ttft_s": [o.ttft_s for o in serial],
            "routes": [o.route for o in burst], "tokens_exact": exact}
  finally:
    cluster.stop()


def main(argv):
  del argv
  os.environ["PAAS_JAX_COMPILATION_CACHE"] = "none"  # every start compiles from scratch
  model, _ = common.load_model(FLAGS.config, 0)
  reference = [api.generate(model, np.asarray(p, np.int32), FLAGS.max_new_tokens).tokens
               for p, _ in _prompts()]
  root = pathlib.Path(FLAGS.workdir)
  root.mkdir(parents=True, exist_ok=True)
  runs, pairs = [], []
  for k in range(FLAGS.pairs):
    order = (False, True) if k % 2 == 0 else (True, False)
    pair = {}
    for precompile in order:
      workdir = pathlib.Path(tempfile.mkdtemp(dir=root))
      run = _run(precompile, workdir, reference)
      run["load_average"] = os.getloadavg()
      print(json.dumps({k: v for k, v in run.items() if not k.endswith("ttft_s")}), flush=True)
      runs.append(run)
      pair[precompile] = run
    on, off = pair[True], pair[False]
    pairs.append({key: on[key] / off[key] for key in
                  ("cluster_start_s", "burst_s", "serial_s", "workload_s", "total_s")})
    pairs[-1]["first_burst_ttft_max"] = max(on["burst_ttft_s"]) / max(off["burst_ttft_s"])
  out = {"what": "slice start-up and first-touch compile, precompiled / not (cache off)",
         "config": FLAGS.config, "max_ctx": FLAGS.max_ctx, "burst": FLAGS.burst,
         "runs": runs, "pairs_on_over_off": pairs,
         "median_on_over_off": {key: statistics.median(p[key] for p in pairs)
                                for key in pairs[0]},
         "all_tokens_exact": all(r["tokens_exact"] for r in runs)}
  path = pathlib.Path(FLAGS.json_out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  print(json.dumps(out["median_on_over_off"], indent=1), "exact:", out["all_tokens_exact"])


if __name__ == "__main__":
  app.run(main)
