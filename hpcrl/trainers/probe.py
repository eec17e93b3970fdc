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

from ..errors import SpecError, not_a_model_dir

MARK = "HPCRL-PROBE "  # the probe's answer line (a reward module may print on import)

# Run in the job's interpreter: stdlib, plus pyarrow when it has it. The user's reward module is
# imported as the trainer imports it (hpcrl/rewards/score.py: by path), with the job's environment.
_SCRIPT = r'''
import importlib, importlib.util, inspect, json, sys
ask = json.loads(sys.argv[1])
out = {"rewards": [], "tables": []}
try:
    import pyarrow.parquet as pq
except ImportError:
    pq = None


def said(e):
    return "%s: %s" % (type(e).__name__, " ".join(str(e).split())[:200])


def first_row():
    """(data_source, ground_truth, extra_info) of the data's first row, as the trainer reads it."""
    if pq is None or not ask.get("row_from"):
        return None
    try:
        rec = pq.ParquetFile(ask["row_from"]).read_row_group(0).slice(0, 1).to_pylist()[0]
    except Exception:
        return None  # the table check says what is wrong with the file
    return rec.get("data_source", ""), (rec.get("reward_model") or {}).get("ground_truth"), rec.get("extra_info") or {}


def check_call(fn, row):
    """None, or why the trainer could not use fn: how it calls a reward (positionally, or a batch
    reward by its plural keywords: hpcrl/rewards' mix; verl passes every argument by keyword), then once
    on the row with an empty response."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None  # a builtin or extension: only the call can tell
    batch = sig is not None and "solution_strs" in sig.parameters
    ds, gt, ei = row or ("", None, {})
    one = {"data_source": ds, "solution_str": "", "ground_truth": gt, "extra_info": ei}
    args, kwargs = ((), {"data_sources": [ds], "solution_strs": [""], "ground_truths": [gt], "extra_infos": [ei]}) \
        if batch else ((), one) if ask.get("keywords") else (tuple(one.values()), {})
    if sig is not None:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            return "signature: %s (%s)" % (str(sig)[:200], e)
    if row is None:
        return None
    try:
        got = fn(*args, **kwargs)
    except BaseException as e:
        return "raised: " + said(e)
    if batch:
        if not isinstance(got, (list, tuple)) or len(got) != 1:
            return "returned: %s for a batch of one response" % (repr(got)[:80],)
        got = got[0]
    value = got.get("score") if isinstance(got, dict) else got
    try:
        float(value)
    except (TypeError, ValueError):
        return "returned: %s (%s)" % (repr(got)[:80], type(got).__name__)
    return None


row = first_row()
for entry in ask["rewards"]:
    path, func = entry[0], entry[1]
    try:
        if len(entry) > 2 and entry[2] == "module":
            mod = importlib.import_module(path)
        else:
            # from the source, never a __pycache__: a file edited within the second at the same size
            # would otherwise run its old bytecode (and submit would leave a cache in the user's folder)
            spec = importlib.util.spec_from_file_location("hpcrl_submit_check_reward", path)
            mod = importlib.util.module_from_spec(spec)
            with open(path, "rb") as src:
                exec(compile(src.read(), path, "exec"), mod.__dict__)
        fn = getattr(mod, func, None)
        out["rewards"].append(check_call(fn, row) if callable(fn) else "defines no function %r" % func)
    except BaseException as e:
        out["rewards"].append(said(e))
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


def probe(python: str, env: dict, rewards: list[tuple], tables: list[str], row_from: str | None = None,
          keywords: bool = False) -> Facts | None:
    """Ask `python` (cwd /: the job runs in its run directory, not where submit was typed). None
    when it cannot answer (the interpreter itself is checked by control.check_trainer_python).
    rewards: (file, function) pairs, or (module, function, "module"); each function's signature is
    checked as the trainer calls it, and with `row_from` (a parquet file) it is called once on that
    file's first row with an empty response: a reward that cannot take it fails the first step.
    keywords: the trainer passes the arguments by name (verl), not by position (the built-in one)."""
    if not rewards and not tables:
        return Facts()
    ask = json.dumps({"rewards": [list(r) for r in rewards], "tables": list(tables), "row_from": row_from,
                      "keywords": keywords})
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


SIGNATURE = ("{func}(data_source, solution_str, ground_truth, extra_info=None) returning a float or a dict with "
             "'score', or the batch form {func}(data_sources, solution_strs, ground_truths, extra_infos) returning a list")


def reward_error(facts: Facts, i: int, key: str, path: str, func: str, python: str, row_from=None) -> None:
    """A SpecError when the i-th reward file did not import, lacks its function, does not take the
    reward's arguments, or failed on the data's first row (row_from)."""
    err = facts.rewards[i] if i < len(facts.rewards) else None
    if err is None:
        return
    name = f"{path}:{func}"
    where = f"on the first row of {row_from} with an empty response" if row_from else "on a row"
    if err.startswith("signature: "):
        raise SpecError(f"{key}: {name} does not take the reward's arguments: it is {func}{err[len('signature: '):]}; "
                        f"define {SIGNATURE.format(func=func)}")
    if err.startswith("raised: "):
        raise SpecError(f"{key}: {name} raised {err[len('raised: '):]} {where}; the trainer's first step would fail "
                        f"the same way: it must score any response")
    if err.startswith("returned: "):
        raise SpecError(f"{key}: {name} returned {err[len('returned: '):]} {where}; return a float or a dict with "
                        f"'score' (the batch form: a list, one per response)")
    what = "reward file" if str(path).endswith(".py") else "reward module"
    if err.startswith("defines no function"):
        raise SpecError(f"{key}: {what} {path} {err} once imported; define {func}(data_source, solution_str, "
                        f"ground_truth, extra_info) at its top level")
    missing = err.startswith(("ModuleNotFoundError", "ImportError"))
    fix = "pip install what it imports into that interpreter" if missing else "fix the file (it runs as the trainer imports it)"
    raise SpecError(f"{key}: {what} {path} fails to import in the trainer's python {python} ({err}); {fix}")


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
    raise SpecError(not_a_model_dir(key, path))
