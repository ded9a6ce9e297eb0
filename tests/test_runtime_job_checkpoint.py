"""Atomic, verified checkpoints (single process; the multi-process cases run with the trainer; issue 5)."""

from __future__ import annotations

import pytest
import torch

from trainscale.runtime.job.checkpoint import CheckpointManager, committed_steps, latest_good, verify


def _state(seed: float):
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.fill_(seed)
        model.bias.fill_(-seed)
    return model


def test_save_commit_retain_and_load(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        m = _state(float(step))
        mgr.save(step, {"model": m.state_dict()}, {"step": step, "loader": {"pos": step * 10}})
    assert committed_steps(tmp_path) == [2, 3]  # retention: the last 2
    assert not list(tmp_path.glob(".tmp-*"))
    target = _state(0.0)
    sd = target.state_dict()
    step, extras = mgr.load({"model": sd})
    target.load_state_dict(sd)
    assert step == 3 and extras["loader"]["pos"] == 30
    assert torch.equal(target.weight, torch.full((4, 8), 3.0))


def test_corrupt_and_truncated_checkpoints_are_skipped(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=5)
    for step in (5, 10):
        mgr.save(step, {"model": _state(float(step)).state_dict()}, {"step": step})
    shard = next(p for p in (tmp_path / "step-00000010").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip one byte: same size, wrong checksum
    shard.write_bytes(bytes(data))
    assert "checksum mismatch" in verify(tmp_path / "step-00000010")
    messages = []
    step, folder = latest_good(tmp_path, log=messages.append)
    assert step == 5 and "damaged (" in messages[0] and "falling back" in messages[0]
    shard5 = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    shard5.write_bytes(shard5.read_bytes()[:10])
    assert "truncated" in verify(folder)
    assert latest_good(tmp_path, log=messages.append) is None


def test_kill_before_commit_leaves_previous_checkpoint(tmp_path):
    class Killed(Exception):
        pass

    def die(step):
        raise Killed(step)

    mgr = CheckpointManager(tmp_path, keep=3, before_commit=lambda s: die(s) if s == 2 else None)
    mgr.save(1, {"model": _state(1.0).state_dict()}, {"step": 1})
    with pytest.raises(Killed):
        mgr.save(2, {"model": _state(2.0).state_dict()}, {"step": 2})
    assert committed_steps(tmp_path) == [1] and verify(tmp_path / "step-00000001") is None
    # a new manager (the restarted job) cleans the half-written folder and resumes from step 1
    mgr2 = CheckpointManager(tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))
    sd = _state(0.0).state_dict()
    assert mgr2.load({"model": sd})[0] == 1


def test_a_removal_cut_short_never_leaves_a_damaged_committed_checkpoint(tmp_path, monkeypatch):
    """Retention deletes old checkpoints: a kill in the middle of that deletion must leave the checkpoint whole or
    gone, never a committed folder with files missing (found by the chaos test: step-1 with no __0_0.distcp)."""
    import shutil
    from types import SimpleNamespace

    import trainscale.runtime.job.checkpoint as ckpt

    mgr = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2):
        mgr.save(step, {"model": _state(float(step)).state_dict()}, {"step": step})

    def killed_midway(path, ignore_errors=False):  # deletes one file, then the process "dies"
        next(p for p in sorted(path.iterdir()) if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "shutil", SimpleNamespace(rmtree=killed_midway, disk_usage=shutil.disk_usage))
    with pytest.raises(KeyboardInterrupt):
        mgr.save(3, {"model": _state(3.0).state_dict()}, {"step": 3})
    monkeypatch.setattr(ckpt, "shutil", shutil)
    assert committed_steps(tmp_path) == [2, 3]
    assert all(verify(tmp_path / f"step-{s:08d}") is None for s in (2, 3))
    CheckpointManager(tmp_path, keep=2)  # the next start removes what the kill left
    assert not list(tmp_path.glob(".trash-*"))


def test_the_manifest_digests_every_file_each_rank_its_own_and_older_sha256_manifests_verify(tmp_path):
    """Each rank digests the files it wrote (XXH3-128, the oracle here is the xxhash library on the committed
    bytes); rank 0 folds the digests in and removes the per-rank files; a manifest of an earlier version (sha256)
    still verifies, and a flipped byte fails it."""
    import hashlib
    import json

    import xxhash

    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(7, {"model": _state(7.0).state_dict()}, {"step": 7})
    folder = tmp_path / "step-00000007"
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk and not any(n.startswith("digest-rank") for n in on_disk)
    for name, meta in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert meta == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    old = {**manifest, "files": {n: {"bytes": m["bytes"], "sha256": hashlib.sha256((folder / n).read_bytes())
                                     .hexdigest()} for n, m in manifest["files"].items()}}
    (folder / "manifest.json").write_text(json.dumps(old))
    assert verify(folder) is None
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "checksum mismatch" in verify(folder)
