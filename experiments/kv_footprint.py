"""Per-request state footprint (fixed + per-token) of hybrid vs dense models.

  python experiments/kv_footprint.py --json_out=runs/kv_footprint.json
  python experiments/kv_footprint.py --prefill_s_json=prefill.json   # adds Phi_kv

``--prefill_s_json`` maps model -> {seq_len: prefill seconds}; Phi_kv(l) =
S_kv(l) / T_prefill(l) is then reported in Gbps (1e9 bits/s).
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags

from paas_jax.jsonutil import write_json
from paas_jax.models import load_config
from paas_jax.state import state_bytes

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["kimi_linear_48b", "mimo_v2_flash", "qwen3_5_397b", "ring_2_5_1t",
                             "minimax_m2_5", "qwen3_235b", "hybrid_100m", "dense_100m"],
                  "Model configs to size.")
flags.DEFINE_list("seq_lens", ["1024", "8192", "32768", "131072"], "Context lengths.")
flags.DEFINE_string("baseline", "auto",
                    "Dense model for the ratio column; 'auto' picks dense_100m for *_100m, "
                    "tiny_dense_gqa for tiny_*, else minimax_m2_5.")
flags.DEFINE_string("prefill_s_json", None, "JSON {model: {seq_len: seconds}} for Phi_kv.")
flags.DEFINE_string("json_out", "runs/kv_footprint.json", "Where to write the rows.")


def baseline_for(model: str, flag: str) -> str:
  if flag != "auto":
    return flag
  if model.endswith("_100m"):
    return "dense_100m"
  if model.startswith("tiny_"):
    return "tiny_dense_gqa"
  return "minimax_m2_5"


def footprint_rows(models, seq_lens, baseline="auto", prefill_s=None) -> list[dict]:
  rows = []
  for name in models:
    config = load_config(name)
    base = load_config(baseline_for(name, baseline))
    for seq_len in seq_lens:
      size = state_bytes(config, seq_len)
      row = {"model": name, "seq_len": seq_len, "fixed_bytes": size.fixed,
             "per_token_bytes": size.per_token, "total_bytes": size.total,
             "baseline": base.name,
             "ratio_to_baseline": size.total / state_bytes(base, seq_len).total}
      seconds = (prefill_s or {}).get(name, {}).get(str(seq_len))
      if seconds:
        row["prefill_s"] = seconds
        row["phi_kv_gbps"] = size.total * 8 / seconds / 1e9
      rows.append(row)
  return rows


def main(argv):
  del argv
  prefill_s = None
  if FLAGS.prefill_s_json:
    prefill_s = json.loads(pathlib.Path(FLAGS.prefill_s_json).read_text())
  rows = footprint_rows(FLAGS.models, [int(s) for s in FLAGS.seq_lens], FLAGS.baseline,
                        prefill_s)
  print(f"{'model':18s} {'seq':>7s} {'fixed MiB':>10s} {'B/token':>9s} {'total MiB':>10s} "
        f"{'x dense':>8s} {'Phi Gbps':>9s}")
  for r in rows:
    phi = f"{r['phi_kv_gbps']:.2f}" if "phi_kv_gbps" in r else "-"
    print(f"{r['model']:18s} {r['seq_len']:7d} {r['fixed_bytes'] / 2**20:10.1f} "
          f"{r['per_token_bytes']:9d} {r['total_bytes'] / 2**20:10.1f} "
          f"{r['ratio_to_baseline']:8.3f} {phi:>9s}")
  write_json(FLAGS.json_out, rows)


if __name__ == "__main__":
  app.run(main)
