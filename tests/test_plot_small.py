"""`hpcrl plot` as a user met it (#29): the PNG lands in the run's directory, segments that start
at the same step share one label instead of smearing into "s23456", every axis label is whole,
and a run with beta 0 gets no flat KL panel but a sentence saying KL was not computed."""

from __future__ import annotations

import json

from helpers import hpcrl


def _run(tmp_path, name="pl", kl=0.0, args=None, trainer="builtin"):
    from hpcrl import runs

    rdir = tmp_path / "runs" / name
    rdir.mkdir(parents=True)
    (rdir / "spec.json").write_text(json.dumps({"spec": {"trainer": trainer, "args": args or {"reward": "countdown"},
                                                         "resources": {}}, "site": {"name": "local"}}))
    T = 1_000_000.0
    starts = [None, 0, 0, 0, 0, 10, 20]  # segments 2-5 made no progress: they all start at step 0
    segs = [{"k": k, "job_id": str(k), "state": "FAILED" if 1 < k < 5 else "CONTINUE", "started": T + 100 * k,
             "ended": T + 100 * k + 90, "start_step": st, "end_step": ((st or 0) + 10) if k >= 5 else st}
            for k, st in enumerate(starts, 1)]
    recs = [{"step": s, "phase": "sft" if s <= 5 else "train", "segment": 1, "time": T + s,
             "loss": 5.0 - s / 10 if s <= 5 else 2e-5 + 1e-5 * (-1) ** s, "kl": kl * s, "reward_mean": s / 40,
             "response_len_mean": 10} for s in range(1, 41)]
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (rdir / "state.json").write_text(json.dumps({"run_id": name, "state": "STOPPED", "segments": segs,
                                                 "budget": {"hours": 0.01, "total_hours": None, "max_segments": 40},
                                                 "trainer": "builtin", "site": "local"}))
    runs.register(name, rdir)
    return rdir


def _drawn(path):
    from PIL import Image

    return json.loads(Image.open(path).info["hpcrl"])


def test_plot_writes_into_the_run_directory_unless_told(home, tmp_path):
    rdir = _run(tmp_path)
    here = tmp_path / "a clone"
    here.mkdir()
    out = hpcrl("plot", "pl", cwd=here).stdout
    assert out.startswith(f"wrote {rdir / 'pl.png'} ("), out
    assert (rdir / "pl.png").is_file() and not list(here.iterdir()), "nothing left in the current directory"
    hpcrl("plot", "pl", "--out", "mine.png", cwd=here)
    assert (here / "mine.png").is_file()


def test_segment_labels_do_not_collide_and_axis_labels_are_whole(home, tmp_path):
    rdir = _run(tmp_path)
    hpcrl("plot", "pl")
    drawn = _drawn(rdir / "pl.png")
    first = drawn["panels"][0]
    assert first["label_texts"] == ["s1-5", "s6", "s7"] and first["label_overlaps"] == 0
    assert first["boundaries"] == {"pl": 7}  # every segment still has its line
    assert all(p["axis_labels_inside"] for p in drawn["panels"])
    loss = next(p for p in drawn["panels"] if p["metric"] == "loss")
    assert loss["warmup_axis"] and loss["axis_labels_inside"]


def test_beta_0_draws_no_flat_kl_panel_and_says_why(home, tmp_path):
    rdir = _run(tmp_path)
    hpcrl("plot", "pl")
    drawn = _drawn(rdir / "pl.png")
    assert "kl" not in [p["metric"] for p in drawn["panels"]] and drawn["kl_not_computed"] is True
    assert "KL not computed (beta 0: no reference model)" in drawn["title"]
    rdir2 = _run(tmp_path, "pk", kl=0.001)
    hpcrl("plot", "pk")
    drawn = _drawn(rdir2 / "pk.png")
    assert "kl" in [p["metric"] for p in drawn["panels"]] and drawn["kl_not_computed"] is False


def test_a_run_with_beta_above_0_is_never_said_to_have_no_reference(home, tmp_path):
    """#41: "beta 0: no reference model" of a run with beta 0.04 whose logged KL was 0.0 (the
    policy still at its reference, and the trainer rounded to 6 places). The spec's beta decides."""
    rdir = _run(tmp_path, "pb", args={"reward": "countdown", "beta": 0.04})
    hpcrl("plot", "pb")
    drawn = _drawn(rdir / "pb.png")
    assert "kl" in [p["metric"] for p in drawn["panels"]] and drawn["kl_not_computed"] is False
    assert "beta 0" not in drawn["title"] and "no reference" not in drawn["title"], drawn["title"]
    # a trainer whose beta hpcrl does not know: the values decide, and the title claims no beta
    rdir = _run(tmp_path, "pm", trainer="maxtext", args={})
    hpcrl("plot", "pm")
    drawn = _drawn(rdir / "pm.png")
    assert drawn["kl_not_computed"] is True and "KL 0.0 at every logged step" in drawn["title"], drawn["title"]
