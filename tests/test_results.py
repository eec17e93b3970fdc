"""See and keep your results: ETA and cost, status and `logs -f` in a real terminal (tmux), plots,
the metrics table and the exported model, on real local runs."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, hpcrl, read_metrics, run_dir, started, wait_for_run, wait_until


# ---------------------------------------------------------------- pure: ETA, cost, goodput


def _state(segments, state="RUNNING", hours=0.01):
    return {"run_id": "r", "state": state, "budget": {"hours": hours, "total_hours": None, "max_segments": 20},
            "segments": segments}


def _timings(spans):
    """segment k -> SegmentTiming from (first_step, last_step, first_time, last_time)."""
    from hpcrl.status.metrics import segment_timings

    recs = []
    for k, (s0, s1, t0, t1) in spans.items():
        for i, s in enumerate(range(s0, s1 + 1)):
            recs.append({"step": s, "segment": k, "time": t0 + (t1 - t0) * i / max(1, s1 - s0)})
    return segment_timings(recs)


def test_eta_of_a_steady_chain_and_node_hours_are_segments_times_used_time_times_nodes():
    from hpcrl.status import eta as status_eta

    # 36 s segments: 6 s start-up, 1 step/s for 26 s, 4 s to stop and save; 1 s between segments
    T = 1_000_000.0
    segs = [{"k": 1, "job_id": "1", "state": "CONTINUE", "started": T, "ended": T + 36, "start_step": None,
             "end_step": 26}, {"k": 2, "job_id": "2", "state": "RUNNING", "started": T + 37, "start_step": 26}]
    timings = _timings({1: (1, 26, T + 7, T + 32), 2: (27, 36, T + 44, T + 53)})
    facts = status_eta.RunFacts(total_steps=100, walltime_s=36, stop_lead_s=4, nodes=2, gpus_per_node=4,
                              charge_factor=1.5)
    eta = status_eta.eta(_state(segs), timings, facts, step=36, now=T + 53)
    assert eta["steps_per_s"] == 1.0
    # segment 2 trains until 37+6+26 = 69 (step 52); 48 steps left = 1 full segment (26) + 22 steps:
    # segment 3 starts at 37+36+1 = 74, segment 4 at 111, trains from 117: finishes at 139
    assert eta["segments_left"] == 2 and eta["finish_time"] == pytest.approx(T + 139, abs=0.5)
    cost = status_eta.cost(_state(segs), facts, now=T + 53, wall_s_left=eta["wall_s_left"])
    used = 36 + (53 - 37)
    assert cost["node_hours"] == round(used * 2 / 3600, 4) and cost["gpu_hours"] == round(used * 8 / 3600, 4)
    assert cost["charged_hours"] == round(used * 2 * 1.5 / 3600, 4)
    # the rest: 20 s more of segment 2, one full 36 s segment, then 6 + 22 + 4 s
    assert cost["node_hours_projected"] == round((used + 20 + 36 + 32) * 2 / 3600, 4)
    good = status_eta.goodput(_state(segs), timings, facts, now=T + 53)
    assert good[0]["goodput"] == pytest.approx(26 / 36, abs=0.01)  # start-up and the stop lead lost


# ---------------------------------------------------------------- terminal: tmux


@pytest.fixture
def tmux(tmp_path):
    """Start commands in real terminals of a given size (a private tmux server, killed after)."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup installs it where it can: apt-get install tmux)")
    sock = f"hpcrl-test-{os.getpid()}-{tmp_path.name}"[:60]
    env = " ".join(f"{k}={_sh(os.environ[k])}" for k in ("HPCRL_HOME", "HPCRL_SITES_DIR", "PATH") if k in os.environ)
    env += f" PYTHONPATH={_sh(str(ROOT))} TERM=xterm-256color"

    class Terminal:
        def start(self, name, width, argv, extra_env=""):
            # -u: a COLUMNS inherited from the test runner would override the terminal's own width
            cmd = f"env -u COLUMNS -u LINES {env} {extra_env} {_sh(sys.executable)} -m hpcrl.cli {' '.join(map(_sh, argv))}; sleep 600"
            subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-s", name, "-x", str(width), "-y", "50", cmd],
                           check=True)

        def capture(self, name, colours=False):
            argv = ["tmux", "-L", sock, "capture-pane", "-p", "-t", name] + (["-e"] if colours else [])
            return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

        def screen(self, name, argv, width, extra_env="", until="RUN"):
            self.start(name, width, argv, extra_env)
            return wait_until(lambda: until in (s := self.capture(name)) and "$" not in s[-3:] and s, 20,
                              f"`hpcrl {' '.join(argv)}` drawn in a {width}-column terminal")

    yield Terminal()
    subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)


def _sh(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _colours(screen: str) -> set[str]:
    """The foreground colours (SGR 30-37, 90-97) a captured pane uses."""
    import re

    codes = {c for seq in re.findall(r"\x1b\[([0-9;]*)m", screen) for c in seq.split(";")}
    return {c for c in codes if c in {str(n) for n in (*range(30, 38), *range(90, 98))}}


def _row_of(screen: str, run_id: str) -> list[str]:
    lines = [ln for ln in screen.splitlines() if ln.startswith(run_id[:10])]
    assert len(lines) == 1, f"the run's row is one line:\n{screen}"
    return lines[0].split()


def test_steady_smoke_run_eta_cost_terminal_views_and_plot(fast_local, tmux, tmp_path):
    name = "eta-steady-smoke-run"
    hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.003", "--name", name,
          "--set", "args.steps=150", "--set", "args.step_time_s=0.1", "--set", "args.save_every=1000")
    tmux.start("follow80", 80, ["logs", name, "-f"])
    rdir = run_dir(name)

    def second_segment_going():
        recs = [r for r in read_metrics(rdir) if r.get("segment") == 2]
        return len(recs) >= 15

    wait_until(second_segment_going, 120, "segment 2 to make 15 steps")
    now = time.time()
    row = json.loads(hpcrl("status", name, "--json").stdout)[0]
    predicted = row["eta"]["finish_time"]
    # how close the projection comes depends on the machine's load from here on: its arithmetic is
    # checked on a fixed history above; here, that it is there, is in the future and is not
    # sooner than the steps left could run at the trainer's own step time (0.1 s)
    assert row["eta"]["total_steps"] == 150 and 0 < row["eta"]["steps_per_s"] < 10.5
    assert predicted >= now + (150 - row["step"]) * 0.1 - 1.0, (predicted - now, row["step"])

    # the status table as a user sees it at 80 and 160 columns, while the run goes
    narrow = tmux.screen("st80", ["status"], 80)
    cells = _row_of(narrow, name)
    assert cells[1] in ("RUNNING", "CHECKPOINTING", "RESUBMITTED") and cells[2].endswith("/20")
    header = narrow.splitlines()[0].split()
    assert header[:4] == ["RUN", "STATE", "SEG", "STEP"] and "ETA" in header, narrow  # SITE, JOB left out
    assert all(len(ln) <= 80 for ln in narrow.splitlines())
    wide = tmux.screen("st160", ["status"], 160)
    assert wide.splitlines()[0].split()[:5] == ["RUN", "SITE", "STATE", "SEG", "JOB"], wide
    assert _row_of(wide, name)[:2] == [name, fast_local]
    coloured = tmux.capture("st160", colours=True)
    assert _colours(coloured) & {"32", "36"}, "the state is coloured on a terminal"
    tmux.screen("nocolor", ["status"], 160, extra_env="NO_COLOR=1")
    assert not _colours(tmux.capture("nocolor", colours=True)), "NO_COLOR: no colours"
    # logs -f: the streamed log with the progress line kept under it
    follow = tmux.capture("follow80").rstrip("\n").splitlines()
    assert any("smoke: segment 2 starts" in ln for ln in follow), follow
    bottom = [ln for ln in follow if ln.strip()][-1]
    assert "seg 2/20" in bottom and "/150" in bottom and "ETA" in bottom, follow
    assert len(bottom) <= 80

    state = wait_for_run(name, timeout=60)
    assert state["state"] == "COMPLETED"

    row = json.loads(hpcrl("status", name, "--json").stdout)[0]
    ran = started(state)
    assert len(ran) >= 3
    used = sum(s["ended"] - s["started"] for s in ran)
    assert row["cost"]["node_hours"] == pytest.approx(used * 1 / 3600, abs=1e-4)
    assert row["cost"]["wall_hours"] == pytest.approx(row["used_hours"], abs=1e-4)
    assert [g["k"] for g in row["goodput"]] == [s["k"] for s in ran]
    assert all(0.3 < g["goodput"] <= 1 for g in row["goodput"][:-1])
    # `logs -f` drains the last log lines after the run's state is final: wait for them
    done = wait_until(lambda: (lambda t: t if "trainer exited with code 0" in t and "COMPLETED" in t else None)(
        tmux.capture("follow80")), 30, "logs -f to print the end of the run", poll=0.3)
    assert "trainer exited with code 0" in done and "COMPLETED" in done.rstrip().splitlines()[-1]

    plain = hpcrl("status", name).stdout  # piped: plain text, every section
    assert "\x1b[" not in plain and "GOODPUT" in plain and "node-h" in plain and "150/150" in plain
    png = tmp_path / "smoke.png"
    hpcrl("plot", name, "--out", png)
    drawn = _png_record(png)
    assert [p["metric"] for p in drawn["panels"]] == ["loss"]
    assert drawn["panels"][0]["boundaries"] == {name: len(ran)}  # one marker per segment
    assert drawn["panels"][0]["train_points"] == 150 and drawn["panels"][0]["checkpoints"] == len(ran)


def _png_record(path: Path) -> dict:
    from PIL import Image

    assert path.stat().st_size > 10_000
    img = Image.open(path)
    assert img.size[0] >= 800 and img.size[1] >= 200
    gray = img.convert("L")
    lo, hi = gray.getextrema()
    assert hi - lo > 100, "the image is not blank"
    return json.loads(img.info["hpcrl"])


# ---------------------------------------------------------------- the built-in trainer: plot, export, metrics


def _blocked_env(tmp_path, modules):
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {tuple(modules)!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    return {"PYTHONPATH": f"{shim}{os.pathsep}{ROOT}"}


def test_builtin_run_plot_metrics_and_export_that_generates_like_the_trainers_eval(fast_local, tmp_path):
    spec = tmp_path / "ct.yaml"
    hpcrl("init", "--recipe", "countdown-tiny", "--out", spec)
    hpcrl("submit", spec, "--site", fast_local, "--name", "ct", "--hours", "0.02",
          *[x for kv in ("sft_steps=10", "total_steps=40", "eval_size=16", "eval_every=25",
                         "countdown_train_size=200", "save_every=1000", "threads=1") for x in ("--set", f"args.{kv}")])
    # 72-second segments: on a loaded machine start-up takes a good part of each, so the run may
    # need several; the recipe's budget allows 60
    state = wait_for_run("ct", timeout=900)
    assert state["state"] == "COMPLETED", state
    rdir = run_dir("ct")
    records = read_metrics(rdir)

    png = tmp_path / "ct.png"
    hpcrl("plot", "ct", "--out", png)
    drawn = _png_record(png)
    reward = drawn["panels"][0]
    assert [p["metric"] for p in drawn["panels"]] == ["reward_mean", "kl", "loss", "response_len_mean"]
    assert reward["train_points"] == 40 and reward["eval_points"] == 4  # before, after warm-up, step 25, after
    assert reward["boundaries"] == {"ct": len(started(state))}

    table = tmp_path / "m.parquet"
    hpcrl("metrics", "ct", "--format", "parquet", "--out", table)
    import pandas as pd

    frame = pd.read_parquet(table)
    assert len(frame) == len(records) and list(frame.columns[:5]) == ["segment", "phase", "step", "time", "wall_s"]
    assert set(frame[frame.phase.str.startswith("eval")].phase) == {"eval_before", "eval_sft", "eval", "eval_after"}
    assert frame.wall_s.min() >= 0 and frame.wall_s.is_monotonic_increasing
    csv = hpcrl("metrics", "ct").stdout.splitlines()
    assert csv[0].startswith("segment,phase,step,time,wall_s") and len(csv) == len(records) + 1

    out = tmp_path / "export"
    text = hpcrl("export", "ct", "--out", out).stdout
    assert "step 50" in text
    record = json.loads((out / "hpcrl-export.json").read_text())
    assert (record["run"], record["step"]) == ("ct", 50) and record["manifest_sha256"]
    assert not (out / "optimizer.safetensors").exists() and not (out / "rng.pt").exists()
    # the base model's generation_config.json, as it was (#41: export dropped it)
    assert (out / "generation_config.json").read_bytes() == (rdir / "model" / "generation_config.json").read_bytes()
    assert str(out) in hpcrl("status", "ct").stdout
    assert json.loads(hpcrl("status", "ct", "--json").stdout)[0]["export"]["step"] == 50
    _same_greedy_as_the_trainer(rdir, out, records)

    # the extras: one line each without them
    env = _blocked_env(tmp_path, ("matplotlib", "pandas", "pyarrow"))
    r = hpcrl("plot", "ct", "--out", tmp_path / "x.png", check=False, env=env)
    assert r.returncode == 2 and r.stderr == "hpcrl: error: `hpcrl plot` needs matplotlib: pip install 'hpcrl[plot]'\n"
    r = hpcrl("metrics", "ct", check=False, env=env)
    assert r.returncode == 2 and "pip install 'hpcrl[rl]'" in r.stderr and len(r.stderr.splitlines()) == 1
    # a damaged checkpoint is never exported
    from helpers import flip_bit

    flip_bit(rdir / "checkpoints" / "step-00000050" / "model.safetensors")
    r = hpcrl("export", "ct", "--out", tmp_path / "bad", check=False)
    assert r.returncode == 2 and "fails its" in r.stderr and not (tmp_path / "bad").exists()


def _same_greedy_as_the_trainer(rdir: Path, exported: Path, records: list[dict]) -> None:
    """The exported directory, loaded the way any user would, generates what the trainer's own
    greedy evaluation generated: the same texts as the trainer's rollout engine on its checkpoint,
    and the same eval reward as the trainer logged after its last step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.rl import data, policy
    from hpcrl.rl.rollout import HFRollout
    from hpcrl.schemas.builtin import SCHEMA

    cfg = {**SCHEMA.defaults, **json.loads((rdir / "trainer.json").read_text())}
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    tok = AutoTokenizer.from_pretrained(exported, padding_side="left")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    val = data.load_examples(rdir / "data" / "test.parquet")[:cfg["eval_size"]]
    ids = policy.encode_prompts(tok, val, chat_template=cfg["chat_template"], max_prompt_length=cfg["max_prompt_length"])
    texts = []
    with torch.no_grad():
        for prompt in ids:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=cfg["max_response_length"], do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            texts.append(tok.decode(out[0, len(prompt):], skip_special_tokens=True))
    trainer_model, trainer_tok = policy.load_policy(rdir / "checkpoints" / "step-00000050", torch.device("cpu"))
    engine = HFRollout(trainer_model, trainer_tok, max_new_tokens=cfg["max_response_length"], record_logprobs=False)
    theirs = engine.generate(ids[:4], n=1, greedy=True).texts
    assert [t.strip() for t in texts[:4]] == [t.strip() for t in theirs]
    from hpcrl.rewards import mix as reward_mix

    scores, _ = reward_mix.Reward(cfg, torch.device("cpu"))(val[:len(texts)], texts)  # the trainer's own reward
    logged = next(r for r in records if r.get("phase") == "eval_after")["eval/reward_mean"]
    assert round(sum(scores) / len(scores), 6) == logged


# ---------------------------------------------------------------- verl and MaxText: their converters


def test_export_of_a_verl_run_renders_verls_merger_in_the_runs_venv(home, tmp_path):
    from hpcrl import control
    from hpcrl.spec import resolve

    sets = [f"args.model={tmp_path}/m", f"args.train_files={tmp_path}/t.parquet", f"args.val_files={tmp_path}/v.parquet"]
    run = control.create_run(resolve(None, "local", sets, {"trainer": "verl"}), "vr")
    ckpt = run.layout.checkpoints
    (ckpt / "global_step_7" / "actor").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    out = hpcrl("export", "vr", "--out", tmp_path / "hf").stdout.splitlines()
    assert out[1].split()[1:] == ["-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir",
                                  str(ckpt / "global_step_7" / "actor"), "--target_dir", str(tmp_path / "hf")]
    r = hpcrl("export", "vr", "--step", "3", "--out", tmp_path / "hf", check=False)
    assert r.returncode == 2 and r.stderr == "hpcrl: error: --step 3: run 'vr' has verl checkpoints at steps 7\n"
