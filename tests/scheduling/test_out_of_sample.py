"""Table 6 out of sample (issue 12): each variant reads only the cells it is fitted to.

Negative controls: a variant's predictions must not move when the cells it claims to
predict are changed in the table it fits to, and must move when a fitted cell changes
(so the perturbation would be noticed); the old fit-all variant fails the first check.
"""

from __future__ import annotations

import copy

import pytest

from paas_jax.scheduling import case_study as cs
from paas_jax.scheduling import out_of_sample as oos


def _perturbed(column: str, theta_pdd: float) -> dict:
  table = copy.deepcopy(cs.PAPER_TABLE6)
  row = table[column]
  row["theta"] = (*row["theta"][:2], theta_pdd)
  return table


def _held_out_scrambled() -> dict:
  """Every cell of the PrfaaS-PD and naive columns replaced by nonsense."""
  table = copy.deepcopy(cs.PAPER_TABLE6)
  for col in ("prfaas_pd", "naive"):
    row = table[col]
    for k, v in row.items():
      if isinstance(v, (int, float)):
        row[k] = 7.7 * v + 1.0
    row["theta"] = tuple(None if v is None else 9.9 * v for v in row["theta"])
  return table


def _inputs(case: cs.CaseStudy) -> tuple:
  s = case.system
  return (s.pdp_profile.prefill_seconds, s.decode_profile.max_batch_size,
          s.decode_profile.step_seconds)


@pytest.mark.parametrize("variant", ["fitted", "first_principles"])
def test_held_out_columns_are_never_read(variant):
  kw = oos.VARIANTS[variant]
  assert _inputs(cs.build_case_study(**kw)) == _inputs(
      cs.build_case_study(table=_held_out_scrambled(), **kw))


def test_a_fitted_cell_does_move_the_model():
  kw = oos.VARIANTS["fitted"]
  base = cs.build_case_study(**kw)
  moved = cs.build_case_study(table=_perturbed("homogeneous", 2 * 2.35), **kw)
  assert moved.system.decode_profile.max_batch_size == 2 * base.system.decode_profile.max_batch_size


def test_fit_all_reads_the_column_it_claims_to_reproduce():
  # The control that shows the check above can fail: the old fit on all three
  # Theta_pdd moves when the PrfaaS-PD cell it "reproduces" moves.
  kw = oos.VARIANTS["fit_all"]
  assert _inputs(cs.build_case_study(**kw)) != _inputs(
      cs.build_case_study(table=_perturbed("prfaas_pd", 3 * 3.91), **kw))


def test_prediction_is_not_the_fitted_value():
  # With the PrfaaS-PD Theta_pdd set to 30 in the table the model fits to, the
  # out-of-sample prediction stays N_d * BS_max / (T_decode * L_out) = 5 * 20 / 25.6.
  case = cs.build_case_study(table=_perturbed("prfaas_pd", 30.0), **oos.VARIANTS["fitted"])
  pred = 5 * case.system.decode_profile.requests_per_second(cs.OUTPUT_TOKENS)
  assert pred == pytest.approx(3.906, abs=1e-3) and pred != 30.0
  loo = oos.bs_max_leave_one_out(_perturbed("prfaas_pd", 30.0))
  assert loo["prfaas_pd"]["theta_pdd_predicted"] == pytest.approx(3.906, abs=1e-3)
  assert loo["naive"]["theta_pdd_predicted"] != pytest.approx(6.25, rel=0.1)  # fitted on 30


def test_roofline_ratio_from_spec_sheets():
  assert cs.roofline_time_ratio() == pytest.approx(989.4 / 148.0)
  assert cs.roofline_time_ratio(1.0) == pytest.approx(4.8 / 4.0)
  mid = [cs.roofline_time_ratio(i) for i in (10.0, 37.0, 100.0, 206.2, 1e4)]
  assert all(b >= a - 1e-12 for a, b in zip(mid, mid[1:])) and mid[0] == pytest.approx(1.2) and mid[-1] == pytest.approx(6.685, 1e-3)
  with pytest.raises(ValueError):
    cs.roofline_time_ratio(0.0)
  case = cs.build_case_study(h20_method="roofline")
  h200, h20 = case.system.prfaas_profile, case.system.pdp_profile
  assert h20.prefill_seconds == pytest.approx([cs.roofline_time_ratio() * t
                                               for t in h200.prefill_seconds])


def test_compare_marks_cells_and_predicts_the_prfaas_column():
  r = oos.compare(threshold_step=400.0)
  cells = r["cells"]
  assert cells["prfaas_pd.theta_pdd"]["fitted"]["status"] == "predicted"
  assert cells["prfaas_pd.theta_pdd"]["fit_all"]["status"] == "fitted"
  assert cells["homogeneous.theta_pdp"]["fitted"]["status"] == "fitted"
  assert cells["homogeneous.theta_pdp"]["first_principles"]["status"] == "predicted"
  assert cells["prfaas_pd.ratio_vs_homogeneous"]["fitted"]["status"] == "fitted_denominator"
  fitted = {k: v["fitted"] for k, v in cells.items()}
  # The reproduction claim, out of sample: the PrfaaS-PD column within 6%, its split exact.
  assert fitted["prfaas_pd.n"]["value"] == [4, 3, 5]
  for key in ("lambda_max", "theta_prfaas", "theta_pdp", "theta_pdd", "threshold_tokens",
              "ratio_vs_naive"):
    assert abs(fitted[f"prfaas_pd.{key}"]["rel_err"]) < 0.06, key
  # First principles contradicts Table 6 (the 3.04x, t = 11.7K).
  fp = {k: v["first_principles"]["value"] for k, v in cells.items()}
  assert fp["prfaas_pd.ratio_vs_homogeneous"] == pytest.approx(3.04, abs=0.03)
  assert 11_000 <= fp["prfaas_pd.threshold_tokens"] <= 12_400
  s = r["summary"]
  assert s["fitted"]["predicted_cells"] > s["fit_all"]["predicted_cells"]
  assert "prfaas_pd.theta_pdd" in s["fit_all"]["fitted_cells"]
  assert "prfaas_pd.theta_pdd" not in s["fitted"]["fitted_cells"]
