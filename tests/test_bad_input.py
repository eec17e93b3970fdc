"""Table-driven: malformed specs, site files and flags each give a one-line error that names the
problem, never a traceback, and never leave a half-created run behind."""

import os
from pathlib import Path

import pytest

from helpers import hpcrl

# (spec file text or None, user site files {name: text}, extra CLI args, expected text in the error)
CASES = [
    ("trainer: smoke\nbudgte: {}\n", {}, [], "budgte: unknown key (did you mean 'budget'?)"),
    ("trainer: smokey\n", {}, [], "unknown trainer 'smokey' (did you mean 'smoke'?)"),
    ("trainer: smoke\nbudget: {hours: -1}\n", {}, [], "budget.hours (--hours): must be at least"),
    ("trainer: smoke\nbudget: {hours: four}\n", {}, [], "budget.hours (--hours): expected a number, got 'four'"),
    ("trainer: smoke\nbudget: {hours: 2, hours_min: 3}\n", {}, [], "must not exceed --hours"),
    ("trainer: smoke\nbudget: {max_segments: 0}\n", {}, [], "budget.max_segments (--max-segments): must be at least 1"),
    ("trainer: smoke\nbudget: {max_segments: 2.5}\n", {}, [], "expected a whole number"),
    ("trainer: smoke\nbudget: {totl_hours: 3}\n", {}, [], "budget.totl_hours: unknown key (did you mean 'total_hours'?)"),
    ("trainer: smoke\nresources: {nodes: 0}\n", {}, [], "resources.nodes (--nodes): must be at least 1"),
    ("trainer: smoke\nresources: {gpus: 4}\n", {}, [], "resources.gpus: unknown key"),
    ("trainer: smoke\nresources: [1, 2]\n", {}, [], "resources: expected a mapping"),
    ("trainer: smoke\nargs: {step: 3}\n", {}, [], "args.step: unknown argument for trainer 'smoke' (did you mean 'steps'?)"),
    ("trainer: smoke\nargs: {steps: many}\n", {}, [], "args.steps: expected a whole number, got 'many'"),
    ("trainer: smoke\nargs: [1]\n", {}, [], "args: expected a mapping"),
    ("trainer: smoke\nenv: {1BAD: x}\n", {}, [], "not a valid environment variable name"),
    ("trainer: smoke\nenv: {HF_TOKEN: x}\n", {}, [], "looks like a secret"),
    ("trainer: smoke\nenv: {A: [1]}\n", {}, [], "env.A: expected a string or number"),
    ("trainer: smoke\nrequirements: numpy\n", {}, [], "requirements: expected a list of strings"),
    ("trainer: smoke\nscheduler_flags: {time: 10}\n", {}, [],
     "scheduler_flags.time: hpcrl sets --time itself, from the segment hours; use --hours instead"),
    ("trainer: smoke\nscheduler_flags: {o: x.log}\n", {}, [], "hpcrl sets --o itself, so that its log lands in the run directory"),
    ("trainer: smoke\nbudget: {hours: 1e308}\n", {}, [], "budget.hours (--hours): must be at most 720"),
    ("trainer: smoke\n", {}, ["--hours", "nan"], "budget.hours (--hours): expected a number, got nan"),
    ("trainer: smoke\n", {}, ["--hours", "inf"], "budget.hours (--hours): expected a number, got inf"),
    ("trainer: smoke\n", {}, ["--hours", "abc"], "argument --hours: invalid float value: 'abc'"),
    ("trainer: smoke\n", {}, ["--hours", "4", "--total-hours", "1"],
     "--total-hours) 1: less than one segment's --hours 4; raise --total-hours or lower --hours"),
    # #29: a recipe's total (10 h) below --hours 72: the QOS's 48 h limit is the first thing to fix
    ("trainer: smoke\nbudget: {total_hours: 10}\n", {}, ["--site", "perlmutter", "--account", "m1234_g", "--hours", "72"],
     "site 'perlmutter': qos 'regular' allows at most 48 h, asked 72 h"),
    ("trainer: smoke\n", {}, ["--total-hours", "1e12"], "budget.total_hours (--total-hours): must be at most"),
    ("trainer: smoke\n", {}, ["--max-segments", "1000000"], "budget.max_segments (--max-segments): must be at most"),
    ("trainer: smoke\n", {}, ["--nodes", "-3"], "resources.nodes (--nodes): must be at least 1"),
    ("trainer: smoke\n", {}, ["--nodes", "99999999"], "resources.nodes (--nodes): must be at most"),
    ("trainer: smoke\nresources: {mem_gb: 1e9}\n", {}, [], "resources.mem_gb: must be at most"),
    ("trainer: smoke\nresources: {gpus_per_node: 1000}\n", {}, [], "resources.gpus_per_node: must be at most"),
    ("trainer: smoke\nenv: {A: \"x\\0y\"}\n", {}, [], "env.A: contains a NUL byte"),
    ("trainer: smoke\n", {}, ["--set", "args.st$eps=3"], "'st$eps' is not a key"),
    ("trainer: smoke\n", {}, ["--set", "=3"], "expected KEY=VALUE"),
    ("trainer: smoke\n", {}, ["--site", "perlmutter", "--account", "m1; rm -rf ~"], "an account name has letters, digits"),
    ("trainer: smoke\n", {}, ["--site", "perlmutter", "--account", "$(id)"], "an account name has letters, digits"),
    ("trainer: smoke\n", {}, ["--site", "../local"], "a site name has letters, digits"),
    ("trainer: smoke\n", {}, ["--name", "r\u00fcn"], "a run name has"),
    ("trainer: smoke\n", {}, ["--name", "x" * 65], "a run name has"),
    ("trainer: smoke\n", {}, ["--name", "run\n"], "a run name has"),
    ("trainer: smoke\n", {}, ["--name=-rf"], "a run name has"),
    ("trainer: smoke\n", {}, ["--bogus"], "unrecognized arguments: --bogus"),
    ("17\n", {}, [], "the top level must be a mapping"),
    ("trainer: smoke\nbudget: {hours: 'soon'}\n", {}, [], "budget.hours (--hours): expected a number, got 'soon'"),
    ("trainer: smoke\nscheduler_flags: {Mail_Type: END}\n", {}, [], "not a scheduler option name"),
    ("trainer: smoke\nsite: {acount: x}\n", {}, [], "site.acount: unknown key (did you mean 'account'?)"),
    ("trainer: smoke\nname: 'bad name'\n", {}, [], "name 'bad name': a run name has"),
    ("trainer: smoke\n  bad: indent\n", {}, [], "is not valid YAML"),
    ("- just\n- a list\n", {}, [], "the top level must be a mapping"),
    ("trainer: smoke\n", {}, ["--site", "nowhere"], "--site nowhere: unknown site"),
    ("trainer: smoke\n", {}, ["--site", "perlmutter"], "needs a value for 'account'"),
    ("trainer: smoke\n", {}, ["--site", "perlmutter", "--account", "m1_g", "--qos", "debug", "--hours", "1"],
     "qos 'debug' allows at most 0.5 h, asked 1 h"),
    ("trainer: smoke\n", {}, ["--site", "perlmutter", "--account", "m1_g", "--qos", "gold"], "--qos gold: site 'perlmutter' has no such QOS"),
    ("trainer: smoke\n", {}, ["--set", "budget.hours"], "expected KEY=VALUE"),
    ("trainer: smoke\n", {}, ["--set", "a..b=1"], "has an empty part"),
    ("trainer: smoke\n", {}, ["--hours", "0"], "budget.hours (--hours): must be at least"),
    ("trainer: smoke\n", {}, ["--name", "x y"], "--name 'x y': a run name has"),
    ("trainer: smoke\n", {"mine": "extends: nothere\n"}, ["--site", "mine"], "--site nothere: unknown site"),
    ("trainer: smoke\n", {"mine": "extends: mine2\n", "mine2": "extends: mine\n"}, ["--site", "mine"], "loops back"),
    ("trainer: smoke\n", {"mine": "extends: local\nschedular: slurm\n"}, ["--site", "mine"], "schedular: unknown key (did you mean 'scheduler'?)"),
    ("trainer: smoke\n", {"mine": "scheduler: pbs\n"}, ["--site", "mine"], "scheduler must be one of"),
    ("trainer: smoke\n", {"mine": "extends: local\noutputs: $NOPE_NOT_SET/x\n"}, ["--site", "mine"], "uses $NOPE_NOT_SET, which is not set"),
    ("trainer: smoke\n", {"mine": "extends: local\nsignal_lead_s: soon\n"}, ["--site", "mine"], "signal_lead_s: expected a number"),
    ("trainer: smoke\n", {"mine": "extends: local\nqos_table: {a: {max_hours: 1}}\nqos: b\n"}, ["--site", "mine"], "--qos b: site 'mine' has no such QOS"),
    ("trainer: smoke\n", {"mine": ": : :\n"}, ["--site", "mine"], "is not valid YAML"),
    (None, {}, [], "no spec: pass a spec file"),
]


@pytest.mark.parametrize("spec_text, sites, args, expected", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_input_one_line_error_and_nothing_left_behind(home, tmp_path, spec_text, sites, args, expected):
    sites_dir = Path(os.environ["HPCRL_SITES_DIR"])
    for name, text in sites.items():
        (sites_dir / f"{name}.yaml").write_text(text)
    cmd = ["submit", *args]
    work = tmp_path / "work"
    work.mkdir()
    if spec_text is not None:
        (work / "spec.yaml").write_text(spec_text)
        cmd.insert(1, "spec.yaml")
    r = hpcrl(*cmd, check=False, cwd=work)
    assert r.returncode == 2, r.stdout + r.stderr
    assert expected in r.stderr, r.stderr
    assert r.stderr.startswith("hpcrl: error: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not (home / "registry").exists() and not (home / "runs").exists(), "no half-created run"


def test_missing_spec_file(home, tmp_path):
    r = hpcrl("submit", str(tmp_path / "nope.yaml"), check=False)
    assert r.returncode == 2 and "nope.yaml: no such file" in r.stderr


@pytest.mark.parametrize("bad", ["../..", "a/b", ".hidden", "", "x y", "r\u00fcn", "x" * 81, "run\n"])
def test_run_ids_are_checked_like_run_names_before_the_registry(home, bad):
    for verb in ("status", "logs", "resume", "cancel", "stop", "watch"):
        r = hpcrl(verb, bad, check=False)
        assert r.returncode == 2, (verb, r.stdout, r.stderr)
        assert r.stderr.startswith(f"hpcrl: error: run {bad!r}: not a run id") and r.stderr.count("\n") == 1, r.stderr
        assert "Traceback" not in r.stderr and "Is a directory" not in r.stderr


def test_resume_numbers_are_bounded_like_submit(home):
    from hpcrl import control
    from hpcrl.spec import resolve

    control.create_run(resolve(None, "local", [], {"trainer": "smoke", "hours": 1}), "rb")
    for args, expected in ((["--hours", "1e308"], "--hours: must be at most 720"),
                           (["--hours", "0"], "--hours: must be at least"),
                           (["--total-hours", "0.5"], "less than one segment's --hours 1"),
                           (["--max-segments", "0"], "--max-segments: must be at least 1"),
                           (["--hours", "x"], "argument --hours: invalid float value: 'x'")):
        r = hpcrl("resume", "rb", *args, check=False)
        assert r.returncode == 2 and expected in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)


def test_a_long_default_run_id_is_a_run_id(home):
    from hpcrl import control
    from hpcrl.spec import resolve

    name = "n" * 64
    run = control.create_run(resolve(None, "local", [f"name={name}"], {"trainer": "smoke"}))
    assert len(run.id) == 80 and hpcrl("status", run.id).returncode == 0


def test_watch_and_logs_intervals_are_bounded(home):
    for verb in ("watch", "logs"):
        for value in ("0", "-1", "1e9", "nan"):
            r = hpcrl(verb, "ghost", "--interval", value, check=False)
            assert r.returncode == 2 and "--interval" in r.stderr and r.stderr.count("\n") == 1, (verb, value, r.stderr)


def test_a_set_value_with_a_hash_comes_through_whole(home):
    out = hpcrl("render", "--trainer", "smoke", "--set", "env.NOTE=a #b c", "--set", "args.steps=7",
                "--set", "env.Q='#q'").stdout
    assert "export NOTE='a #b c'" in out and "export Q='#q'" in out


def test_unknown_run_for_status_logs_resume_cancel(home):
    for verb in ("status", "logs", "resume", "cancel", "stop"):
        r = hpcrl(verb, "ghost", check=False)
        assert r.returncode == 2 and "run 'ghost': no such run" in r.stderr, (verb, r.stderr)
