"""Launcher side of the built-in trainer (hpcrl/rl). No torch: only argv, files and pins.

The trainer obeys the walltime protocol itself (SIGUSR1, SIGTERM, HPCRL_DEADLINE), so the
default checkpoint discovery of the base class (the protocol's LATEST pointer) applies. Its
arguments are the table in hpcrl/schemas/builtin.py, which the trainer checks trainer.json with
too.
"""

from __future__ import annotations

import json

from ..errors import SpecError
from ..schemas.builtin import SCHEMA, reward_file, reward_kind
from .base import Trainer, TrainerContext

# The trainer's ML stack. torch is pinned: an unpinned torch may pull a multi-GB CUDA build.
BASE_REQUIREMENTS = ["torch==2.13.0", "transformers>=5.0,<5.20", "tokenizers>=0.21", "safetensors>=0.4", "xxhash>=3.0",
                     "numpy>=1.26", "pandas>=2.0", "pyarrow>=15"]
# With vLLM rollout the venv follows vLLM's own pins: the consistent GPU set that verl 0.9.1
# declares (notes/trainers.md) - a torch/transformers that vLLM was not built for fails at import.
VLLM_REQUIREMENTS = ["vllm==0.24.0", "torch==2.11.0", "transformers==5.9.0", "tokenizers>=0.21",
                     "safetensors>=0.4", "xxhash>=3.0", "numpy>=1.26", "pandas>=2.0", "pyarrow>=15"]


class BuiltinTrainer(Trainer):
    name = "builtin"
    schema = SCHEMA
    package, package_version = "torch", None
    uses_gpus = True  # on a GPU site each segment first checks its torch sees them (hpcrl/rl/gpucheck.py)
    ranks = "gpu"  # torch.distributed: one rank per GPU (gloo CPU ranks where there are none)

    def check_world(self, args: dict, world: int) -> None:
        # the ranks share a step's prompts with whole GRPO groups on one rank: a rank without a
        # prompt would have nothing to train on
        if world > 1 and int(args["batch_size"]) < world:
            raise SpecError(f"args.batch_size {args['batch_size']}: fewer prompts per step than the {world} ranks "
                            f"(resources.nodes x ranks_per_node); raise batch_size to at least {world} or use fewer ranks")

    def check_submit(self, args: dict, world: int) -> None:
        # a reward file is read where the job runs: a login node shares its filesystem with the
        # compute nodes, so a missing file or function is known here, not after a queue wait
        import re

        for name in _reward_terms(args):
            if reward_kind(name) == "file":
                check_reward_file(*reward_file(name))
            elif reward_kind(name) == "judge":
                check_judge_term(name, args)

    def check_python(self, args: dict, python: str, env: dict) -> None:
        import subprocess

        modules = sorted({n.partition(":")[0] for n in _reward_terms(args) if reward_kind(n) == "module"})
        if modules:
            try:  # cwd /: the job runs in its run dir, so the submit directory's modules are not the job's
                out = subprocess.run([python, "-c", _FIND, *modules], capture_output=True, text=True, timeout=120,
                                     cwd="/", env=env)
            except (OSError, subprocess.TimeoutExpired):
                return  # the interpreter itself is checked elsewhere (control.check_trainer_python)
            missing = out.stdout.split()
            if out.returncode == 0 and missing:
                raise SpecError(f"args.reward: module '{missing[0]}' is not importable by the trainer's python "
                                f"{python}; pip install it there, or add its directory to env.PYTHONPATH in the spec")
        self._probe(args, python, env)

    def _probe(self, args: dict, python: str, env: dict) -> None:
        """The reward files import, the data files hold the prompt column and rows, the model
        directory exists: in the job's interpreter (probe.py), before any queue wait."""
        from . import probe

        a = {**SCHEMA.defaults, **(args or {})}
        if a["model"] not in ("tiny", "smollm2"):
            probe.check_model_dir("args.model", a["model"], env)
        for name in _reward_terms(a):
            if reward_kind(name) == "model":
                check_reward_model(name, env)
            elif reward_kind(name) == "judge":
                check_judge_env(a, env)
        # every function reward, by path or by module, as the trainer will call it (#41 item 6: a
        # wrong signature failed the first step, two segments after an accepted submit)
        files = [reward_file(n) for n in _reward_terms(a) if reward_kind(n) == "file"]
        files += [(n.partition(":")[0], n.partition(":")[2] or "compute_score", "module")
                  for n in _reward_terms(a) if reward_kind(n) == "module"]
        tables = []
        if a["data"] == "files":
            for key in ("train_files", "val_files"):
                path = probe.expand(a[key] or a["train_files"], env)
                if path is not None and path.is_file():  # a missing one: prepare_data says so in the job
                    tables.append((f"args.{key}", path))
                elif path is not None:
                    raise SpecError(f"args.{key}: {path} does not exist; give the absolute path of a parquet file")
        row_from = str(tables[0][1]) if tables and tables[0][0] == "args.train_files" else None
        facts = probe.probe(python, env, files, [str(p) for _, p in tables], row_from=row_from)
        if facts is None:
            return
        for i, (path, func, *_) in enumerate(files):
            probe.reward_error(facts, i, "args.reward", path, func, python, row_from)
        for i, (key, path) in enumerate(tables):
            rows = probe.table(facts, i, key, path, ("prompt",))
            if key == "args.train_files" and rows:
                note_passes(a, rows, path)

    def requirements(self, args: dict, site: dict) -> list[str]:
        reqs = VLLM_REQUIREMENTS if (args or {}).get("rollout") == "vllm" else BASE_REQUIREMENTS
        if (args or {}).get("wandb_project"):
            reqs = reqs + ["wandb"]
        return list(reqs)

    def runtime_packages(self, args: dict) -> list[str]:
        return ["torch", "transformers", "safetensors", "xxhash"] + (["vllm"] if (args or {}).get("rollout") == "vllm" else [])

    def files(self, ctx: TrainerContext) -> dict[str, str]:
        return {"trainer.json": json.dumps(ctx.args, indent=1, sort_keys=True) + "\n"}

    def total_steps(self, args: dict) -> int | None:
        # the loop counts the warm-up's steps in "step" too (RLTrainer.total)
        a = {**SCHEMA.defaults, **(args or {})}
        return int(a["sft_steps"]) + int(a["total_steps"])

    def command(self, ctx: TrainerContext) -> list[str]:
        return [ctx.python, *self.entry(ctx)]

    def entry(self, ctx: TrainerContext) -> list[str]:
        return ["-m", "hpcrl.rl.train", "--config", str(ctx.run_dir / "trainer.json")]

    def env(self, ctx: TrainerContext) -> dict[str, str]:
        # compute nodes usually have no internet: never let transformers try the hub
        return {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


# Prints each named module the interpreter cannot find (find_spec: the module itself is not run).
_FIND = ("import importlib.util, sys\nfor m in sys.argv[1:]:\n    try:\n        found = importlib.util.find_spec(m)\n"
         "    except (ImportError, ValueError):\n        found = None\n    if found is None:\n        print(m)\n")


def _reward_terms(args: dict) -> list[str]:
    import re

    return [re.sub(r"^\s*[-+.\deE]+\s*\*\s*", "", part).strip()
            for part in re.split(r"\s\+\s", str((args or {}).get("reward") or ""))]


def check_reward_file(path: str, func: str) -> None:
    """A SpecError unless `path` is a Python file that defines `func` at its top level (read with
    ast: the user's code is not run here)."""
    import ast
    import difflib
    from pathlib import Path

    file = Path(path).expanduser()
    if not file.is_absolute():
        raise SpecError(f"args.reward: reward file '{path}' is a relative path; the job runs in the run directory, "
                        f"so give its absolute path ({file.resolve()}?)")
    if not file.is_file():
        near = [str(p) for p in file.parent.glob("*.py")] if file.parent.is_dir() else []
        close = difflib.get_close_matches(str(file), near, n=1, cutoff=0.6)
        raise SpecError(f"args.reward: reward file {file} does not exist"
                        + (f" (did you mean {close[0]}?)" if close else "") + "; give the path of a .py file")
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        raise SpecError(f"args.reward: reward file {file} cannot be read as Python ({e.__class__.__name__}: "
                        f"{getattr(e, 'msg', e)}, line {getattr(e, 'lineno', '?')})") from None
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    names += [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    names += [a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names]
    if func not in names:
        close = difflib.get_close_matches(func, names, n=1, cutoff=0.6)
        raise SpecError(f"args.reward: reward file {file} defines no function {func!r}"
                        + (f" (did you mean {close[0]!r}?)" if close else "")
                        + f"; write {file}:FUNCTION or define {func}(data_source, solution_str, ground_truth, extra_info)")


def check_reward_model(name: str, env: dict) -> None:
    """A model:PATH reward, checked without loading it: a Hugging Face directory whose config says
    it is a sequence-classification model (a causal LM loads as one too, with a new untrained score
    head: its rewards would be noise, and nothing would say so)."""
    from . import probe

    path_text = name[len("model:"):]
    probe.check_model_dir("args.reward (model:PATH)", path_text, env)
    path = probe.expand(path_text, env)
    if path is None or not (path / "config.json").is_file():
        return  # a hub id: the job's own load says what is wrong
    try:
        archs = json.loads((path / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return
    if archs and not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise SpecError(f"args.reward: model:{path} is a {archs[0]}, not a sequence-classification model (its score "
                        f"head would be new and untrained); give a reward model (architectures "
                        f"...ForSequenceClassification), or a function reward")


def check_judge_term(name: str, args: dict) -> None:
    """A `judge[:RUBRIC_FILE]` term, checked without calling the judge: args.judge (the schema's
    checks: url, model, the key's variable name, the scale, the budget's prices) and every rubric
    file it names exists, is absolute and holds text."""
    from pathlib import Path

    from ..schemas.builtin import check_judge

    c = check_judge((args or {}).get("judge"), name)
    for key, path in ((f"args.reward ({name})", name.partition(":")[2]), ("args.judge.rubric_file", c["rubric_file"])):
        if not path:
            continue
        file = Path(path).expanduser()
        if not file.is_absolute():
            raise SpecError(f"{key}: rubric file '{path}' is a relative path; the job runs in the run directory, so "
                            f"give its absolute path ({file.resolve()}?)")
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(f"{key}: rubric file {file} cannot be read ({type(e).__name__}); "
                            f"give a text file") from None
        if not text.strip():
            raise SpecError(f"{key}: rubric file {file} is empty; write what the judge should grade")


def check_judge_env(args: dict, env: dict) -> None:
    """The variable args.judge.api_key_env names is set where the job starts (its value is read
    there, never written to the run; it is not shown here either)."""
    name = ((args or {}).get("judge") or {}).get("api_key_env")
    if name and not env.get(name):
        raise SpecError(f"args.judge.api_key_env: ${name} is not set in this shell; export it before hpcrl submit "
                        f"(the job reads the key from its environment; keep it out of the spec, which the run keeps)")


def note_passes(a: dict, rows: int, path) -> None:
    """Say (on stderr, not an error: many passes over a small set is a fair test) how many times the
    RL steps go over the training rows, when more than once: 1000 steps of 32 prompts on 18 rows
    were accepted in silence (verl's route refuses a run longer than its epochs)."""
    import sys

    steps, batch = int(a["total_steps"]), int(a["batch_size"])
    passes = steps * batch / rows
    if passes <= 1:
        return
    within = f"; a step of {batch} prompts repeats rows within itself" if batch > rows else ""
    print(f"hpcrl: note: args.total_steps {steps} x args.batch_size {batch} prompts = {passes:.1f} passes over the "
          f"{rows} rows of {path}{within}; lower them, or give more rows, if that is not what you meant",
          file=sys.stderr)
