"""`hpcrl eval`: a built-in run's checkpoint, or a model `hpcrl export` wrote, on a held-out file
of verl's schema, with the run's reward and decoding settings (its trainer.json); pass@k from
sampled answers; every answer kept in the samples store's format.

The launcher side (stdlib): which run, checkpoint, data and output directory, checked here in one
line each; the evaluation itself is the trainer side's (`python -m hpcrl.rl.heldout`, torch),
run as a process in the run's own interpreter as the segment script would pick it. On a local
site it runs here; on a cluster it runs here with --local (a login node: the CPU) and otherwise
is printed, to run in an allocation on a compute node (as `hpcrl export` prints a converter).

    RUN/evals/NAME/eval.json              the figures: greedy (the run's own evaluation's), pass@k
    RUN/evals/NAME/samples/step-N.jsonl   every answer (hpcrl samples RUN --eval NAME)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from .errors import HpcrlError
from .export import EXPORT_RECORD, pick_checkpoint
from .runs import Run, RunError
from .shell import command_line
from .venv import path_for as venv_path_for

EVALS_DIR = "evals"  # in the run directory: one directory per evaluation
RESULT_FILE = "eval.json"  # hpcrl/rl/heldout.py writes it
TRAINER_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def run_of(run_id: str | None, model: str | None) -> Run:
    """RUN, or the run an exported --model came from (its export record names it)."""
    if run_id:
        return Run.by_id(run_id)
    if model is None:
        raise HpcrlError("eval: give RUN (its reward and settings are the evaluation's), or --model DIR of an "
                         "`hpcrl export`")
    try:
        record = json.loads((Path(model) / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise HpcrlError(f"--model {model}: no {EXPORT_RECORD} (not written by `hpcrl export`): name the RUN whose "
                         "reward and settings to evaluate it with") from None
    try:
        return Run.by_id(record["run"])
    except (RunError, KeyError):
        run = Run(Path(record.get("run_dir", "")))
        if not run.layout.state.is_file():
            raise HpcrlError(f"--model {model}: its run '{record.get('run')}' is not on this machine; name the RUN "
                             "whose reward and settings to evaluate it with") from None
        return run


def checkpoint_step(text: str | None) -> int | None:
    """--checkpoint STEP|latest as a step (None: the newest complete one)."""
    if text in (None, "latest"):
        return None
    if not text.isdigit():
        raise HpcrlError(f"--checkpoint {text}: give a step number or 'latest'")
    return int(text)


def out_dir(run: Run, out: str | None, data: str | None, model: str | None, step: int) -> Path:
    """--out, or RUN/evals/NAME (the data's stem and the checkpoint's step or the model's name);
    an earlier evaluation's directory is written again, anything else only when empty."""
    if out:
        path = Path(out)
    else:
        stem = Path(data).stem if data else "val"
        path = run.dir / EVALS_DIR / (f"{stem}-{Path(model).resolve().name}" if model else f"{stem}-step{step}")
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / RESULT_FILE).is_file())):
        raise HpcrlError(f"--out {path}: exists and holds no earlier evaluation ({RESULT_FILE}); choose a new "
                         "or empty directory")
    return path


def python_of(resolved: dict) -> str:
    """The trainer's interpreter, as the job picks it (control.check_python): the run's venv, else
    the site's trainer_python or hpcrl_python, else this one."""
    venv = venv_path_for(resolved)
    if venv:
        return os.path.join(venv, "bin", "python")
    site = resolved["site"]
    name = site.get("trainer_python") or site.get("hpcrl_python") or sys.executable
    return shutil.which(name) or name


def plan(run: Run, checkpoint: str | None = None, model: str | None = None, data: str | None = None,
         rows: int | None = None, samples: int = 0, ks: list | None = None, seed: int | None = None,
         out: str | None = None) -> tuple[list[str], dict, Path, int]:
    """(argv, environment, output directory, step) of the evaluation; HpcrlError for a bad input."""
    resolved = json.loads(run.layout.spec.read_text(encoding="utf-8"))
    kind = resolved["spec"]["trainer"]
    if kind != "builtin":
        raise HpcrlError(f"run '{run.id}' uses the {kind} trainer: `hpcrl eval` decodes with the built-in trainer "
                         "and its arguments (args.reward); a verl or MaxText run has its own evaluation (its val "
                         "metrics in metrics.jsonl)")
    config = run.dir / "trainer.json"
    if not config.is_file():
        raise HpcrlError(f"run '{run.id}' has no {config.name}: its arguments are written at submit")
    if checkpoint is not None and model is not None:
        raise HpcrlError("--checkpoint and --model: give one (a checkpoint of the run, or an exported directory)")
    if data is not None and not Path(data).is_file():
        raise HpcrlError(f"--data {data}: no such file")
    if rows is not None and rows < 0:
        raise HpcrlError(f"--rows {rows}: give a number of rows (0: every row)")
    if samples < 0:
        raise HpcrlError(f"--samples {samples}: give a number of answers a prompt (0: greedy only)")
    if ks:
        samples = samples or max(ks)
        if min(ks) < 1 or max(ks) > samples:
            raise HpcrlError(f"--k {max(ks) if min(ks) >= 1 else min(ks)}: pass@k needs 1 <= k <= --samples ({samples})")
    argv = [python_of(resolved), "-m", "hpcrl.rl.heldout", "--config", str(config), "--run-dir", str(run.dir)]
    if model is not None:
        if not (Path(model) / "config.json").is_file():
            raise HpcrlError(f"--model {model}: not a Hugging Face model directory (no config.json); "
                             "`hpcrl export RUN --out DIR` writes one")
        step = _export_step(model)
        argv += ["--model", str(Path(model).resolve())]
    else:
        step, path = pick_checkpoint(run, checkpoint_step(checkpoint), flag="--checkpoint")
        argv += ["--checkpoint", str(path)]
    path = out_dir(run, out, data, model, step)
    argv += ["--out", str(path.resolve()), "--step", str(step)]
    if data is not None:
        argv += ["--data", str(Path(data).resolve())]
    for flag, value in (("--rows", rows), ("--samples", samples or None), ("--seed", seed)):
        if value is not None:
            argv += [flag, str(value)]
    for k in ks or []:
        argv += ["--k", str(k)]
    pkg_parent = str(Path(__file__).resolve().parents[1])  # this hpcrl: the trainer side's heldout is in it
    env = {**{str(k): str(v) for k, v in (resolved["spec"].get("env") or {}).items()}, **TRAINER_ENV,
           "PYTHONPATH": pkg_parent + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    return argv, env, path, step


def _export_step(model: str) -> int:
    try:
        return int(json.loads((Path(model) / EXPORT_RECORD).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def runs_here(run: Run, local: bool) -> bool:
    """Whether to run it on this machine: the run's site is this machine, or --local says so."""
    return local or run.site().get("scheduler") == "local"


def execute(argv: list[str], env: dict) -> int:
    import subprocess

    if not Path(argv[0]).exists() and shutil.which(argv[0]) is None:
        raise HpcrlError(f"{argv[0]} is not on this machine: build the run's venv (`hpcrl venv build --run RUN`) "
                         "or run the printed command where it is")
    return subprocess.run(argv, env={**os.environ, **env}).returncode


def printed(argv: list[str], env: dict) -> str:
    """The command for a compute node, its environment in front."""
    return command_line(["env", *(f"{k}={v}" for k, v in sorted(env.items())), *argv])


def result(path: Path) -> dict:
    return json.loads((path / RESULT_FILE).read_text(encoding="utf-8"))


def runs_own(run: Run, step: int) -> dict | None:
    """The run's own evaluation at `step` (its last record there: eval_after, or a periodic eval)."""
    from .samplestore import json_records

    try:
        records = json_records(run.layout.metrics.read_bytes())
    except OSError:
        return None
    found = [r for r in records if r.get("step") == step and str(r.get("phase", "")).startswith("eval")
             and r.get("phase") != "eval_sft" and "eval/reward_mean" in r]
    return found[-1] if found else None


def differences(own: dict, greedy: dict) -> list[str]:
    """Where the run's recorded evaluation and this one's greedy figures differ, key by key."""
    own = {k: v for k, v in own.items() if k.startswith("eval/")}
    return [f"{k} {own.get(k, '-')} vs {greedy.get(k, '-')}" for k in sorted(set(own) | set(greedy))
            if own.get(k) != greedy.get(k)]


def reward_of(run: Run) -> str:
    return json.loads(run.layout.spec.read_text(encoding="utf-8"))["spec"]["args"].get("reward") or "auto"
