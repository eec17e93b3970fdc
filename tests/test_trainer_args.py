"""Every argument of every trainer is checked at render/submit, from one declared schema.

The bad values are generated from each field's declared kind, bounds and choices, so a new
argument is covered without touching this file. The built-in trainer's table is also what the
trainer itself (hpcrl.rl.config.resolve) checks trainer.json with: same fields, same messages.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import hpcrl
from hpcrl.errors import SpecError
from hpcrl.schemas import ArgError, Field, show
from hpcrl.trainers import get_trainer, names

REPO = Path(__file__).resolve().parents[1]
# the least a trainer needs to validate (its required keys)
BASE_ARGS = {
    "builtin": {},
    "smoke": {},
    "verl": {"model": "/m", "train_files": "/d/train.parquet", "val_files": "/d/test.parquet"},
    "maxtext": {"load_parameters_path": "gs://bkt/ckpt/0/items"},
}


def bad_values(f: Field) -> list:
    """Values the field's own declaration says it must refuse."""
    out = [{"int": "many", "float": "many", "bool": "maybe", "str": 12, "list": "x=1", "map": "x=1", "choice": "bogus"}[f.kind]]
    if f.kind == "int":
        out.append(2.5)
    if f.kind == "list":
        out.append(["ok=1", 3])
    if not f.nullable and not f.required:
        out.append(None)
    if f.kind == "str" and f.nonempty and not f.required:
        out.append("")
    if f.kind in ("int", "float"):
        step = 1 if f.kind == "int" else 0.5
        if f.ge is not None:
            out.append(f.ge - step)
        if f.gt is not None:
            out.append(f.gt)
        if f.le is not None:
            out.append(f.le + step)
        if f.lt is not None:
            out.append(f.lt)
    return out


CASES = [(trainer, name, value) for trainer in names() for name, f in get_trainer(trainer).schema.fields.items()
         for value in bad_values(f)]


def test_every_trainer_is_covered():
    assert set(names()) == set(BASE_ARGS)
    for trainer in names():
        assert get_trainer(trainer).validate_args(dict(BASE_ARGS[trainer])).keys() == get_trainer(trainer).defaults.keys()
        covered = {name for t, name, _ in CASES if t == trainer}
        assert covered == set(get_trainer(trainer).schema.fields), trainer


def assert_one_line_naming(msg: str, name: str, value) -> None:
    assert "\n" not in msg, msg
    assert msg.startswith(f"args.{name}: "), msg
    assert show(value) in msg or repr(value) in msg, msg
    assert "; use " in msg or "; lower" in msg, msg  # and what is allowed


@pytest.mark.parametrize("trainer, name, value", CASES, ids=[f"{t}-{n}-{v!r}" for t, n, v in CASES])
def test_bad_value_is_one_line_spec_error_naming_field_and_value(trainer, name, value):
    with pytest.raises(SpecError) as e:
        get_trainer(trainer).validate_args({**BASE_ARGS[trainer], name: value})
    assert_one_line_naming(str(e.value), name, value)


CROSS = [
    ("builtin", {"mini_batches": 3}, "args.mini_batches: 3 does not divide batch_size * group_size = 64; "
                                     "use a divisor such as 1, 2, 4, 8"),
    ("builtin", {"batch_size": 3, "group_size": 5, "mini_batches": 2}, "args.mini_batches: 2 does not divide"),
    ("builtin", {"loss_agg": "bogus"}, "args.loss_agg: 'bogus' is not allowed; use one of 'token-mean'"),
    ("builtin", {"loss_agg": "token_mean"}, "args.loss_agg: 'token_mean' is not allowed (did you mean 'token-mean'?)"),
    ("builtin", {"algorithm": "gspoo"}, "args.algorithm: 'gspoo' is not allowed (did you mean 'gspo'?)"),
    ("builtin", {"data": "files"}, "args.train_files: null is not allowed when args.data is 'files'"),
    ("builtin", {"countdown_min_count": 5}, "args.countdown_min_count: 5 exceeds countdown_max_count = 4"),
    ("builtin", {"countdown_ops": "+%"}, "args.countdown_ops: '+%' is not a set of operators"),
    ("builtin", {"countdown_ops": "++"}, "args.countdown_ops: '++' is not a set of operators"),
    ("builtin", {"tiny_heads": 3}, "args.tiny_heads: 3 does not divide tiny_hidden_size = 128"),
    ("builtin", {"chat_template": 1}, "args.chat_template: 1 is not allowed"),  # 1 == True, yet not a boolean
    ("builtin", {"groupsize": 4}, "args.groupsize: unknown argument for trainer 'builtin' (did you mean 'group_size'?)"),
    ("verl", {"ppo_mini_batch_size": 512}, "args.ppo_mini_batch_size: 512 exceeds train_batch_size = 256"),
    ("verl", {"model": None}, "args.model: trainer 'verl' needs a value"),
    ("maxtext", {"load_parameters_path": ""}, "args.load_parameters_path: '' is empty; use a non-empty string, or null"),
    ("smoke", {"steps": "many"}, "args.steps: expected a whole number, got 'many'"),
]


@pytest.mark.parametrize("trainer, args, expected", CROSS, ids=[str(i) for i in range(len(CROSS))])
def test_cross_field_and_named_cases(trainer, args, expected):
    with pytest.raises(SpecError) as e:
        get_trainer(trainer).validate_args({**BASE_ARGS[trainer], **args})
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)


def test_values_that_are_fine_pass_and_are_normalised():
    b = get_trainer("builtin")
    a = b.validate_args({"mini_batches": 4, "micro_batch_size": 3, "lr": "1e-6", "group_size": 4.0, "data": "files",
                         "train_files": "/d/t.parquet", "chat_template": False, "loss_agg": "seq-mean-token-sum-norm"})
    assert a["lr"] == 1e-6 and a["group_size"] == 4 and isinstance(a["group_size"], int)  # YAML 1.1 reads 1e-6 as text
    assert a["loss_agg"] == "seq-mean-token-sum-norm" and a["chat_template"] is False
    assert b.validate_args({})["loss_agg"] is None  # the launcher leaves it to the algorithm, as the spec said


# ------------------------------------------------------------------ one schema, two users


BUILTIN_CASES = [(name, value) for t, name, value in CASES if t == "builtin"] + [
    (next(iter(args)), args) for t, args, _ in CROSS if t == "builtin"]


@pytest.mark.parametrize("name, value", BUILTIN_CASES, ids=[f"{n}-{v!r}" for n, v in BUILTIN_CASES])
def test_trainer_side_rejects_the_same_values_with_the_same_message(name, value):
    from hpcrl.rl import config

    args = value if isinstance(value, dict) else {name: value}
    with pytest.raises(SpecError) as launcher:
        get_trainer("builtin").validate_args(args)
    with pytest.raises(config.ConfigError) as trainer:
        config.resolve(args)
    assert str(trainer.value) == str(launcher.value)


def test_trainer_side_fills_the_algorithms_own_loss_agg():
    from hpcrl.rl import config
    from hpcrl.schemas.builtin import ALGORITHMS

    for name, algo in ALGORITHMS.items():
        assert config.resolve({"algorithm": name})["loss_agg"] == algo.loss_agg
    assert config.resolve({"algorithm": "gspo", "loss_agg": "token-mean"})["loss_agg"] == "token-mean"


def test_arg_error_is_both_a_spec_error_and_a_value_error():
    assert issubclass(ArgError, SpecError) and issubclass(ArgError, ValueError)


def test_trainer_process_refuses_a_bad_config_in_one_line(tmp_path):
    cfg = tmp_path / "trainer.json"
    cfg.write_text(json.dumps({"mini_batches": 3}))
    res = subprocess.run([sys.executable, "-m", "hpcrl.rl.train", "--config", str(cfg)], cwd=REPO,
                         capture_output=True, text=True, env={"HPCRL_RUN_DIR": str(tmp_path), "PATH": "/usr/bin"})
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("hpcrl.rl: error: args.mini_batches: 3 does not divide") and res.stderr.count("\n") == 1


# ------------------------------------------------------------------ the CLI


@pytest.mark.parametrize("setting, expected", [
    ("args.loss_agg=bogus", "hpcrl: error: args.loss_agg: 'bogus' is not allowed"),
    ("args.mini_batches=3", "hpcrl: error: args.mini_batches: 3 does not divide batch_size * group_size = 64"),
])
@pytest.mark.parametrize("verb", ["render", "submit"])
def test_cli_refuses_bad_builtin_args_in_one_line(home, verb, setting, expected):
    r = hpcrl(verb, "--trainer", "builtin", "--set", setting, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(expected) and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not (home / "runs").exists(), "no half-created run"
