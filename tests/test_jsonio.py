"""autoaccum.jsonio: the one atomic JSON writer (probe cache, search plan files)."""

from __future__ import annotations

import json
import os

import pytest

import autoaccum.jsonio as jsonio
from autoaccum.jsonio import write_json_atomic


def test_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "sub" / "x.json"
    write_json_atomic(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})  # fails half-way through writing
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(path.parent) == ["x.json"]  # no temporary file left behind


def test_atomic_write_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else str(fd))
        real_fsync(fd)

    monkeypatch.setattr(jsonio.os, "fsync", recording_fsync)
    path = write_json_atomic(tmp_path / "plan.json", {"plan": 1})
    assert path == tmp_path / "plan.json"
    if os.name == "posix":
        # the temporary file, then the folder that holds the rename
        assert len(synced) == 2 and synced[-1] == str(tmp_path)
