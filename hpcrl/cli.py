"""The `hpcrl` command: one thin function per verb. Catches HpcrlError only (one-line errors);
anything else is a bug and keeps its traceback. Imports stay inside the commands so that
`hpcrl --help`, `status` and `logs` start fast."""

from __future__ import annotations

import argparse
import os
import sys

from .errors import HpcrlError


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as the one line every hpcrl error is (no usage dump)."""

    def error(self, message):
        # "hpcrl: error: MESSAGE" for the top level, "hpcrl: error: submit: MESSAGE" below it (the
        # program's name once, not twice)
        where = self.prog[len("hpcrl"):].strip()
        print(f"hpcrl: error: {where + ': ' if where else ''}{message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)

    def _get_formatter(self):
        # argparse makes a formatter for every add_argument (to check its metavar), and its own
        # finds the width with shutil.get_terminal_size: importing shutil (bz2, lzma) cost `status`
        # more than building its parser. The same width, as shutil computes it, without shutil.
        return self.formatter_class(prog=self.prog, width=_columns() - 2)


def _columns() -> int:
    """shutil.get_terminal_size().columns: $COLUMNS, else stdout's terminal, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return 80


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="spec file (default: ./hpcrl.yaml if present)")
    p.add_argument("--site", help="site profile (hpcrl sites lists them; default: local)")
    p.add_argument("--hours", type=float, help="walltime of each segment, in hours")
    p.add_argument("--hours-min", type=float, help="shortest acceptable walltime (Slurm --time-min, for backfill)")
    p.add_argument("--total-hours", type=float, help="budget: stop the chain after this many hours in all")
    p.add_argument("--max-segments", type=int, help="budget: stop after this many segments")
    p.add_argument("--qos", help="QOS (a shortcut for --set site.qos=Q)")
    p.add_argument("--account", help="account to charge (a shortcut for --set site.account=A)")
    p.add_argument("--nodes", type=int, help="nodes per segment")
    p.add_argument("--trainer", help="trainer (smoke, builtin, verl, maxtext); enough without a spec file")
    p.add_argument("--name", help="run name (letters, digits, ._-); default: spec name + time")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="set a spec value by dotted key (args.lr=1e-6, site.account=m1234_g); repeatable")


def _resolve(ns):
    from .spec import resolve, validate_name

    spec = ns.spec
    if spec is None and not ns.trainer and os.path.exists("hpcrl.yaml"):
        spec = "hpcrl.yaml"
    if spec is None and not ns.trainer:
        raise HpcrlError("no spec: pass a spec file, run `hpcrl init` to write ./hpcrl.yaml, or use --trainer smoke")
    if ns.name is not None:
        validate_name(ns.name)
    flags = {k: getattr(ns, k) for k in ("hours", "hours_min", "total_hours", "max_segments", "qos", "account",
                                         "nodes", "trainer")}
    return resolve(spec, ns.site, ns.sets, flags)


def cmd_render(ns) -> int:
    from . import control

    sys.stdout.write(control.render(_resolve(ns), ns.name))
    return 0


def cmd_submit(ns) -> int:
    from . import control

    try:
        run = control.submit(_resolve(ns), ns.name, check_artifacts=not ns.no_check_artifacts)
    except KeyboardInterrupt:
        # control.submit leaves nothing of a run that was not queued (its checks and the venv
        # build come first; a run directory half made is removed): one line, not a traceback
        print("hpcrl: interrupted: nothing was submitted", file=sys.stderr)
        return 130
    state = run.state()
    job = state["segments"][-1]["job_id"] if state["segments"] else "-"
    print(f"submitted run {run.id} (job {job}) on site {state['site']}")
    print(f"  run dir: {run.dir}")
    print(f"  watch:   hpcrl status {run.id}   |   hpcrl logs {run.id} -f")
    for line in control.submit_hint(run):
        print(line)
    return 0


def cmd_venv(ns) -> int:
    from . import control, venv
    from .runs import Run

    if ns.action == "prune":
        return _venv_prune(ns)
    if ns.yes:
        raise HpcrlError("hpcrl venv build: --yes is for `hpcrl venv prune`; leave it out")
    if ns.run:
        if ns.spec or ns.trainer or ns.site or ns.sets:
            raise HpcrlError("hpcrl venv build: --run RUN takes the run's own spec; give either --run or a spec")
        resolved = Run.by_id(ns.run).spec()
    else:
        resolved = _resolve(ns)
    plan = venv.plan(resolved)
    if plan is None:
        print(f"no venv to build: site '{resolved['site']['name']}' has no venv_root, names a trainer_python, "
              f"or the trainer needs nothing installed")
        return 0
    if not venv.built_here(resolved):
        print(f"no venv to build here: site '{resolved['site']['name']}' builds it on its own machines, in the job")
        return 0
    built = control.build_venv(resolved, check_artifacts=not ns.no_check_artifacts)
    print(f"venv {plan.path} {'built' if built else 'already ready'} ({len(plan.requirements)} requirements"
          f"{'; ' + plan.size if plan.size else ''})")
    return 0


def _venv_prune(ns) -> int:
    """`hpcrl venv prune`: hpcrl's venvs in the site's venv_root that no run could still use; listed
    with what each frees, removed only with --yes (a venv costs minutes to rebuild)."""
    from pathlib import Path

    from . import venv
    from .render import expand_path
    from .spec import site_as_given

    if ns.run or ns.spec or ns.trainer:
        raise HpcrlError("hpcrl venv prune: takes the site (--site, --account, --set site...), not a run or spec")
    site = site_as_given(ns.site, ns.account, ns.sets)
    if not site.get("venv_root"):
        print(f"no venvs to prune: site '{site['name']}' has no venv_root")
        return 0
    if not site.get("account") and any(k in str(site["venv_root"]) for k in ("{project}", "{account}")):
        raise HpcrlError(f"site '{site['name']}': venv_root {site['venv_root']} names the project: pass --account "
                         f"(e.g. --account m1234_g)")
    root = Path(expand_path(site["venv_root"], site, "venv_root"))
    found = venv.prunable(root, venv.in_use())
    gone = [p for p in found if p.removable]
    print(f"venv_root {root}: {len(found)} venv{'s' * (len(found) != 1)} of hpcrl, {len(found) - len(gone)} in use")
    for p in found:
        what = f"{p.kind}; {p.bytes / 1e9:.2f} GB, {p.inodes:,} inodes"
        if p.removable:
            print(f"  {'removing' if ns.yes else 'unused':<9} {p.path}  ({what})")
        else:
            print(f"  {'in use':<9} {p.path}  ({what}; runs {', '.join(p.used_by)})")
    freed, inodes = sum(p.bytes for p in gone), sum(p.inodes for p in gone)
    if not gone:
        print("nothing to remove")
        return 0
    if not ns.yes:
        print(f"would free {freed / 1e9:.2f} GB and {inodes:,} inodes; nothing removed: "
              f"hpcrl venv prune --yes (same options) removes them")
        return 0
    for p in gone:
        venv.remove(p)
    print(f"removed {len(gone)}; freed {freed / 1e9:.2f} GB and {inodes:,} inodes")
    return 0


def cmd_status(ns) -> int:
    import json

    from . import runs
    from .status import text

    problems: dict = {}

    def refresh_many(active):
        from . import control  # only for active runs: it loads the scheduler backends

        return control.refresh_many(active, problems)

    def note(run, state):
        from . import lifecycle  # loaded by status.text already

        if run.id in problems:
            return problems[run.id]
        if not lifecycle.is_active(state):
            return None  # only an active run has a backend's word (finished rows stay cheap)
        from . import control

        try:
            return control.backend_for(run).status_note(run, state)
        except (OSError, ValueError):
            return None

    run = runs.Run.by_id(ns.run) if ns.run is not None else None
    rows = text.status_rows([run.id] if run else runs.registered_ids(), refresh_many, note)
    if run is not None and rows:  # not in the cached row: an export may follow the run's end
        rows[0][2].update(goodput=text.goodput_of(run, run.state()), export=text.newest_export(run))
    if ns.json:
        # one run per line: json's C encoder (indent= falls back to the Python one, 5x slower)
        print("[" + ",\n ".join(json.dumps(r[2]) for r in rows) + "]")
    elif run is not None:
        if _terminal():
            from .status import terminal

            terminal.detail(run, run.state(), rows[0][2])
        else:
            print(text.detail(run, run.state(), rows[0][2]))
    elif not rows:
        print("no runs yet: `hpcrl submit --trainer smoke --hours 0.01` tries the whole chain locally")
    elif _terminal():
        from .status import terminal

        terminal.status_table([r[2] for r in rows])
    else:
        print(text.format_table([text.table_row(r[2]) for r in rows]))
        for r in rows:
            if r[2].get("note"):
                print(f"{r[2]['id']}: {r[2]['note']}")
    return 0


def _terminal() -> bool:
    """Draw with rich (tables that fit, colours) only for a person at a terminal."""
    return sys.stdout.isatty()


def cmd_logs(ns) -> int:
    from . import runs
    from .status import text

    from . import control

    if not 0 < ns.interval <= 86400:
        raise HpcrlError(f"--interval {ns.interval}: must be a number of seconds between 0 and 86400 (a day)")
    run = runs.Run.by_id(ns.run)
    control.follow(run, interval_s=ns.interval, keep_going=ns.follow)  # e.g. TPU: logs copied from the bucket
    if ns.segment is None and not ns.follow:  # the whole run, as the help says
        text.print_all(run, sys.stdout)
        return 0
    index = text.pick_segment(run.state(), ns.segment)
    try:
        if ns.follow and _terminal():
            from .status import terminal

            terminal.follow_with_progress(run, index)
        else:
            text.follow(run, index, sys.stdout, follow_on=ns.follow)
    except KeyboardInterrupt:
        pass
    return 0


def _watch_line(run, state) -> str:
    import time

    from . import control
    from .status import text

    row = text.summary(run, state, control.backend_for(run).status_note(run, state))
    ckpt = "-" if row["checkpoint_step"] is None else str(row["checkpoint_step"])
    line = (f"{time.strftime('%H:%M:%S')} {row['state']} segment {row['segments']}/{row['segments_planned']} "
            f"job {row['job_id'] or '-'} step {row['step'] if row['step'] is not None else '-'} checkpoint {ckpt}")
    reason = "; ".join(x for x in (row["reason"], row.get("note")) if x)
    return f"{line}: {reason}" if reason else line


def cmd_watch(ns) -> int:
    """Reconcile until the run ends (or once); print a line whenever what it shows changes. Exit
    status: 0 when the run COMPLETED (or after --once), 1 when it ended any other way."""
    import time

    from . import control, lifecycle, runs

    if not 0 < ns.interval <= 86400:
        raise HpcrlError(f"--interval {ns.interval}: must be a number of seconds between 0 and 86400 (a day)")
    run = runs.Run.by_id(ns.run)
    backend, last = control.backend_for(run), None
    try:
        while True:
            try:
                state = control.reconcile(run, ns.interval)
            except HpcrlError as e:
                if ns.once:
                    raise
                print(f"hpcrl: warning: {e}", file=sys.stderr, flush=True)  # e.g. a network blip: keep watching
                state = run.state()
            line = _watch_line(run, state)
            if line.split(" ", 1)[1] != (last or " ").split(" ", 1)[1]:
                print(line, flush=True)
                last = line
            if ns.once:
                return 0
            if not lifecycle.is_active(state) and backend.settled(run):
                return 0 if state["state"] == lifecycle.RunState.COMPLETED else 1
            time.sleep(ns.interval)
    except KeyboardInterrupt:
        return 130


def cmd_resume(ns) -> int:
    from . import control
    from .runs import Run

    note = control.version_note(Run.by_id(ns.run))  # said first: it may explain a refusal that follows
    if note:
        print(note)
    run = control.resume(ns.run, hours=ns.hours, total_hours=ns.total_hours, max_segments=ns.max_segments,
                        nodes=ns.nodes, sets=ns.sets)
    print(f"resumed run {run.id} (job {run.state()['segments'][-1]['job_id']})")
    return 0


def cmd_cancel(ns) -> int:
    from . import control

    run = control.cancel(ns.run)
    print(f"cancelled run {run.id}")
    return 0


def cmd_stop(ns) -> int:
    from . import control

    run = control.stop(ns.run)
    state = run.state()
    if state["state"] == "STOPPED":
        print(f"stopped run {run.id}: {state['reason']}")
    else:
        print(f"stopping run {run.id}: its segment saves a checkpoint and exits; nothing runs after it "
              f"(`hpcrl status {run.id}` shows STOPPED once saved; `hpcrl resume {run.id}` continues)")
    return 0


def cmd_sites(ns) -> int:
    import json

    from .spec import list_sites, load_site

    rows = []
    for name in sorted(list_sites()):
        site = load_site(name)
        qos = {q: (v or {}).get("max_hours") for q, v in (site.get("qos_table") or {}).items()}
        rows.append({"name": name, "scheduler": site["scheduler"], "description": site.get("description", ""),
                     "qos": qos, "default_qos": site.get("qos"), "file": site["_file"]})
    if ns.json:
        print(json.dumps(rows, indent=1))
        return 0
    if _terminal():
        from .status import terminal

        terminal.plain_table(["SITE", "SCHEDULER", "QOS (max hours)", "DESCRIPTION"],
                         [[r["name"], r["scheduler"], ", ".join(f"{q} {h:g}h" for q, h in r["qos"].items()
                                                                if h is not None) or "-", r["description"]]
                          for r in rows], fold=("QOS (max hours)", "DESCRIPTION"))
        return 0
    for r in rows:
        limits = ", ".join(f"{q} {h:g}h" for q, h in r["qos"].items() if h is not None)
        print(f"{r['name']:<14} {r['scheduler']:<6} {r['description']}")
        if limits:
            print(f"{'':<14} qos: {limits} (default {r['default_qos']})")
    return 0


def cmd_doctor(ns) -> int:
    from . import doctor
    from .spec import site_as_given

    site = site_as_given(ns.site, ns.account, ns.sets)
    spec, trainer, spec_file = None, ns.trainer or "builtin", ns.spec
    if spec_file is None and not ns.trainer and os.path.exists("hpcrl.yaml"):
        spec_file = "hpcrl.yaml"  # as render and submit find it
    if spec_file:  # the venv of this spec: its trainer, arguments and requirements
        from .spec import resolve

        spec = resolve(spec_file, ns.site, ns.sets, {"account": ns.account})["spec"]
        trainer = spec["trainer"]
    checks = doctor.run_checks(site, trainer=trainer, spec=spec, spec_file=spec_file)
    what = f"spec {spec_file}" if spec_file else f"trainer {trainer} (its defaults; no ./hpcrl.yaml here)"
    print(f"hpcrl doctor: site {site['name']} ({site['scheduler']}), {what}")
    print(doctor.format_checks(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


def cmd_init(ns) -> int:
    from . import recipes

    if ns.list:
        if _terminal():
            from .status import terminal

            terminal.plain_table(["RECIPE", "WHAT IT TRAINS"], [list(x) for x in recipes.available().items()],
                             fold=("WHAT IT TRAINS",))
            return 0
        for name, title in recipes.available().items():
            print(f"{name:<28} {title}")
        return 0
    path = recipes.write(ns.recipe, ns.out, force=ns.force)
    from .shell import q

    # render and submit find ./hpcrl.yaml by themselves; any other file must be named
    arg = "" if os.path.abspath(path) == os.path.abspath("hpcrl.yaml") else f" {q(str(ns.out))}"
    print(f"wrote {path}; edit it, then `hpcrl render{arg}` to see the script and `hpcrl submit{arg}` to run it")
    return 0


def cmd_plot(ns) -> int:
    from . import runs
    from .status import plot

    run_list = [runs.Run.by_id(r) for r in ns.runs]
    # into the (first) run's directory: not an untracked PNG in whatever clone the user stands in
    out = ns.out or str(run_list[0].dir / f"{'-vs-'.join(r.id for r in run_list)}.png")
    drawn = plot.plot(run_list, out, ns.metric or None)
    print(f"wrote {out} ({', '.join(p['title'] for p in drawn['panels'])})")
    return 0


def cmd_export(ns) -> int:
    from . import runs
    from . import export
    from .shell import command_line

    run = runs.Run.by_id(ns.run)
    record, argv = export.export(run, ns.step, ns.out, execute_converter=ns.execute, dtype=ns.dtype)
    if argv is not None:
        print("# the trainer's own converter, in the run's venv (hpcrl export --execute runs it here):")
        print(command_line(argv))
        return 0
    print(f"exported run {run.id} step {record['step']} to {record['out']} "
          f"(from {record.get('checkpoint') or 'the converter'}; record: {export.EXPORT_RECORD})")
    return 0


def cmd_eval(ns) -> int:
    from . import evaluation

    run = evaluation.run_of(ns.run, ns.model)
    argv, env, out, step = evaluation.plan(run, ns.checkpoint, ns.model, ns.data, ns.rows, ns.samples, ns.k,
                                           ns.seed, ns.out)
    if not evaluation.runs_here(run, ns.local):
        print(f"# run '{run.id}' is on site {run.site().get('name', '?')}: run this on a compute node (in an "
              "allocation), or add --local to run it here")
        print(evaluation.printed(argv, env))
        return 0
    what = f"model {ns.model}" if ns.model else f"checkpoint step {step}"
    print(f"evaluating run {run.id} {what} on {ns.data or 'its val split'} (args.reward {evaluation.reward_of(run)})",
          flush=True)
    rc = evaluation.execute(argv, env)  # torch loads in that process, not this one
    if rc != 0:
        return rc
    got = evaluation.result(out)
    own = evaluation.runs_own(run, step) if ns.data is None and ns.rows is None else None
    if own is not None:
        differ = evaluation.differences(own, got["greedy"])
        print(f"the run's own {own['phase']} at step {step}: reward_mean={own['eval/reward_mean']:.4f} "
              f"accuracy={own['eval/accuracy']:.4f} n={own['eval/n']} "
              f"({'differs: ' + '; '.join(differ) if differ else 'the same'})")
    name = out.name if out.parent == run.dir / evaluation.EVALS_DIR else out
    print(f"wrote {out / evaluation.RESULT_FILE}; its answers: hpcrl samples {run.id} --eval {name}")
    return 0


def cmd_metrics(ns) -> int:
    from . import runs
    from .status import metrics

    run = runs.Run.by_id(ns.run)
    rows = metrics.table_rows(metrics.read_records(run.layout.metrics), run.state())
    if not rows:
        raise HpcrlError(f"run '{run.id}' has no metrics yet ({run.layout.metrics})")
    metrics.write_table(rows, ns.format, ns.out or sys.stdout)
    if ns.out:
        print(f"wrote {len(rows)} rows to {ns.out}", file=sys.stderr)
    return 0


def cmd_samples(ns) -> int:
    from . import runs
    from .status import samples

    run = runs.Run.by_id(ns.run)
    if ns.limit is not None and ns.limit < 0:
        raise HpcrlError(f"--limit {ns.limit}: give a number of samples (0: all)")
    if ns.format == "parquet" and not ns.out:
        raise HpcrlError("--format parquet is binary: give --out FILE.parquet")
    order = "worst" if ns.worst else "best" if ns.best else None
    directory = samples.eval_samples_dir(run, ns.eval) if ns.eval else None
    chosen, head = samples.choose(run, step=ns.step, order=order, reason=ns.reason, limit=ns.limit,
                                  everything=ns.format is not None, directory=directory)
    if ns.format:
        samples.export(chosen, ns.format, ns.out or sys.stdout)
        if ns.out:
            print(f"wrote {len(chosen)} samples to {ns.out}", file=sys.stderr)
    elif _terminal():
        from .status import terminal

        terminal.samples(chosen, head)
    else:
        samples.print_text(chosen, head)
    return 0


def cmd_segment(ns) -> int:
    """Called by the segment script inside the job (not for users)."""
    from . import control

    if ns.phase == "begin":
        started = control.segment_begin(ns.run_dir, ns.job_id)
        if started is None:
            from .protocol import EXIT_NOTHING_TO_DO

            return EXIT_NOTHING_TO_DO
        print(f"{started[0]} {started[1]:.3f} {int(started[2])}")
    elif ns.phase == "successor":
        return 0 if control.keep_successor(ns.run_dir, ns.job_id) else 1
    elif ns.phase == "next":  # a TPU VM runs the run's next segment itself
        nxt = control.segment_next_here(ns.run_dir, ns.job_id)
        if nxt is None:
            from .protocol import EXIT_NOTHING_TO_DO

            return EXIT_NOTHING_TO_DO
        print(f"{nxt[0]} {nxt[1]}")
    else:
        control.segment_end(ns.run_dir, ns.job_id, ns.rc)
    return 0


def _rl_command(name: str):
    def run(ns) -> int:
        # The trainer's own commands run as a process (the launcher never imports hpcrl.rl):
        # python -m hpcrl.rl.commands prints its own one-line errors, a missing extra included.
        import subprocess
        from pathlib import Path

        env = dict(os.environ)
        pkg_parent = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            return subprocess.run([sys.executable, "-m", "hpcrl.rl.commands", name, *ns.rest], env=env).returncode
        except KeyboardInterrupt:
            return 130
    return run


RUN_HELP = "run id, or any unique start of it (`hpcrl status` lists them)"


class _Unbuilt:
    """Stands for the parser of a command this invocation does not run: it takes every call
    (add_argument, set_defaults) and builds nothing."""

    _actions = ()

    def __getattr__(self, name):
        return lambda *args, **kwargs: self


class _Commands(argparse._SubParsersAction):
    """Sub-commands whose parsers are built only for the command given (`only`): the others keep
    their name and help line (for the listing and the invalid-choice error) and nothing else, as
    building all seventeen costs more than the rest of `hpcrl --help`."""

    only: str | None = None  # None: build every command's parser

    def add_parser(self, name, **kwargs):
        if self.only is None or name == self.only:
            return super().add_parser(name, **kwargs)
        if "help" in kwargs:
            self._choices_actions.append(self._ChoicesPseudoAction(name, (), kwargs["help"]))
        self._name_parser_map[name] = _Unbuilt()
        return self._name_parser_map[name]


# hpcrl/published.py: for a site with no internet on the login side, or an index known to be fine
NO_CHECK_HELP = ("build without first looking up, on the real indexes, each file the venv pins beyond the "
                 "default index (hpcrl/published.py)")


def build_parser(listing: bool = False, only: str | None = None) -> argparse.ArgumentParser:
    """listing: the top-level help is to be printed (it names the forwarded commands' sub-commands).
    only: build the arguments of this command alone (main passes the one given); None: of all."""
    p = _Parser(prog="hpcrl", description="RL post-training on batch systems with walltimes: "
                                "render, submit, checkpoint before the walltime, resubmit, resume, watch.")
    # hpcrl.__version__ is what pyproject builds the wheel's version from, so it is the installed
    # distribution's version too, without importlib.metadata (its import costs start-up) and
    # right in a source checkout run without installing
    from . import __version__

    p.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, action=_Commands)
    sub.only = only
    for name, fn, help_ in (("submit", cmd_submit, "create a run and queue its first segment"),
                            ("render", cmd_render, "print the exact script submit would send")):
        sp = sub.add_parser(name, help=help_, description=help_)
        _add_run_options(sp)
        if name == "submit":
            sp.add_argument("--no-check-artifacts", action="store_true", help=NO_CHECK_HELP)
        sp.set_defaults(func=fn)
    sp = sub.add_parser("venv", help="build the trainer's venv on this (login) node, as submit does; prune unused ones",
                        description="build: the trainer's venv into venv_root/<hash> on this (login) node, as "
                                    "submit does; jobs only activate it. prune: list the site's venvs that no "
                                    "run could still use (every run but COMPLETED ones may run or resume), with "
                                    "the space each frees; --yes removes them")
    sp.add_argument("action", choices=["build", "prune"])
    sp.add_argument("--yes", action="store_true", help="prune: remove what it lists (default: only list it)")
    _add_run_options(sp)
    sp.add_argument("--run", help="build the venv of this existing run (what its job asks for)")
    sp.add_argument("--no-check-artifacts", action="store_true", help=NO_CHECK_HELP)
    sp.set_defaults(func=cmd_venv)
    sp = sub.add_parser("status", help="where every run stands (or one run in detail)")
    sp.add_argument("run", nargs="?", help=RUN_HELP + " (default: every run, one line each)")
    sp.add_argument("--json", action="store_true", help="machine-readable list of runs")
    sp.set_defaults(func=cmd_status)
    sp = sub.add_parser("logs", help="print or follow (-f) a run's log across its segments")
    sp.add_argument("run", help=RUN_HELP)
    sp.add_argument("-f", "--follow", action="store_true", help="follow live, moving on to each next segment")
    sp.add_argument("--segment", type=int, help="segment K only (default: every segment; with -f from the newest)")
    sp.add_argument("--interval", type=float, default=30.0, help="TPU runs: seconds between copies from the bucket (default 30)")
    sp.set_defaults(func=cmd_logs)
    sp = sub.add_parser("watch", help="keep a run going: poll it, start next segments, re-create preempted TPU VMs")
    sp.add_argument("run", help=RUN_HELP)
    sp.add_argument("--interval", type=float, default=60.0, help="seconds between polls (default 60)")
    sp.add_argument("--once", action="store_true", help="poll once, print one line and exit")
    sp.set_defaults(func=cmd_watch)
    sp = sub.add_parser("resume", help="continue a stopped, cancelled or failed run from its last checkpoint")
    sp.add_argument("run", help=RUN_HELP)
    sp.add_argument("--hours", type=float, help="new walltime per segment")
    sp.add_argument("--total-hours", type=float, help="new total budget in hours")
    sp.add_argument("--max-segments", type=int, help="new segment limit")
    sp.add_argument("--nodes", type=int, help="nodes of the next segments (the checkpoint does not depend on them)")
    sp.add_argument("--set", dest="sets", action="append", default=[], metavar="resources.KEY=VALUE",
                    help="other resources of the next segments, e.g. resources.ranks_per_node=2")
    sp.set_defaults(func=cmd_resume)
    sp = sub.add_parser("stop", help="save a checkpoint now and stop (as at a walltime); `hpcrl resume` continues")
    sp.add_argument("run", help=RUN_HELP)
    sp.set_defaults(func=cmd_stop)
    sp = sub.add_parser("cancel", help="cancel a run's running and queued jobs")
    sp.add_argument("run", help=RUN_HELP)
    sp.set_defaults(func=cmd_cancel)
    sp = sub.add_parser("sites", help="built-in and user site profiles, with their QOS limits")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_sites)
    sp = sub.add_parser("doctor", help="preflight a site before the first big submission (run it on the login node)")
    sp.add_argument("spec", nargs="?", help="spec file whose venv to check (default: ./hpcrl.yaml, as render "
                                            "and submit; else the --trainer's defaults)")
    sp.add_argument("--site", help="site profile (default: local)")
    sp.add_argument("--account", help="account to check (default: the site's, or $HPCRL_ACCOUNT)")
    sp.add_argument("--trainer", help="trainer whose venv to check when there is no spec (default builtin)")
    sp.add_argument("--set", dest="sets", action="append", default=[], metavar="site.KEY=VALUE",
                    help="override a site value for the checks; repeatable")
    sp.set_defaults(func=cmd_doctor)
    sp = sub.add_parser("init", help="write a commented starter spec (./hpcrl.yaml)")
    sp.add_argument("--recipe", default="smoke", help="recipe name (--list shows them)")
    sp.add_argument("--list", action="store_true", help="list the recipes")
    sp.add_argument("--out", default="hpcrl.yaml", help="where to write the spec")
    sp.add_argument("--force", action="store_true", help="overwrite an existing file")
    sp.set_defaults(func=cmd_init)
    sp = sub.add_parser("plot", help="plot a run's metrics by step across its segments (needs hpcrl[plot])")
    sp.add_argument("runs", nargs="+", metavar="RUN", help="one run, or several to compare on the same axes (ids or unique prefixes)")
    sp.add_argument("--metric", action="append", metavar="NAME",
                    help="a metrics key to plot (repeatable; default: reward, KL, loss, response length)")
    sp.add_argument("--out", help="PNG file to write (default: RUN.png in the (first) run's directory)")
    sp.set_defaults(func=cmd_plot)
    sp = sub.add_parser("export", help="the trained model as a Hugging Face directory (from_pretrained loads it)")
    sp.add_argument("run", help=RUN_HELP)
    sp.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    sp.add_argument("--out", required=True, help="new directory to write")
    sp.add_argument("--execute", action="store_true",
                    help="verl and MaxText runs: run their converter here (default: print the command)")
    sp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="built-in runs: dtype of the exported weights (default: the model's own, as its config.json says)")
    sp.set_defaults(func=cmd_export)
    sp = sub.add_parser("eval", help="a checkpoint (or an exported model) on a held-out parquet with the run's "
                        "reward: its figures, pass@k, every answer kept (built-in trainer)")
    sp.add_argument("run", nargs="?", help=RUN_HELP + " (default with --model: the run it was exported from)")
    sp.add_argument("--checkpoint", metavar="STEP|latest", help="checkpoint step (default: the newest complete one)")
    sp.add_argument("--model", metavar="DIR", help="a directory `hpcrl export` wrote, instead of a checkpoint")
    sp.add_argument("--data", metavar="FILE", help="rows in verl's schema (docs/adapt.md section 1; parquet or "
                                                   "jsonl; default: the run's val split)")
    sp.add_argument("--rows", type=int, metavar="N", help="the first N rows (default: args.eval_size, as the run's "
                                                         "evaluations; 0: every row)")
    sp.add_argument("--samples", type=int, default=0, metavar="N",
                    help="also N sampled answers a prompt (args.temperature) for pass@k (default 0: greedy only)")
    sp.add_argument("--k", type=int, action="append", metavar="K",
                    help="pass@K from the sampled answers (repeatable; default 1 and N; K <= N)")
    sp.add_argument("--seed", type=int, help="seed of the sampled answers (default: args.seed)")
    sp.add_argument("--out", metavar="DIR", help="where eval.json and samples/ go (default: RUN/evals/DATA-stepN)")
    sp.add_argument("--local", action="store_true",
                    help="run it on this machine although the run's site is a cluster (default there: print "
                         "the command for a compute node)")
    sp.set_defaults(func=cmd_eval)
    sp = sub.add_parser("metrics", help="every segment's metrics as one table (csv, parquet, jsonl)")
    sp.add_argument("run", help=RUN_HELP)
    sp.add_argument("--format", default="csv", choices=["csv", "parquet", "jsonl"], help="default csv")
    sp.add_argument("--out", help="file to write (default: stdout; parquet needs a file)")
    sp.set_defaults(func=cmd_metrics)
    sp = sub.add_parser("samples", help="what the model generated at a step: prompts, responses, reward terms, "
                        "reasons, advantages (built-in trainer)")
    sp.add_argument("run", help=RUN_HELP)
    sp.add_argument("--step", type=int, help="this step only (default: the newest; with --worst, --best or "
                                             "--reason every kept step)")
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--worst", action="store_true", help="lowest reward first")
    which.add_argument("--best", action="store_true", help="highest reward first")
    sp.add_argument("--reason", metavar="R", help="only samples whose reward's reason is R (e.g. syntax_error)")
    sp.add_argument("--limit", type=int, metavar="K", help="at most K samples (default 8 shown, all exported; 0: all)")
    sp.add_argument("--format", choices=["jsonl", "parquet"], help="export instead of showing (parquet needs --out)")
    sp.add_argument("--out", help="file to export to (default: stdout)")
    sp.add_argument("--eval", metavar="NAME|DIR", help="the answers of an `hpcrl eval` (RUN/evals/NAME, or its "
                                                       "--out DIR) instead of the training steps'")
    sp.set_defaults(func=cmd_samples)
    for name, help_ in FORWARDED.items():
        # parsed by hpcrl.rl.commands in its own process (main() forwards every argument, --help
        # included); the top-level help names their sub-commands, read from that file's source
        if listing:
            help_ = f"{help_}: {', '.join(_forwarded_subcommands(name)) or 'see --help'} (needs hpcrl[rl])"
        sp = sub.add_parser(name, help=help_, add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(func=_rl_command(name))
    sp = sub.add_parser("_segment")  # used by the segment script; hidden from the help list
    sp.add_argument("phase", choices=["begin", "successor", "end", "next"])
    sp.add_argument("run_dir")
    sp.add_argument("--job-id", required=True)
    sp.add_argument("--rc", type=int, default=0)
    sp.set_defaults(func=cmd_segment)
    sub._choices_actions = [a for a in sub._choices_actions if a.dest != "_segment"]
    _help_when_incomplete(p)
    return p


# The trainer's own commands (hpcrl/rl/commands.py parses them; `hpcrl data --help` shows theirs).
FORWARDED = {"data": "make datasets", "model": "build a model locally"}


# Their sub-commands, for the top-level help: as hpcrl/rl/commands.py defines them (the launcher
# never imports hpcrl.rl, and parsing its source cost more than the rest of `hpcrl --help`);
# tests/test_cli.py reads them from that file's source and fails when this copy differs.
FORWARDED_SUBCOMMANDS = {"data": ("countdown", "gsm8k", "convert", "code-tiny"), "model": ("tiny", "smollm2")}


def _forwarded_subcommands(name: str) -> tuple[str, ...]:
    return FORWARDED_SUBCOMMANDS.get(name, ())


def _help_when_incomplete(parser: argparse.ArgumentParser) -> None:
    """A command given without its sub-command (`hpcrl venv`) prints its own help instead of an
    error: every parser with sub-commands, at any depth, is marked here, the deepest mark wins."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser.set_defaults(_help_of=parser)
            for child in action.choices.values():
                _help_when_incomplete(child)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    # the command given: the first word that is not an option ("" when none: build no command's arguments)
    parser = build_parser(listing=not argv or argv[0] in ("-h", "--help"),
                          only=next((a for a in argv if not a.startswith("-")), ""))
    if argv and argv[0] in FORWARDED:
        # every argument goes to the trainer's parser, its --help and -h too (argparse's REMAINDER
        # would stop at a leading option); alone, the command lists its sub-commands
        return _rl_command(argv[0])(argparse.Namespace(rest=argv[1:] or ["--help"]))
    ns = parser.parse_args(argv)
    if not getattr(ns, "func", None):
        getattr(ns, "_help_of", parser).print_help()
        return 0
    try:
        return ns.func(ns)
    except HpcrlError as e:
        # one line whatever the message holds (a value with a newline is shown by its repr elsewhere)
        print("hpcrl: error: " + " ".join(str(e).split("\n")), file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (130: the shell's code for SIGINT)
        print("hpcrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
