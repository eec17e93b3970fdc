"""hpcrl's checkpoint store (hpcrl/checkpoints/store.py, stdlib): seal, find, prune, verify."""

import json
import shutil
import threading

from hpcrl.checkpoints import store as ckpt_store
from hpcrl.checkpoints.store import CheckpointStore

from helpers import flip_bit, publish_checkpoint


def test_publish_writes_manifest_pointer_and_prunes(tmp_path):
    for step in (10, 20, 30, 40):
        publish_checkpoint(tmp_path, step)
    store = CheckpointStore(tmp_path)
    assert [s for s, _ in store.list()] == [20, 30, 40]
    assert (tmp_path / "LATEST").read_text() == "step-00000040\n"
    assert store.latest_step() == 40
    manifest = json.loads((tmp_path / "step-00000040" / "MANIFEST.json").read_text())
    assert manifest["files"]["weights.bin"] == {ckpt_store.digest_algorithm(): ckpt_store.file_digest(
        tmp_path / "step-00000040" / "weights.bin"), "size": 1000}
    assert manifest["step"] == 40 and isinstance(manifest["time"], float)


def test_names_and_the_pointer_without_a_pointer_file(tmp_path):
    assert ckpt_store.checkpoint_name(7) == "step-00000007"
    assert ckpt_store.checkpoint_step_of(tmp_path / "step-00000007") == 7
    assert ckpt_store.checkpoint_step_of(".tmp-abc") is None and ckpt_store.checkpoint_step_of("step-7") is None
    store = CheckpointStore(tmp_path / "none")
    assert store.list() == [] and store.latest_step() is None and store.find_latest() is None
    publish_checkpoint(tmp_path, 3)
    (tmp_path / "LATEST").unlink()
    assert CheckpointStore(tmp_path).latest_step() == 3  # falls back to the newest directory


def test_truncated_newest_checkpoint_falls_back_with_warning(tmp_path):
    publish_checkpoint(tmp_path, 10)
    newest = publish_checkpoint(tmp_path, 20)
    with open(newest / "weights.bin", "r+b") as f:
        f.truncate(10)
    warnings = []
    step, path = CheckpointStore(tmp_path, warn=warnings.append).find_latest()
    assert step == 10 and path.name == "step-00000010"
    assert len(warnings) == 1 and "weights.bin" in warnings[0] and "10 bytes" in warnings[0]


def test_corrupt_bytes_same_size_detected_by_checksum(tmp_path):
    publish_checkpoint(tmp_path, 10)
    newest = publish_checkpoint(tmp_path, 20)
    flip_bit(newest / "weights.bin")
    store = CheckpointStore(tmp_path, warn=lambda m: None)
    assert store.find_latest()[0] == 10
    assert store.find_latest(deep=False)[0] == 20  # sizes only
    assert "fails its" in ckpt_store.verify_checkpoint(newest)


def test_unsealed_temp_dir_is_ignored_and_pruned(tmp_path):
    publish_checkpoint(tmp_path, 10)
    torn = CheckpointStore(tmp_path).new_tmp_dir()
    (torn / "weights.bin").write_bytes(b"half")
    assert torn.name.startswith(".tmp-")
    assert CheckpointStore(tmp_path).find_latest()[0] == 10
    publish_checkpoint(tmp_path, 20)
    assert not torn.exists()


def test_resave_of_the_same_step_replaces_it(tmp_path):
    publish_checkpoint(tmp_path, 10, {"a.bin": b"old"})
    publish_checkpoint(tmp_path, 10, {"a.bin": b"new!"})
    assert (tmp_path / "step-00000010" / "a.bin").read_bytes() == b"new!"
    assert not list(tmp_path.glob(".tmp-*"))


def test_background_prune_deletes_only_what_it_doomed(tmp_path, monkeypatch):
    """Old checkpoints leave their step-N name at once (renamed aside), are deleted in a thread
    that the store holds, and a save that starts meanwhile keeps its temporary directory."""
    for step in (10, 20):
        publish_checkpoint(tmp_path, step)
    gate = threading.Event()
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: (gate.wait(10), real_rmtree(*a, **k)))
    store, other = CheckpointStore(tmp_path, keep_last=1), CheckpointStore(tmp_path, keep_last=1)
    tmp = store.new_tmp_dir()
    (tmp / "weights.bin").write_bytes(b"z" * 10)
    store.publish(tmp, 30, prune_in_background=True)
    assert [s for s, _ in store.list()] == [30]  # before any byte is deleted
    assert len(list(tmp_path.glob(".tmp-old-*"))) == 2
    next_save = store.new_tmp_dir()  # the next save starts while deleting
    (next_save / "weights.bin").write_bytes(b"w")
    assert other.wait_for_pruning(timeout=0.05) is True  # another store has no deletions of its own
    assert store.wait_for_pruning(timeout=0.05) is False  # still blocked
    gate.set()
    assert store.wait_for_pruning(timeout=10) is True
    assert list(tmp_path.glob(".tmp-*")) == [next_save] and (next_save / "weights.bin").exists()


def test_manifest_entries_name_their_algorithm(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    entry = ckpt_store.write_manifest(tmp_path)["files"]["f"]
    assert ckpt_store.entry_algorithm(entry) == ckpt_store.digest_algorithm() in ("xxh3_128", "sha256")
    assert ckpt_store.read_manifest(tmp_path)["files"]["f"] == entry
    sha = ckpt_store.file_digest(tmp_path / "f", "sha256")
    assert sha == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    (tmp_path / ckpt_store.MANIFEST_FILE).write_text(json.dumps({"files": {"f": {"sha256": sha, "size": 3}}}))
    assert ckpt_store.verify_checkpoint(tmp_path) is None  # an older manifest's algorithm still checks
