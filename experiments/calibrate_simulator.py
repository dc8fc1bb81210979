r"""Calibrates the simulator on a live two-region demo run and reports the gap, in
sample and out of sample (another run: other seed and load).

  .venv/bin/python experiments/demo_two_region.py --noreference --json_out=runs/calib/fit.json
  .venv/bin/python experiments/demo_two_region.py --noreference --seed=1 --rate=12 \
      --json_out=runs/calib/eval.json
  .venv/bin/python experiments/calibrate_simulator.py --demo_json=runs/calib/fit.json \
      --eval_json=runs/calib/eval.json --json_out=runs/calib/calibration.json

1. ``ServiceProfile.from_demo_json`` fits the prefill profiles of both routes
   (cold requests' measured ``prefill_s``), S_kv (link bytes of cold PrfaaS
   requests), the decode step (median TPOT), the link capacity and the decode
   batch size to the demo report. Whatever could not be fitted comes from a
   tiny-model placeholder (``replay.tiny_reference``); the JSON lists
   what was fitted (``calibrated``).
2. The simulator replays the *same* workload: the demo's arrival times, prompt
   and output lengths, shared prefix, the demo's base threshold t and one
   PrfaaS, one PD-P and one PD-D instance (the demo's single PD node does PD-P
   and PD-D; the simulator gives them separate instances, one known gap).
3. It reports TTFT P50/P90, TPOT and egress, sim vs live, and their gap.
4. With ``--eval_json``, the same fitted profile (nothing refitted) replays each other
   run's workload and the gap there is reported beside the in-sample one
   (``out_of_sample``, ``out_vs_in``): the in-sample gap flatters the calibration,
   since the overheads and profile points were fitted to the very requests compared.

Live TTFT includes what the simulator's compute-and-bandwidth model has no
term for: gRPC calls, the transfer's Begin/Commit round trips over the relay's
RTT, the first-token handoff. The fitted per-route fixed overheads
(``pdp_overhead_s``, ``prfaas_overhead_s``; see ``paas_jax.simulation.calibration``)
put that back; the JSON reports the gap with them (``gap``) and without them
(``gap_without_overhead``), side by side on the same replay.

Known differences that remain: the live decode step grows with the batch and
the prompt (the simulator's ``context_fraction`` is 0 here), and the live link
is a relay with a bandwidth trace while the simulator gets the constant base
bandwidth.
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paas_jax.simulation.replay import (calibrate_and_evaluate, offered_rate,  # noqa: E402
                                       tiny_reference)

FLAGS = flags.FLAGS
flags.DEFINE_string("demo_json", "runs/demo/report.json", "Report of demo_two_region.py to fit.")
flags.DEFINE_list("eval_json", [], "Reports of other demo runs (other seed and load) to "
                  "evaluate the fitted profile on, out of sample.")
flags.DEFINE_string("json_out", "runs/demo/calibration.json", "Where to write the result.")


def _print_gap(title: str, ev: dict) -> None:
  print(f"{title}: {ev['live']['requests']} requests")
  print(f"  {'metric':18} {'sim':>10} {'live':>10} {'rel gap':>8} {'no overhead':>12}")
  for k, v in ev["gap"].items():
    if v is None:
      print(f"  {k:18} {'n/a':>10}")
      continue
    rel = "n/a" if v["rel"] is None else f"{100 * v['rel']:+.0f}%"
    b = ev["gap_without_overhead"][k]
    rel_b = "n/a" if b is None or b["rel"] is None else f"{100 * b['rel']:+.0f}%"
    print(f"  {k:18} {v['sim']:10.4g} {v['live']:10.4g} {rel:>8} {rel_b:>12}")


def main(argv):
  del argv
  fit = json.loads(pathlib.Path(FLAGS.demo_json).read_text())
  evals = {pathlib.Path(p).stem: json.loads(pathlib.Path(p).read_text()) for p in FLAGS.eval_json}
  if FLAGS.demo_json in FLAGS.eval_json:
    raise app.UsageError("--eval_json must name other runs than --demo_json")
  ref = tiny_reference(fit)
  r = calibrate_and_evaluate(fit, evals, ref, min_requests_per_point=2)
  service = r.pop("service")
  runs = {"fit": FLAGS.demo_json, **{k: p for k, p in zip(evals, FLAGS.eval_json)}}
  out = {
      "demo_json": FLAGS.demo_json, "eval_json": list(FLAGS.eval_json), "calibrated": r["calibrated"],
      "runs": {name: {"path": path, "offered_rps": offered_rate(rep),
                      **{k: rep.get(k) for k in ("seed", "num_requests", "threshold_tokens",
                                                 "workload_wall_s")}}
               for (name, path), rep in zip(runs.items(), [fit, *evals.values()])},
      "profile": {
          "prfaas_points": list(zip(service.prfaas_prefill.lengths,
                                    service.prfaas_prefill.prefill_seconds)),
          "pdp_points": list(zip(service.pdp_prefill.lengths,
                                 service.pdp_prefill.prefill_seconds)),
          "s_kv_fixed_bytes": service.prfaas_prefill.kv_fixed_bytes,
          "s_kv_bytes_per_token": service.prfaas_prefill.kv_slope_bytes_per_token,
          "decode_step_s": service.decode.step_seconds,
          "decode_max_batch_size": service.decode.max_batch_size,
          "pdp_overhead_s": service.pdp_overhead_s,
          "prfaas_overhead_s": service.prfaas_overhead_s},
      # In sample, as before (same keys): fitted and evaluated on --demo_json.
      **r["in_sample"],
      "out_of_sample": r["out_of_sample"], "out_vs_in": r["out_vs_in"],
  }
  path = pathlib.Path(FLAGS.json_out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  print(f"calibrated from {FLAGS.demo_json}: {', '.join(service.calibrated) or 'nothing'}")
  print(f"fixed overheads: pdp {1e3 * service.pdp_overhead_s:.1f} ms, "
        f"prfaas {1e3 * service.prfaas_overhead_s:.1f} ms")
  _print_gap(f"in sample ({FLAGS.demo_json})", r["in_sample"])
  for name, ev in r["out_of_sample"].items():
    _print_gap(f"out of sample ({name}, nothing refitted)", ev)
  print(f"written: {path}")
  return 0


if __name__ == "__main__":
  app.run(main)
