"""CLI surface: help for every command, fast start (no heavy imports), init, sites, wheel install."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT, hpcrl

HEAVY = ("torch", "transformers", "vllm", "jax", "pandas", "pyarrow", "numpy")


def test_every_command_has_help():
    from hpcrl.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, sp in sub.choices.items():
        if name.startswith("_"):
            continue
        helps = [a.help for a in sub._choices_actions if a.dest == name]
        assert helps and helps[0], f"command {name} has no help text"


@pytest.mark.parametrize("argv", [["--help"], ["status"], ["status", "--json"], ["sites"],
                                  ["render", "--trainer", "smoke"], ["init", "--list"]])
def test_cli_does_not_import_the_ml_stack(home, argv):
    code = ("import sys\nfrom hpcrl.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('HEAVY=' + ','.join(m for m in %r if m in sys.modules))" % (argv, HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "HEAVY=", out


def test_init_writes_commented_spec_that_renders(home, tmp_path):
    out = tmp_path / "hpcrl.yaml"
    hpcrl("init", "--recipe", "smoke", "--out", out)
    text = out.read_text()
    assert text.startswith("#") and "trainer: smoke" in text
    r = hpcrl("init", "--recipe", "smoke", "--out", out, check=False)
    assert r.returncode == 2 and "--force" in r.stderr
    # one segment on debug (NERSC forbids chaining there); the recipe's chain of 0.25 h segments on regular
    assert "#SBATCH --qos=debug" in hpcrl("render", out, "--site", "perlmutter", "--account", "m1_g", "--qos",
                                          "debug", "--hours", "0.25", "--total-hours", "0.25",
                                          env={"SCRATCH": str(tmp_path)}).stdout
    assert "#SBATCH --qos=regular" in hpcrl("render", out, "--site", "perlmutter", "--account", "m1_g", "--qos",
                                            "regular", env={"SCRATCH": str(tmp_path)}).stdout
    r = hpcrl("init", "--recipe", "smok", "--out", tmp_path / "x.yaml", check=False)
    assert r.returncode == 2 and "did you mean 'smoke'" in r.stderr


def test_every_recipe_validates(home, tmp_path):
    from hpcrl import recipes

    for name in recipes.available():
        spec = tmp_path / f"{name}.yaml"
        hpcrl("init", "--recipe", name, "--out", spec)
        site = "local" if "tiny" in name or name == "smoke" else "perlmutter"
        r = hpcrl("render", spec, "--site", site, "--account", "m1_g", "--name", "x", check=False,
                  env={"SCRATCH": str(tmp_path)})
        if "maxtext" in name and r.returncode != 0:
            continue  # TPU recipes render on their TPU sites (tested with the TPU backend)
        assert r.returncode == 0, (name, r.stderr)


def test_sites_json_lists_builtins_with_qos(home):
    rows = {r["name"]: r for r in json.loads(hpcrl("sites", "--json").stdout)}
    assert {"local", "perlmutter", "slurm", "testcluster"} <= set(rows)
    assert rows["perlmutter"]["qos"]["debug"] == 0.5 and rows["perlmutter"]["qos"]["regular"] == 48


def test_user_site_extends_builtin_of_same_name(home, tmp_path):
    import os

    Path(os.environ["HPCRL_SITES_DIR"], "perlmutter.yaml").write_text("extends: perlmutter\naccount: m77_g\n")
    text = hpcrl("render", "--site", "perlmutter", "--trainer", "smoke", env={"SCRATCH": str(tmp_path)}).stdout
    assert "#SBATCH --account=m77_g" in text and "#SBATCH --constraint=gpu" in text


def test_precedence_flag_over_set_over_spec_over_site(home, tmp_path):
    from hpcrl.spec import resolve

    spec = tmp_path / "s.yaml"
    spec.write_text("trainer: smoke\nbudget: {hours: 2, total_hours: 9}\nsite: {qos: premium}\n")
    r = resolve(str(spec), "perlmutter", ["budget.hours=3", "budget.total_hours=7", "site.account=m5_g"],
                {"hours": 4, "account": None})
    assert r["spec"]["budget"]["hours"] == 4          # flag beats --set
    assert r["spec"]["budget"]["total_hours"] == 7    # --set beats spec
    assert r["site"]["qos"] == "premium"              # spec beats site
    assert r["site"]["account"] == "m5_g"
    assert r["spec"]["resources"]["gpus_per_node"] == 4  # site fills what the spec leaves out
    assert r["spec"]["budget"]["max_segments"] == 20     # default


def test_wheel_ships_templates_and_site_configs_and_renders_outside_checkout(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, ROOT],
                   check=True, capture_output=True)
    wheel = next(dist.glob("hpcrl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "hpcrl/_templates/segment.sh.j2" in names and "hpcrl/_site_configs/perlmutter.yaml" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", target, wheel],
                   check=True, capture_output=True)
    env = {"PYTHONPATH": str(target), "HPCRL_HOME": str(tmp_path / "h"), "PATH": "/usr/bin:/bin",
           "SCRATCH": "/pscratch/u"}
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "render", "--site", "perlmutter", "--account", "m1_g",
                          "--trainer", "smoke", "--name", "w"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --account=m1_g" in out.stdout
    probe = subprocess.run([sys.executable, "-c", "import hpcrl.paths as p; print(p.templates_dir())"],
                           capture_output=True, text=True, cwd=tmp_path, env=env).stdout
    assert str(target) in probe, "templates came from the installed wheel, not the checkout"


def test_data_and_model_without_the_ml_extra_say_which_extra_in_one_line(home, tmp_path):
    # a sitecustomize that makes the rl extra's packages unimportable, as on a login node without it
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'pandas', 'pyarrow', 'transformers'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    env = {"PYTHONPATH": f"{shim}{os.pathsep}{ROOT}"}
    for argv, missing in ((["data", "countdown", "--out", tmp_path / "d"], "pandas"),
                          (["model", "tiny", "--out", tmp_path / "m"], "torch")):
        r = hpcrl(*argv, check=False, env=env)
        assert r.returncode == 2, r.stderr
        assert r.stderr == f"hpcrl: error: `hpcrl {argv[0]}` needs the ML extra: pip install 'hpcrl[rl]' ({missing} is missing)\n"
        assert not (tmp_path / argv[-1].name).exists()


def _subcommands_in_source(name: str) -> list[str]:
    """The sub-commands of `hpcrl NAME` as hpcrl/rl/commands.py defines them: the add_parser names
    in the function that builds the parser with prog="hpcrl NAME"."""
    import ast

    tree = ast.parse((ROOT / "hpcrl" / "rl" / "commands.py").read_text(encoding="utf-8"))
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
        progs = [k.value.value for c in calls for k in c.keywords
                 if k.arg == "prog" and isinstance(k.value, ast.Constant)]
        if f"hpcrl {name}" in progs:
            return [c.args[0].value for c in calls if isinstance(c.func, ast.Attribute)
                    and c.func.attr == "add_parser" and c.args and isinstance(c.args[0], ast.Constant)]
    return []


def test_the_help_s_copy_of_the_forwarded_sub_commands_matches_rl_commands_source():
    from hpcrl.cli import FORWARDED, FORWARDED_SUBCOMMANDS

    assert set(FORWARDED_SUBCOMMANDS) == set(FORWARDED)
    for name in FORWARDED:
        found = _subcommands_in_source(name)
        assert found, f"no parser with prog='hpcrl {name}' in hpcrl/rl/commands.py"
        assert list(FORWARDED_SUBCOMMANDS[name]) == found, \
            f"hpcrl/cli.py FORWARDED_SUBCOMMANDS[{name!r}] is stale: hpcrl/rl/commands.py defines {found}"


def _arguments(parser) -> list:
    return [(a.dest, tuple(a.option_strings), a.nargs, a.default, a.help,
             tuple(a.choices) if isinstance(a.choices, (list, tuple)) else None) for a in parser._actions]


def test_a_parser_built_for_one_command_parses_it_as_the_full_parser_does():
    from hpcrl.cli import build_parser

    def commands(parser):
        return next(a for a in parser._actions if a.dest == "command")

    full = commands(build_parser())
    for name, sp in full.choices.items():
        alone = commands(build_parser(only=name))
        assert list(alone.choices) == list(full.choices)  # every name stays a valid choice
        assert [(a.dest, a.help) for a in alone._choices_actions] == [(a.dest, a.help) for a in full._choices_actions]
        assert _arguments(alone.choices[name]) == _arguments(sp), name
        assert sp.get_default("func").__name__ == alone.choices[name].get_default("func").__name__


# Modules the CLI loads only where a command needs them (kept out of start-up for speed); not timed.
# render: yaml once its files are in the cache (hpcrl/yamlcache.py), subprocess and socket never.
LAZY = {("--help",): ("ast", "json", "yaml", "jinja2", "shutil", "hpcrl.spec", "hpcrl.status.text", "hpcrl.control"),
        ("status",): ("ast", "yaml", "jinja2", "shutil", "hpcrl.spec", "hpcrl.control", "hpcrl.render", "subprocess"),
        ("render", "--trainer", "smoke"): ("yaml", "subprocess", "socket", "selectors")}


@pytest.mark.parametrize("argv", sorted(LAZY))
def test_start_up_does_not_import_what_the_command_does_not_need(home, argv):
    hpcrl(*argv)  # the first one fills the caches
    code = ("import sys, io, contextlib\nfrom hpcrl.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        main(%r)\n    except SystemExit:\n        pass\n"
            "print('LOADED=' + ','.join(m for m in %r if m in sys.modules))" % (list(argv), LAZY[argv]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "LOADED=", out


def test_yaml_cache_gives_back_what_yaml_read_and_keeps_only_what_json_round_trips(home, tmp_path):
    import yaml

    from hpcrl import spec, yamlcache

    f = tmp_path / "s.yaml"
    f.write_text("trainer: smoke\nargs: {steps: 3, lr: 1.0e-6, flag: true, name: 'x: y'}\nlist: [1, 2.5, null]\n")
    first = spec.load_yaml(f, "spec file")
    assert first == yaml.safe_load(f.read_text()) and yamlcache.get(f.read_text()) == first
    assert spec.load_yaml(f, "spec file") == first
    f.write_text("trainer: smoke\nargs: {steps: 4}\n")  # changed text: read afresh, never the old one
    assert spec.load_yaml(f, "spec file") == {"trainer": "smoke", "args": {"steps": 4}}
    for text in ("when: 2024-01-01\n", "args: {1: one}\n", "x: !!set {a}\n"):  # not JSON's: not kept
        f.write_text(text)
        assert spec.load_yaml(f, "spec file") == yaml.safe_load(text) and yamlcache.get(text) is None
    f.write_text("trainer: [smoke\n")  # a cached file never hides an error in an edited one
    with pytest.raises(Exception, match="is not valid YAML"):
        spec.load_yaml(f, "spec file")
