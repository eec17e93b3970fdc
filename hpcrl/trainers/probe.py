"""What a job would trip on at its start, asked at submit of the job's own interpreter.

A reward file that imports a missing module, a parquet without the prompt column, a verl run
asking more steps than its data holds: each failed a whole segment (on Slurm, after a queue wait)
and then the next one the same way. At submit the job's interpreter exists on this machine (the
venv is built on the login side, or it is hpcrl's own or site.trainer_python), and on the sites
where it does the job sees this machine's files, so the checks run here, in that interpreter:
`probe` imports the reward files and reads the parquet footers there (pyarrow: the trainer's
dependency, not the launcher's), and the adapter turns the facts into one-line SpecErrors.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecError

MARK = "HPCRL-PROBE "  # the probe's answer line (a reward module may print on import)

# Run in the job's interpreter: stdlib, plus pyarrow when it has it. The user's reward module is
# imported as the trainer imports it (hpcrl/rl/rewards.py: by path), with the job's environment.
_SCRIPT = r'''
import importlib.util, json, sys
ask = json.loads(sys.argv[1])
out = {"rewards": [], "tables": []}
for path, func in ask["rewards"]:
    try:
        # from the source, never a __pycache__: a file edited within the second at the same size
        # would otherwise run its old bytecode (and submit would leave a cache in the user's folder)
        spec = importlib.util.spec_from_file_location("hpcrl_submit_check_reward", path)
        mod = importlib.util.module_from_spec(spec)
        with open(path, "rb") as src:
            exec(compile(src.read(), path, "exec"), mod.__dict__)
        out["rewards"].append(None if callable(getattr(mod, func, None)) else "defines no function %r" % func)
    except BaseException as e:
        out["rewards"].append("%s: %s" % (type(e).__name__, " ".join(str(e).split())[:200]))
try:
    import pyarrow.parquet as pq
except ImportError:
    pq = None
for path in ask["tables"]:
    if pq is None:
        out["tables"].append(None)
        continue
    try:
        f = pq.ParquetFile(path)
        out["tables"].append({"rows": f.metadata.num_rows, "columns": list(f.schema_arrow.names)})
    except Exception as e:
        out["tables"].append({"error": "%s: %s" % (type(e).__name__, " ".join(str(e).split())[:200])})
print("HPCRL-PROBE " + json.dumps(out))
'''


@dataclass
class Facts:
    """The probe's answers, in the order asked: per reward file an error or None; per table its
    rows and columns, {"error": ...}, or None when the interpreter cannot read parquet."""

    rewards: list = field(default_factory=list)
    tables: list = field(default_factory=list)


def expand(value: str, env: dict) -> Path | None:
    """A path as the job will expand it ($SCRATCH/..., ~), or None when a variable stays unknown
    here (then the job's own check is the only one)."""
    text = str(value)
    for key, val in env.items():
        text = text.replace("${" + key + "}", str(val)).replace("$" + key, str(val))
    text = os.path.expandvars(text)
    return None if "$" in text else Path(text).expanduser()


def probe(python: str, env: dict, rewards: list[tuple[str, str]], tables: list[str]) -> Facts | None:
    """Ask `python` (cwd /: the job runs in its run directory, not where submit was typed). None
    when it cannot answer (the interpreter itself is checked by control.check_trainer_python)."""
    if not rewards and not tables:
        return Facts()
    ask = json.dumps({"rewards": [list(r) for r in rewards], "tables": list(tables)})
    try:
        out = subprocess.run([python, "-B", "-c", _SCRIPT, ask], capture_output=True, text=True, timeout=300,
                             cwd="/", env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(MARK):
            got = json.loads(line[len(MARK):])
            return Facts(got["rewards"], got["tables"])
    return None


def reward_error(facts: Facts, i: int, key: str, path: str, func: str, python: str) -> None:
    """A SpecError when the i-th reward file did not import or lacks its function."""
    err = facts.rewards[i] if i < len(facts.rewards) else None
    if err is None:
        return
    if err.startswith("defines no function"):
        raise SpecError(f"{key}: reward file {path} {err} once imported; define {func}(data_source, solution_str, "
                        f"ground_truth, extra_info) at its top level")
    missing = err.startswith(("ModuleNotFoundError", "ImportError"))
    fix = "pip install what it imports into that interpreter" if missing else "fix the file (it runs as the trainer imports it)"
    raise SpecError(f"{key}: reward file {path} fails to import in the trainer's python {python} ({err}); {fix}")


def table(facts: Facts, i: int, key: str, path: Path, columns: tuple[str, ...]) -> int | None:
    """The i-th table's row count once its columns are there (None: the interpreter cannot read
    parquet); a SpecError for an unreadable file, a missing column or no rows."""
    got = facts.tables[i] if i < len(facts.tables) else None
    if got is None:
        return None
    if "error" in got:
        raise SpecError(f"{key}: {path} cannot be read as parquet ({got['error']}); give a parquet file "
                        f"(`hpcrl data convert` writes one)")
    missing = [c for c in columns if c not in got["columns"]]
    if missing:
        raise SpecError(f"{key}: {path} has no column {missing[0]!r} (its columns: {', '.join(got['columns'])}); "
                        f"write it with `hpcrl data convert`, which makes the columns the trainer reads")
    if not got["rows"]:
        raise SpecError(f"{key}: {path} has no rows; give a file with training data")
    return int(got["rows"])


def check_model_dir(key: str, value: str, env: dict) -> None:
    """A local Hugging Face model directory must hold config.json (a hub id is left to the job)."""
    if not str(value).startswith(("/", "~", "$", ".")):
        return
    path = expand(value, env)
    if path is None or (path / "config.json").is_file():
        return
    what = "does not exist" if not path.exists() else "is not a Hugging Face model directory (no config.json)"
    raise SpecError(f"{key}: {path} {what}; download the model first on a login node, e.g. "
                    f"`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir {path}`")
