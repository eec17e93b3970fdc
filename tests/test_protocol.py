"""The walltime protocol (hpcrl/protocol.py): names, the context, the stop flag, metrics."""

from hpcrl import protocol

from helpers import protocol_context


def test_the_contract_names():
    assert (protocol.EXIT_COMPLETE, protocol.EXIT_CONTINUE, protocol.EXIT_NOTHING_TO_DO) == (0, 85, 3)
    env = {"HPCRL_RUN_DIR": "/r", "HPCRL_CKPT_DIR": "/c", "HPCRL_SEGMENT": "2", "HPCRL_DEADLINE": "100.5",
           "HPCRL_METRICS": "/m.jsonl"}
    ctx = protocol.Context.from_env(env)
    assert (str(ctx.run_dir), str(ctx.ckpt_dir), ctx.segment, ctx.deadline, str(ctx.metrics_path)) == \
        ("/r", "/c", 2, 100.5, "/m.jsonl")
    assert ctx.seconds_left(now=100.0) == 0.5


def test_context_defaults_by_hand(tmp_path):
    ctx = protocol_context(tmp_path)  # what the segment script sets
    assert ctx.ckpt_dir == tmp_path / "checkpoints" and ctx.metrics_path == tmp_path / protocol.METRICS_FILE
    bare = protocol.Context.from_env({}, default_run_dir=tmp_path)  # run by hand
    assert (bare.ckpt_dir, bare.segment, bare.deadline) == (ctx.ckpt_dir, 1, None)
    assert bare.seconds_left() == float("inf")


def test_the_contract_is_stdlib_only_and_holds_no_store():
    import ast
    import sys

    tree = ast.parse(open(protocol.__file__, encoding="utf-8").read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
    for gone in ("publish_checkpoint", "find_latest_checkpoint", "atomic_write_json", "POINTER_FILE", "fsync_dir"):
        assert not hasattr(protocol, gone), gone


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

    ctx = protocol_context(tmp_path, deadline=time.time() + 10)
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


def test_stop_file_and_exit_file_for_multi_process_launchers(tmp_path):
    env = {"HPCRL_RUN_DIR": str(tmp_path), "HPCRL_STOP_FILE": str(tmp_path / "stop"),
           "HPCRL_EXIT_FILE": str(tmp_path / "exit-code")}
    ctx = protocol.Context.from_env(env)
    stop = protocol.StopFlag(ctx, install=False)
    assert not stop.should_stop() and stop.reason is None
    (tmp_path / "stop").touch()  # what the segment script does on USR1 under torchrun/srun
    assert stop.should_stop() and stop.reason == "SIGUSR1"
    # under the launcher the code travels in the file and the process exits 0
    assert protocol.exit_code_for_launcher(ctx, protocol.EXIT_CONTINUE) == 0
    assert (tmp_path / "exit-code").read_text().strip() == "85"
    assert not list(tmp_path.glob("*.tmp"))
    plain = protocol_context(tmp_path)  # a single process: the code is the exit status itself
    assert protocol.exit_code_for_launcher(plain, protocol.EXIT_CONTINUE) == 85
