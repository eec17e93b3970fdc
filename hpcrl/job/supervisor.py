"""One supervisor for a foreign trainer's process group: the walltime protocol, spoken for a
trainer that handles no signal of hpcrl's. Stdlib only (it runs in the trainer's interpreter, from
the run's lib/ snapshot).

What every foreign trainer gets from here, once:

- its command line: `--python` (the interpreter that runs it), `--dry-run` (print what would run,
  run nothing), and after `--` the static arguments the batch script shows;
- the segment's facts from the protocol's environment (segment number, deadline, run directory);
- a process group of its own (start_new_session), started only after the handlers are in place
  (a TERM between the two killed the launcher by TERM's default action, seen under load);
- TERM and USR1 turned into requests the subclass acts on at a safe point (`on_term`, `on_usr1`);
- the poll loop (`poll_s`, `poll_once`), then `finish` once the trainer has exited;
- the deadline rule (`next_save_fits`, protocol.next_save_fits: the same one StopFlag uses);
- the exit code: EXIT_CONTINUE when it stopped the trainer for continuation; a trainer's own
  exit 0 is completion only when its last trained step is saved (`unsaved_reason`: otherwise the
  reason goes to the log and to RUN_DIR/ERROR_FILE, and the code is EXIT_UNSAVED_END); a failure's
  code passes through (a death by signal N as 128 + N, as a shell reports it).

A subclass holds only its trainer's knowledge: its arguments (`add_arguments`), its state
(`setup`), the argv it runs (`command`), what to tidy before it starts (`prepare`), how it sees
saves and metrics (`poll_once`), how it stops. hpcrl/job/verl.py and hpcrl/job/maxtext.py are the two today.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcrl import protocol

EXIT_CONTINUE = protocol.EXIT_CONTINUE
EXIT_UNSAVED_END = 1  # a failure: the run must not read COMPLETED without its last steps saved


def segment_of(env) -> int:
    try:
        return max(1, int(env.get(protocol.ENV_SEGMENT) or 1))
    except ValueError:
        return 1


def deadline_of(env) -> float | None:
    try:
        return float(env[protocol.ENV_DEADLINE])
    except (KeyError, ValueError):
        return None


def log(msg: str) -> None:
    print(f"hpcrl: {msg}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs a foreign trainer in its own process group under the walltime protocol (subclass it)."""

    name = "trainer"  # the trainer's name in messages
    poll_s = 1.0  # seconds between polls of the trainer's files
    start_after_term = True  # False: a TERM before the trainer started ends the segment unstarted

    def __init__(self, opts, env: dict, run_dir: Path):
        self.opts, self.env, self.run_dir = opts, env, Path(run_dir)
        self.segment = segment_of(env)
        self.deadline = deadline_of(env)
        self.proc: subprocess.Popen | None = None
        self.request: str | None = None  # "term" | "usr1" | a subclass's own reason to stop
        self.stopped_for_continue = False
        self.setup()
        self.argv = self.command()

    # ------------------------------------------------------------ what a subclass says

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The trainer's own options (the static arguments after `--` are `opts.args`)."""

    @classmethod
    def default_run_dir(cls, opts) -> Path:
        return Path(".")

    def setup(self) -> None:
        """The trainer's own state, before `command` (no side effects: a dry run makes it too)."""

    def command(self) -> list[str]:
        """The trainer's argv for this segment (may add to self.env what the trainer needs)."""
        raise NotImplementedError

    def dry_run_view(self) -> dict:
        return {"argv": self.argv}

    def prepare(self) -> None:
        """Before the trainer starts: tidy what an earlier segment left, read the starting state."""

    def poll_once(self) -> None:
        """Read the trainer's saves and metrics; stop it (setting stopped_for_continue) when due."""

    def finish(self) -> None:
        """After the trainer exited: the last reads."""
        self.poll_once()

    def unsaved_reason(self) -> str | None:
        """The trainer exited 0: why its end is not saved, or None when it is (the run is complete)."""
        return None

    def on_term(self) -> None:
        self.request = "term"

    def on_usr1(self) -> None:
        self.request = "usr1"

    # ------------------------------------------------------------ shared machinery

    def seconds_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def next_save_fits(self, work_s: float, save_s: float, margin_s: float) -> bool:
        """The protocol's deadline rule (protocol.next_save_fits) for this segment."""
        return protocol.next_save_fits(self.seconds_left(), work_s, save_s, margin_s)

    def signal_group(self, sig) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop_group(self, grace_s: float) -> None:
        """TERM the trainer's group, KILL it if it is not gone within grace_s."""
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.proc.wait()

    def _on_signal(self, signum, frame):
        self.on_term() if signum == signal.SIGTERM else self.on_usr1()

    def run(self) -> int:
        # Handlers first: a TERM or USR1 from the batch shell just as the segment starts must not
        # kill the launcher (their default actions) or be lost before the trainer exists. USR1
        # gets a handler, not SIG_IGN, which the trainer would inherit across exec.
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGUSR1, self._on_signal)
        if self.request == "term" and not self.start_after_term:
            return 128 + signal.SIGTERM
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
        if self.request == "term":  # came before the trainer existed: it gets it now
            self.on_term()
        while self.proc.poll() is None:
            time.sleep(self.poll_s)
            self.poll_once()
        self.finish()
        return self.exit_code()

    def exit_code(self) -> int:
        if self.stopped_for_continue:
            return EXIT_CONTINUE
        rc = self.proc.returncode
        if rc == 0:
            reason = self.unsaved_reason()
            if reason is None:
                return 0
            log(reason)
            protocol.report_error(self.run_dir, reason)
            return EXIT_UNSAVED_END
        return rc if rc >= 0 else 128 - rc

    # ------------------------------------------------------------ the job's entry point

    @classmethod
    def parse_args(cls, argv):
        p = argparse.ArgumentParser(prog=f"python -m {cls.__module__}",
                                    description=(sys.modules[cls.__module__].__doc__ or "").splitlines()[0])
        p.add_argument("--python", required=True, help=f"interpreter that runs {cls.name}")
        p.add_argument("--dry-run", action="store_true", help=f"print the {cls.name} argv, run nothing")
        cls.add_arguments(p)
        p.add_argument("args", nargs="*", help="the static arguments (after --)")
        return p.parse_args(argv)

    @classmethod
    def main(cls, argv=None) -> int:
        opts = cls.parse_args(sys.argv[1:] if argv is None else argv)
        env = dict(os.environ)
        sup = cls(opts, env, Path(env.get(protocol.ENV_RUN_DIR) or cls.default_run_dir(opts)))
        log("running " + " ".join(sup.argv))
        if opts.dry_run:
            print(json.dumps(sup.dry_run_view()))
            return 0
        sup.prepare()
        return sup.run()
