"""common.write_text_atomic: a writer that dies mid-write leaves the old content
(the Ray actor's pins and restart count are read back by its restarted self)."""

from __future__ import annotations

import json
import pathlib

import pytest

from paas_jax.serving.common import write_text_atomic


class _Killed(Exception):
  pass


def _dies_half_way(monkeypatch):
  """Path.write_text writes half of the text, then the writer is 'killed'."""
  real = pathlib.Path.write_text

  def half_then_die(self, text, *args, **kwargs):
    real(self, text[:len(text) // 2], *args, **kwargs)
    raise _Killed()

  monkeypatch.setattr(pathlib.Path, "write_text", half_then_die)


def _naive_write(path, text):
  pathlib.Path(path).write_text(text)


@pytest.mark.parametrize("writer, intact", [(write_text_atomic, True), (_naive_write, False)],
                         ids=["atomic", "negative_control_in_place"])
def test_a_writer_killed_mid_write_leaves_the_old_content(tmp_path, monkeypatch, writer, intact):
  path = tmp_path / "relay.pins.json"
  old = json.dumps({"--port": 4242, "--data_plane_port": 4243})
  write_text_atomic(path, old)
  _dies_half_way(monkeypatch)
  with pytest.raises(_Killed):
    writer(path, json.dumps({"--port": 5252, "--data_plane_port": 5253}))
  monkeypatch.undo()
  if intact:
    assert json.loads(path.read_text()) == json.loads(old)
  else:  # written in place: what a restarted actor found (JSONDecodeError)
    with pytest.raises(json.JSONDecodeError):
      json.loads(path.read_text())


def test_writes_and_replaces(tmp_path):
  path = tmp_path / "sub" / "relay.restarts"
  write_text_atomic(path, "1")
  write_text_atomic(path, "2")
  assert path.read_text() == "2"
  assert [p.name for p in path.parent.iterdir()] == ["relay.restarts"]
