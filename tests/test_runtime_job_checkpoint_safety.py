"""Reading a checkpoint or run folder never runs code, whoever made it (issue 16). Each crafted folder
carries a manifest whose sizes and sha256 match, so only the format checks stand between it and
the loader; a marker file that the payload would create must stay absent."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from trainscale.errors import TrainscaleError
from trainscale.runtime.job.checkpoint import MANIFEST, CheckpointManager, latest_good, read_metadata, verify


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model(fill: float) -> torch.nn.Module:
    m = torch.nn.Linear(8, 4)
    with torch.no_grad():
        m.weight.fill_(fill)
        m.bias.fill_(-fill)
    return m


def _reseal(folder: Path) -> None:
    """Rewrite the manifest so that every file's size and sha256 match again (as an attacker would)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for p in folder.iterdir():
        if p.is_file() and p.name != MANIFEST:
            manifest["files"][p.name] = {"bytes": p.stat().st_size,
                                         "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert verify(folder) is None


RNG = torch.Generator().manual_seed(7).get_state()


def _saved(tmp: Path, extra_state: dict | None = None) -> tuple[CheckpointManager, Path]:
    mgr = CheckpointManager(tmp / "ckpt", run_id="run-a")
    state = {"model": _model(1.0).state_dict(), **(extra_state or {})}
    mgr.save(1, state, {"step": 1, "loader": {"batches": 1}, "rng": RNG})
    return mgr, tmp / "ckpt" / "step-00000001"


def _load(mgr: CheckpointManager, **extra) -> tuple[int, dict]:
    return mgr.load({"model": _model(0.0).state_dict(), **extra}, log=lambda _m: None)


def test_extras_are_json_and_roundtrip_the_rng(tmp_path):
    mgr, folder = _saved(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "extras-rank00000.json",
                                                        "manifest.json"]
    step, extras = _load(mgr)
    assert step == 1 and extras["loader"] == {"batches": 1}
    assert extras["rng"].dtype == torch.uint8 and torch.equal(extras["rng"], RNG)


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    mgr, folder = _saved(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _reseal(folder)
    with pytest.raises(TrainscaleError) as e:
        _load(mgr)
    msg = str(e.value)
    assert "\n" not in msg and "is refused" in msg and "system" in msg, msg
    assert not marker.exists()


def test_metadata_pointing_outside_the_folder_is_refused(tmp_path):
    mgr, folder = _saved(tmp_path)
    md = read_metadata(folder)
    for info in md.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(folder)
    with pytest.raises(TrainscaleError, match="points outside the folder"):
        _load(mgr)


def test_crafted_extras_are_refused_and_run_nothing(tmp_path):
    marker = tmp_path / "pwned"
    mgr, folder = _saved(tmp_path)
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)  # the old format: a pickle torch.load(weights_only=False) would run
    (folder / "extras-rank00000.json").write_bytes(buf.getvalue())
    (folder / "extras-rank00000.pt").write_bytes(buf.getvalue())  # never read at all
    _reseal(folder)
    with pytest.raises(TrainscaleError, match="are not valid JSON") as e:
        _load(mgr)
    assert "\n" not in str(e.value) and not marker.exists()


def test_crafted_non_tensor_value_in_the_shards_is_refused(tmp_path):
    """DCP stores non-tensor values (optimizer hyper-parameters) with torch.save; they are read with
    weights_only=True, so an object in their place is refused."""
    marker = tmp_path / "pwned"
    mgr, folder = _saved(tmp_path, {"extra": Payload(marker)})
    assert not marker.exists()
    with pytest.raises(TrainscaleError, match="cannot be loaded") as e:
        _load(mgr, extra=None)
    assert "\n" not in str(e.value) and not marker.exists()


def test_manifest_names_are_confined_to_their_folder(tmp_path):
    _, folder = _saved(tmp_path)
    manifest = json.loads((folder / MANIFEST).read_text())
    for name in ("/dev/zero", "../outside", "sub/file"):
        bad = {**manifest, "files": {**manifest["files"], name: {"bytes": 0, "sha256": "0" * 64}}}
        (folder / MANIFEST).write_text(json.dumps(bad))
        assert "outside its folder" in verify(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    os.mkfifo(folder / "fifo")
    fifo = {**manifest, "files": {**manifest["files"], "fifo": {"bytes": 0, "sha256": "0" * 64}}}
    (folder / MANIFEST).write_text(json.dumps(fifo))
    assert verify(folder) == "fifo is not a regular file"  # never opened: a FIFO would block the read


def test_another_runs_checkpoint_is_never_loaded(tmp_path):
    mgr, _ = _saved(tmp_path)
    other = CheckpointManager(tmp_path / "ckpt", run_id="run-b")
    said: list[str] = []
    assert latest_good(tmp_path / "ckpt", log=said.append, run_id="run-b") is None
    assert "written by another run (run-a, not run-b)" in said[0]
    assert other.load({"model": _model(0.0).state_dict()}, log=lambda _m: None) is None
    assert _load(mgr)[0] == 1
