"""The walltime protocol's checkpoint and metrics helpers (stdlib, shared by every trainer)."""

import json

from hpcrl import protocol


def _save(ckpt_dir, step, payload=b"x" * 1000):
    tmp = protocol.new_checkpoint_dir(ckpt_dir)
    (tmp / "weights.bin").write_bytes(payload)
    return protocol.publish_checkpoint(ckpt_dir, tmp, step, keep_last=3)


def test_publish_writes_manifest_pointer_and_prunes(tmp_path):
    for step in (10, 20, 30, 40):
        _save(tmp_path, step)
    assert [s for s, _ in protocol.list_checkpoints(tmp_path)] == [20, 30, 40]
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000040"
    assert protocol.latest_checkpoint_step(tmp_path) == 40
    manifest = json.loads((tmp_path / "step-00000040" / "MANIFEST.json").read_text())
    assert manifest["files"]["weights.bin"]["size"] == 1000 and manifest["step"] == 40


def test_truncated_newest_checkpoint_falls_back_with_warning(tmp_path):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    with open(newest / "weights.bin", "r+b") as f:
        f.truncate(10)
    warnings = []
    step, path = protocol.find_latest_checkpoint(tmp_path, warn=warnings.append)
    assert step == 10 and path.name == "step-00000010"
    assert len(warnings) == 1 and "weights.bin" in warnings[0]


def test_corrupt_bytes_same_size_detected_by_checksum(tmp_path):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    (newest / "weights.bin").write_bytes(b"y" * 1000)
    assert protocol.find_latest_checkpoint(tmp_path, warn=lambda m: None)[0] == 10


def test_unsealed_temp_dir_is_ignored_and_pruned(tmp_path):
    _save(tmp_path, 10)
    torn = protocol.new_checkpoint_dir(tmp_path)
    (torn / "weights.bin").write_bytes(b"half")
    assert protocol.find_latest_checkpoint(tmp_path)[0] == 10
    _save(tmp_path, 20)
    assert not torn.exists()


def test_background_prune_deletes_only_what_it_doomed(tmp_path, monkeypatch):
    """Old checkpoints leave their step-N name at once (renamed aside), are deleted in a thread,
    and a save that starts meanwhile keeps its temporary directory."""
    import shutil
    import threading

    for step in (10, 20):
        _save(tmp_path, step)
    gate = threading.Event()
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: (gate.wait(10), real_rmtree(*a, **k)))
    tmp = protocol.new_checkpoint_dir(tmp_path)
    (tmp / "weights.bin").write_bytes(b"z" * 10)
    protocol.publish_checkpoint(tmp_path, tmp, 30, keep_last=1, prune_in_background=True)
    assert [s for s, _ in protocol.list_checkpoints(tmp_path)] == [30]  # before any byte is deleted
    assert len(list(tmp_path.glob(".tmp-old-*"))) == 2
    next_save = protocol.new_checkpoint_dir(tmp_path)  # the next save starts while deleting
    (next_save / "weights.bin").write_bytes(b"w")
    assert protocol.wait_for_pruning(timeout=0.05) is False  # still blocked
    gate.set()
    assert protocol.wait_for_pruning(timeout=10) is True
    assert list(tmp_path.glob(".tmp-*")) == [next_save] and (next_save / "weights.bin").exists()


def test_read_last_metrics_skips_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    protocol.append_metrics(path, {"step": 1, "loss": 2.0})
    protocol.append_metrics(path, {"step": 2, "reward_mean": 0.5})
    with open(path, "a") as f:
        f.write('{"step": 3, "los')
    assert protocol.read_last_metrics(path) == {"step": 2, "reward_mean": 0.5}
    assert protocol.read_last_metrics(path, key="loss")["step"] == 1


def test_stop_flag_deadline(tmp_path):
    import time

    ctx = protocol.Context(tmp_path, tmp_path / "c", 1, time.time() + 10, tmp_path / "m")
    stop = protocol.StopFlag(ctx, margin_s=2, install=False)
    assert not stop.should_stop(next_step_s=1)
    assert stop.should_stop(next_step_s=9)
    stop.usr1 = True
    assert stop.should_stop() and stop.reason == "SIGUSR1"


def test_signals_are_ignored_once_the_trainer_exits():
    # A USR1 that arrives while Python shuts down would otherwise kill a trainer that already
    # saved and chose exit 85. The check runs after StopFlag's own exit hook (atexit is LIFO).
    import subprocess
    import sys

    code = ("import atexit, os, signal, sys\n"
            "def late():\n"
            "    ok = signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN\n"
            "    os.kill(os.getpid(), signal.SIGUSR1); os.kill(os.getpid(), signal.SIGTERM)\n"
            "    print('ignored' if ok else 'handled', flush=True)\n"
            "atexit.register(late)\n"
            "from hpcrl import protocol\n"
            "protocol.StopFlag(protocol.Context.from_env())\n"
            "sys.exit(85)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 85 and proc.stdout.strip() == "ignored", (proc.returncode, proc.stdout, proc.stderr)
