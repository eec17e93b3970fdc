"""Site rules as data the tool enforces (issue 32): the perlmutter profile's QOS rules, each
citing NERSC's documentation, checked through the real CLI (render, submit) and the resolver.

- debug forbids job chaining (a batch script submitting another): a chained debug run is refused
  in one line that says how to test the chain instead; a one-segment debug run queues nothing;
- interactive QOSes (salloc only) are refused for batch and never suggested;
- shared QOSes scale CPUs and memory to the GPUs asked (half a node at most);
- each QOS carries its charge factor, and preempt renders --requeue;
- every srun step carries --cpus-per-task; caches live under $SCRATCH, expanded in the job;
- a GPU job charged to an account without `_g` gets a one-line warning naming the fix.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, hpcrl
from test_render import FIXED, PY

PM = ["--site", "perlmutter", "--account", "m1234_g"]
RULE_SOURCE = "https://docs.nersc.gov/jobs/policy/"


def render(*args, check=True):
    return hpcrl("render", *args, PY, env=FIXED, check=check)


def one_line_error(proc) -> str:
    assert proc.returncode != 0, proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def resolved(*sets: str, **flags):
    from hpcrl import spec

    return spec.resolve(None, "perlmutter", list(sets), {"account": "m1234_g", "trainer": "smoke", **flags})


# ---------------------------------------------------------------- debug: no chaining


@pytest.mark.parametrize("cmd", ["render", "submit"])
def test_chained_debug_run_is_refused_with_how_to_test_the_chain(home, tmp_path, cmd):
    # the README's old first step: three segments, each queued from inside the running job
    r = hpcrl(cmd, "--trainer", "smoke", *PM, "--qos", "debug", "--hours", "0.25", "--total-hours", "0.75",
              env={"SCRATCH": str(tmp_path)}, check=False)
    line = one_line_error(r)
    assert "chaining" in line and "debug" in line, line
    assert "--qos regular" in line and "--total-hours" in line, line   # how to test the chain instead
    assert RULE_SOURCE in line, line
    assert not (tmp_path / "hpcrl").exists(), "refused before anything is written"


def test_debug_without_a_total_is_a_chain_too():
    from hpcrl.errors import HpcrlError

    with pytest.raises(HpcrlError, match="chaining"):
        resolved(qos="debug", hours=0.25)  # no total: the chain runs until the trainer is done


def test_one_segment_debug_run_renders_and_never_queues_a_successor():
    from hpcrl import lifecycle

    res = resolved(qos="debug", hours=0.25, total_hours=0.25)
    assert res["spec"]["budget"]["max_segments"] == 1
    state = lifecycle.new_state("r", "perlmutter", "slurm", "smoke", res["spec"]["budget"], 0.0)
    state["segments"].append({"job_id": "1", "submitted": 0.0, "after": None})
    _, actions = lifecycle.begin(state, "1", None, 1.0, chains=True)
    assert actions == [], "a debug job must not submit another batch script"
    text = render("--trainer", "smoke", *PM, "--qos", "debug", "--hours", "0.25", "--total-hours", "0.25").stdout
    assert "#SBATCH --qos=debug" in text


# ---------------------------------------------------------------- interactive QOSes


def test_qos_hint_never_suggests_an_interactive_qos():
    line = one_line_error(render("--trainer", "smoke", *PM, "--qos", "debug", "--hours", "1", check=False))
    assert "use --qos regular" in line and "interactive" not in line, line


@pytest.mark.parametrize("qos", ["interactive", "shared_interactive"])
def test_interactive_qos_refused_for_batch(qos):
    line = one_line_error(render("--trainer", "smoke", *PM, "--qos", qos, "--hours", "1", check=False))
    assert "salloc" in line and "--qos regular" in line and RULE_SOURCE in line, line


# ---------------------------------------------------------------- shared: a share of a node


@pytest.mark.parametrize("gpus,cpus,mem", [(1, 32, 64), (2, 64, 128)])
def test_shared_qos_scales_cpus_and_memory_to_the_gpus(gpus, cpus, mem):
    text = render("--trainer", "smoke", *PM, "--qos", "shared", "--set", f"resources.gpus_per_node={gpus}").stdout
    for line in (f"--gpus-per-node={gpus}", f"--cpus-per-task={cpus}", f"--mem={mem}G", "--qos=shared"):
        assert f"#SBATCH {line}\n" in text, (line, text)


@pytest.mark.parametrize("extra", [[], ["--set", "resources.gpus_per_node=4"], ["--nodes", "2",
                                                                               "--set", "resources.gpus_per_node=1"]])
def test_shared_qos_refuses_a_whole_node_with_the_fix(extra):
    line = one_line_error(render("--trainer", "smoke", *PM, "--qos", "shared", *extra, check=False))
    assert "shared" in line and "--qos regular" in line and "gpus_per_node" in line, line


def test_shared_qos_refuses_more_cpus_than_its_share():
    line = one_line_error(render("--trainer", "smoke", *PM, "--qos", "shared", "--set", "resources.gpus_per_node=1",
                                 "--set", "resources.cpus_per_task=128", check=False))
    assert "cpus_per_task 128" in line and "32" in line, line


# ---------------------------------------------------------------- charges and requeue


@pytest.mark.parametrize("qos,sets,factor", [("regular", [], 1.0), ("preempt", [], 0.25), ("premium", [], 2.0),
                                             ("shared", ["resources.gpus_per_node=1"], 0.25),
                                             ("shared", ["resources.gpus_per_node=2"], 0.5)])
def test_charge_factor_is_the_qos_own(qos, sets, factor):
    site = resolved(*sets, qos=qos, hours=1)["site"]
    assert site["charge_factor"] == pytest.approx(factor)


def test_cost_projection_uses_the_qos_charge():
    from hpcrl.status import eta as status_eta

    facts = status_eta.RunFacts(total_steps=None, walltime_s=3600, nodes=1, gpus_per_node=4,
                              charge_factor=resolved(qos="preempt", hours=1)["site"]["charge_factor"])
    state = {"segments": [{"started": 100.0, "ended": 3700.0}]}  # one node-hour on preempt
    assert status_eta.cost(state, facts, 3700.0, 0)["charged_hours"] == pytest.approx(0.25)


def test_preempt_renders_requeue_as_nersc_asks():
    assert "#SBATCH --requeue\n" in render("--trainer", "smoke", *PM, "--qos", "preempt", "--hours", "4").stdout
    assert "--requeue" not in render("--trainer", "smoke", *PM, "--hours", "4").stdout
    doc = (ROOT / "docs" / "perlmutter.md").read_text()
    assert "--requeue" in doc and "renders `--requeue`" in doc


def test_every_qos_rule_in_the_profile_cites_its_source():
    profile = yaml.safe_load((ROOT / "site_configs" / "perlmutter.yaml").read_text())
    for qos, rule in profile["qos_table"].items():
        assert str(rule.get("source", "")).startswith("https://docs.nersc.gov/"), qos
    doc = (ROOT / "docs" / "perlmutter.md").read_text()
    table = doc[doc.index("## Site rules hpcrl enforces"):]
    for needle in ("chaining", "salloc", "shared", "charge", "--requeue", "_g", "$SCRATCH", "--cpus-per-task"):
        assert needle in table, needle
    assert table.count("https://docs.nersc.gov/") >= 5


# ---------------------------------------------------------------- srun steps and caches


def _recipes_for_perlmutter() -> list[str]:
    from hpcrl import recipes

    return [name for name in recipes.available() if not name.startswith("maxtext")]


@pytest.mark.parametrize("nodes", ["1", "2"])
@pytest.mark.parametrize("recipe", _recipes_for_perlmutter())
def test_every_srun_step_carries_cpus_per_task(tmp_path, recipe, nodes):
    spec = tmp_path / "spec.yaml"
    hpcrl("init", "--recipe", recipe, "--out", spec, env=FIXED)
    r = render(spec, *PM, "--hours", "4", "--nodes", nodes, check=False)
    if r.returncode != 0:  # a recipe that cannot take this shape says so in one line
        one_line_error(r)
        return
    sruns = [ln for ln in r.stdout.splitlines() if re.search(r"(^|[\s$(])srun\s", ln) and not ln.lstrip().startswith("#")]
    for line in sruns:
        assert "--cpus-per-task=" in line, line
    if nodes == "2" and recipe in ("tinyzero-countdown-grpo", "smoke"):
        assert sruns, "a 2-node run starts its steps through srun"


CACHES = {"HF_HOME": "huggingface", "XDG_CACHE_HOME": "", "TRITON_CACHE_DIR": "triton",
          "VLLM_CACHE_ROOT": "vllm", "PIP_CACHE_DIR": "pip"}


def test_caches_live_under_scratch_expanded_in_the_job():
    text = render("--trainer", "smoke", *PM, "--hours", "4").stdout
    exports = [ln for ln in text.splitlines() if re.match(rf"export ({'|'.join(CACHES)})=", ln)]
    assert len(exports) == len(CACHES), exports
    assert all("$SCRATCH" in ln and FIXED["SCRATCH"] not in ln for ln in exports), exports  # not expanded here
    # the job's bash expands them against the job's own $SCRATCH
    probe = "\n".join(["set -u", *exports, *(f'echo "{k}=${k}"' for k in CACHES)])
    out = subprocess.run(["bash", "-c", probe], env={"SCRATCH": "/job/scratch", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    got = dict(ln.split("=", 1) for ln in out.splitlines())
    for key, leaf in CACHES.items():
        assert got[key].startswith("/job/scratch/"), got
        assert got[key].rstrip("/").endswith(leaf), got


def test_spec_env_overrides_a_site_cache():
    text = render("--trainer", "smoke", *PM, "--set", "env.HF_HOME=/my/hf").stdout
    assert "export HF_HOME=/my/hf\n" in text and 'export HF_HOME="' not in text


# ---------------------------------------------------------------- _g accounts


def test_gpu_job_on_an_account_without_g_warns_with_the_fix():
    r = render("--trainer", "smoke", "--site", "perlmutter", "--account", "m1234")
    warnings = [ln for ln in r.stderr.splitlines() if "m1234_g" in ln]
    assert len(warnings) == 1 and "_g" in warnings[0] and "--account m1234_g" in warnings[0], r.stderr
    assert "m1234_g" not in render("--trainer", "smoke", *PM).stderr


def test_job_env_expands_only_variables_hostile_values_stay_text(home, tmp_path):
    import os

    from helpers import HOSTILE

    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "pmh.yaml").write_text(yaml.safe_dump({"extends": "perlmutter",
                                                    "job_env": {"HF_HOME": "$SCRATCH/" + HOSTILE + "${HOME}"}}))
    text = hpcrl("render", "--trainer", "smoke", "--site", "pmh", "--account", "m1234_g", PY,
                 env={**FIXED, "HPCRL_SITES_DIR": str(sites)}).stdout
    start = text.index("export HF_HOME=")
    line = text[start:text.index("\nexport PIP_CACHE_DIR=", start)]
    out = subprocess.run(["bash", "-c", f'set -u\n{line}\nprintf %s "$HF_HOME"'], capture_output=True, text=True,
                         env={"SCRATCH": "/s", "HOME": "/h", "PATH": "/usr/bin:/bin"}, check=True).stdout
    assert out == "/s/" + HOSTILE + "/h"  # the PWNED files are checked by conftest's _no_pwned


def test_job_env_variable_unset_at_submit_is_a_one_line_error(home):
    import os

    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "pmu.yaml").write_text(yaml.safe_dump({"extends": "perlmutter",
                                                    "job_env": {"HF_HOME": "$NOT_SET_ANYWHERE/hf"}}))
    r = hpcrl("render", "--trainer", "smoke", "--site", "pmu", "--account", "m1234_g", PY,
              env={**FIXED, "HPCRL_SITES_DIR": str(sites)}, check=False)
    line = one_line_error(r)
    assert "job_env.HF_HOME" in line and "$NOT_SET_ANYWHERE" in line, line


def test_resize_on_shared_keeps_the_share():
    from hpcrl import spec
    from hpcrl.errors import HpcrlError

    res = resolved("resources.gpus_per_node=1", qos="shared", hours=1)
    assert (res["spec"]["resources"]["cpus_per_task"], res["spec"]["resources"]["mem_gb"]) == (32, 64)
    assert spec.resize(res, ["resources.gpus_per_node=2"])[("cpus_per_task")] == 64
    with pytest.raises(HpcrlError, match="a share of one node"):
        spec.resize(res, ["resources.gpus_per_node=4"])


def test_srun_on_a_site_without_cpus_per_task_asks_for_the_nodes_cpus(tmp_path):
    # (test_slurm_ranks runs this very line on the two-node test cluster)
    spec = tmp_path / "spec.yaml"
    hpcrl("init", "--recipe", "countdown-tiny", "--out", spec, env=FIXED)
    text = render(spec, "--site", "testcluster", "--nodes", "2", "--set", "resources.cpus_per_task=null").stdout
    sruns = [ln for ln in text.splitlines() if ln.lstrip().startswith("srun ")]
    assert sruns and all('--cpus-per-task="$SLURM_CPUS_ON_NODE"' in ln for ln in sruns), sruns


# ---------------------------------------------------------------- issue 39: facts checked, or marked unverified


def _warnings(proc, qos: str) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith(f"hpcrl: warning: --qos {qos}:")]


def test_preempt_below_its_unverified_least_walltime_is_warned_about_not_refused():
    """A least walltime of 2 h on preempt is believed but not found in NERSC's pages as read: the
    profile marks it unverified, so --hours 1 renders, with one warning naming the fix."""
    profile = yaml.safe_load((ROOT / "site_configs" / "perlmutter.yaml").read_text())["qos_table"]["preempt"]
    assert profile["min_hours"] == 2 and "min_hours" in profile["unverified"]
    r = render("--trainer", "smoke", *PM, "--qos", "preempt", "--hours", "1")
    assert "#SBATCH --time=60\n" in r.stdout and "#SBATCH --qos=preempt\n" in r.stdout
    (line,) = _warnings(r, "preempt")
    assert "2 h" in line and "unverified" in line and "--hours 2 or more" in line, line
    assert not _warnings(render("--trainer", "smoke", *PM, "--qos", "preempt", "--hours", "2"), "preempt")


def test_a_confirmed_least_walltime_is_refused_in_one_line(capsys):
    """The same rule once confirmed (no `unverified` entry) refuses, naming the fix."""
    from hpcrl import siterules
    from hpcrl.errors import SiteError

    table = {"regular": {"max_hours": 48}, "preempt": {"max_hours": 48, "min_hours": 2, "source": RULE_SOURCE}}

    def apply(hours, **rule):
        site = {"name": "pm", "qos": "preempt", "qos_table": {**table, "preempt": {**table["preempt"], **rule}}}
        siterules.apply({"budget": {"hours": hours, "max_segments": 3}, "resources": {"nodes": 1}}, site, {})

    with pytest.raises(SiteError) as e:
        apply(1)
    assert str(e.value) == ("--qos preempt: site 'pm' takes jobs of 2 h or more on it, asked --hours 1 "
                            f"({RULE_SOURCE}); pass --hours 2 or more, or use --qos regular")
    apply(2)
    apply(1, unverified={"min_hours": "not found"})  # warned only
    assert "unverified (not found)" in capsys.readouterr().err
    with pytest.raises(SiteError, match="unverified.chaining: names no rule"):
        apply(2, unverified={"chaining": "x"})


def test_overrun_warns_that_it_needs_a_spent_allocation():
    """NERSC's overrun QOS is "not available for jobs submitted against a project with a positive
    balance": hpcrl cannot see the balance, so it says so on every use, never refuses."""
    r = render("--trainer", "smoke", *PM, "--qos", "overrun", "--hours", "4")
    assert "#SBATCH --qos=overrun\n" in r.stdout
    (line,) = _warnings(r, "overrun")
    assert "zero or negative" in line and RULE_SOURCE in line and line.endswith("then use --qos regular"), line
    assert not [ln for ln in render("--trainer", "smoke", *PM, "--hours", "4").stderr.splitlines() if "warning" in ln]
    from hpcrl import siterules

    assert siterules.suggest(siterules.qos_rules(resolved(qos="overrun", hours=4)["site"]), 4, True) == "regular"


def test_a_recipe_on_one_shared_gpu_gets_that_gpus_cpus_and_memory(tmp_path):
    """gsm8k-grpo's own comment: on 1 GPU with --set resources.gpus_per_node=1. Its CPUs and memory
    follow the GPUs from the site (once fixed at 128 CPUs, it was refused on shared)."""
    spec = tmp_path / "spec.yaml"
    hpcrl("init", "--recipe", "gsm8k-grpo", "--out", spec, env=FIXED)
    text = render(spec, *PM, "--qos", "shared", "--set", "resources.gpus_per_node=1").stdout
    for line in ("--gpus-per-node=1", "--cpus-per-task=32", "--mem=64G", "--qos=shared"):
        assert f"#SBATCH {line}\n" in text, (line, text)
    assert '"$trainer_py" -m hpcrl.rl.train ' in text and "torch.distributed.run" not in text  # one rank
    whole = render(spec, *PM).stdout  # regular: the node's CPUs, the node's memory (no --mem)
    assert "#SBATCH --cpus-per-task=128\n" in whole and "#SBATCH --gpus-per-node=4\n" in whole
    assert "#SBATCH --mem=" not in whole
