"""Orbax checkpoints (save, sharded restore), the import / generate CLIs, and errors."""

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx, traverse_util
from jax.sharding import Mesh, PartitionSpec
from safetensors.numpy import load_file, save_file

from paas_jax.checkpoints import (HFImportError, checkpoint_metadata, hf_model_config,
                                  import_hf, load_checkpoint, save_checkpoint)
from paas_jax.models import api
from tests.checkpoints.hf_tiny import PROMPTS, relative_error


def _flat(model: api.Model) -> dict:
  return traverse_util.flatten_dict(nnx.to_pure_dict(model.params))


def test_save_and_load_round_trip(tiny_models, tmp_path):
  tiny = tiny_models["kimi_linear"]
  path = save_checkpoint(tiny.imported.model, tmp_path / "ckpt", tiny.imported.tokenizer_json,
                         metadata=tiny.imported.metadata)
  model, tokenizer = load_checkpoint(path)
  assert model.config == tiny.imported.model.config
  want, got = _flat(tiny.imported.model), _flat(model)
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key))
  assert tokenizer.encode(PROMPTS[0]).ids == tiny.imported.tokenizer.encode(PROMPTS[0]).ids
  meta = checkpoint_metadata(path)
  assert meta["source"]["architecture"] == "KimiLinearForCausalLM"
  assert meta["eos_token_ids"] == [2]
  with pytest.raises(ValueError, match="already exists"):
    save_checkpoint(model, path)


def test_restore_sharded_over_8_devices_matches_unsharded(tiny_models, tmp_path):
  assert jax.device_count() == 8, "tests/conftest.py sets 8 host devices"
  tiny = tiny_models["qwen3_next"]
  path = save_checkpoint(tiny.imported.model, tmp_path / "ckpt")
  mesh = Mesh(np.array(jax.devices()), ("tp",))
  model, tokenizer = load_checkpoint(path, mesh=mesh)
  assert tokenizer is None  # saved without one
  params = _flat(model)
  spec = {".".join(map(str, k)): v.sharding.spec for k, v in params.items()}
  assert spec["embed.embedding"] == PartitionSpec("tp", None)        # vocabulary
  assert spec["lm_head.kernel"] == PartitionSpec(None, "tp")
  assert spec["blocks.0.mixer.q_proj.kernel"] == PartitionSpec(None, "tp")  # column
  assert spec["blocks.0.mixer.o_proj.kernel"] == PartitionSpec("tp", None)  # row
  assert spec["blocks.0.ffn.w_up"] == PartitionSpec(None, None, "tp")  # 4 experts < 8
  assert spec["final_norm.scale"] == PartitionSpec()
  for key, x in params.items():
    assert len(x.sharding.device_set) == 8, key
  # A Hugging Face directory loads the same way, imported on the fly.
  direct, direct_tokenizer = load_checkpoint(tiny.hf_dir, mesh=mesh)
  assert direct_tokenizer is not None
  for key, x in _flat(direct).items():
    assert x.sharding == params[key].sharding, key
    np.testing.assert_array_equal(np.asarray(x), np.asarray(params[key]), err_msg=str(key))
  prompt = tiny.prompts[0]
  logits, state = api.prefill(model, prompt)
  assert relative_error(logits[0], tiny.hf_logits(prompt)) <= 1e-4
  step, _ = api.decode_step(model, state, [5])
  assert relative_error(step[0], tiny.hf_logits(prompt + [5])[-1]) <= 1e-4


def _run(args, **kw):
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                        timeout=600, **kw)


def test_import_cli_then_generate_cli_with_text_prompt(tiny_models, tmp_path):
  tiny = tiny_models["kimi_linear"]
  out = tmp_path / "kimi_ckpt"
  done = _run(["paas_jax.tools.import_hf", f"--hf_dir={tiny.hf_dir}", f"--out={out}"])
  assert done.returncode == 0, done.stderr
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  assert summary["architecture"] == "KimiLinearForCausalLM" and summary["tokenizer"]
  assert summary["layers"] == "GMGM"

  n = 10
  done = _run(["paas_jax.generate", f"--checkpoint={out}", f"--prompt={PROMPTS[1]}",
               f"--max_new_tokens={n}", "--json"])
  assert done.returncode == 0, done.stderr
  result = json.loads(done.stdout.strip().splitlines()[-1])
  prompt = tiny.imported.tokenizer.encode(PROMPTS[1]).ids
  assert result["prompt_ids"] == prompt
  assert result["tokens"] == tiny.hf_greedy(prompt, n)
  assert result["text"] == tiny.imported.tokenizer.decode(result["tokens"])


def test_import_cli_reports_errors_without_traceback(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                    "architectures": ["LlamaForCausalLM"]}))
  done = _run(["paas_jax.tools.import_hf", f"--hf_dir={tmp_path}", f"--out={tmp_path / 'o'}"])
  assert done.returncode == 2
  assert "LlamaForCausalLM" in done.stderr and "Traceback" not in done.stderr


def test_unsupported_architecture_is_named():
  with pytest.raises(HFImportError, match=r"unsupported architecture.*'gpt2'.*kimi_linear"):
    hf_model_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_missing_tensors_are_named(tiny_models, tmp_path):
  tiny = tiny_models["nemotron_h"]
  broken = tmp_path / "broken"
  shutil.copytree(tiny.hf_dir, broken)
  tensors = load_file(broken / "model.safetensors")
  dropped = ["backbone.layers.0.mixer.conv1d.bias", "backbone.layers.3.mixer.gate.weight"]
  for name in dropped:
    del tensors[name]
  save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(HFImportError, match="lacks 2 tensor") as err:
    import_hf(broken)
  for name in dropped:
    assert name in str(err.value)


@pytest.mark.parametrize("family, change, message", [
    ("qwen3_next", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}},
     "rope_type 'yarn'"),
    ("nemotron_h", {"layers_block_type": ["mlp", "linear_attention"]},
     r"block 0 \(mlp\) does not follow a mixer"),
    ("nemotron_h", {"moe_latent_size": 16}, "moe_latent_size"),
    ("kimi_linear", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_options_are_named(tiny_models, family, change, message):
  hf = json.loads((tiny_models[family].hf_dir / "config.json").read_text())
  hf.update(change)
  with pytest.raises(HFImportError, match=message):
    hf_model_config(hf)


def test_sharded_checkpoint_on_disk_is_plain_orbax(tiny_models, tmp_path):
  """The parameters are an ordinary Orbax tree keyed by dotted parameter path."""
  import orbax.checkpoint as ocp
  path = save_checkpoint(tiny_models["nemotron_h"].imported.model, tmp_path / "c")
  tree = ocp.StandardCheckpointer().metadata(pathlib.Path(path) / "params")
  keys = set(getattr(tree, "item_metadata", tree).keys())
  assert "embed.embedding" in keys and "blocks.1.ffn.w_up" in keys
