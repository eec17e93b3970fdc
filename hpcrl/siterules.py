"""A site's own rules, as data in its profile, enforced when a spec is resolved.

Each entry of a profile's `qos_table` may say, beside its walltime limit (spec.validate_qos):
- `chaining: false`: a job on it must not queue another batch job (NERSC's debug QOS): a run on
  it is one segment (its budget is held to one, so no successor is ever queued), and a chain is
  refused with how to test one instead;
- `interactive_only: true`: for salloc sessions only; refused for batch and never suggested;
- `shares_node: {max_gpus, cpus_per_gpu, mem_gb_per_gpu}`: a share of one node: CPUs and memory
  are scaled to the GPUs asked, and more than the share is refused with the fix;
- `charge_factor`: what one node-hour on it is charged (a shared QOS: by the share held);
- `scheduler_flags`: flags its jobs need (NERSC asks for --requeue on preempt);
- `min_hours`: the least walltime a job on it may ask (a segment's --hours below it is refused);
- `only_when`: a condition of use hpcrl cannot check from here (NERSC's overrun: a project whose
  balance is zero or negative): every use gets a one-line warning naming it and the fix;
- `unverified`: {rule key: why} for a rule the site's pages, as read, do not confirm: that rule
  is only warned about, never enforced (a wrong refusal would block a legitimate job; a wrong
  warning costs a line), until someone confirms it and removes the entry;
- `source`: the site's documentation of the rule, quoted in every refusal.

The site-wide ones: `gpu_account_suffix` (a GPU job's account ends so: NERSC's `_g`; a warning
otherwise) and `job_env` (variables whose values the job's shell expands: caches on $SCRATCH).
"""

from __future__ import annotations

import sys

from .errors import SiteError, did_you_mean, one_of

QOS_KEYS = ("max_hours", "min_hours", "charge_factor", "chaining", "interactive_only", "shares_node",
            "scheduler_flags", "only_when", "unverified", "source")
# The rules `unverified` may name (each then a warning instead of a refusal): the one rule so far
# that NERSC's pages, as read, did not confirm; the others quote NERSC's text
ENFORCED = ("min_hours",)
SHARE_KEYS = ("max_gpus", "cpus_per_gpu", "mem_gb_per_gpu")
# What a chained test looks like on a QOS that allows chains (the README's first step).
CHAIN_TEST = "--hours 0.25 --total-hours 0.75"


def qos_rules(site: dict) -> dict[str, dict]:
    """The site's qos_table with every entry checked: name -> its rules (a mapping)."""
    name = site.get("name")
    table = _mapping(site.get("qos_table"), f"site '{name}': qos_table")
    out = {}
    for qos, rule in table.items():
        where = f"site '{name}': qos_table.{qos}"
        rule = _mapping(rule, where)
        for key in rule:
            if key not in QOS_KEYS:
                raise SiteError(f"{where}.{key}: unknown key{did_you_mean(key, QOS_KEYS)}; allowed: {one_of(QOS_KEYS)}")
        share = _mapping(rule.get("shares_node"), f"{where}.shares_node")
        for key in SHARE_KEYS if share else ():
            if not isinstance(share.get(key), (int, float)) or isinstance(share.get(key), bool) or share[key] <= 0:
                raise SiteError(f"{where}.shares_node.{key}: expected a positive number, got {share.get(key)!r}")
        least = rule.get("min_hours")
        if least is not None and (isinstance(least, bool) or not isinstance(least, (int, float)) or least <= 0):
            raise SiteError(f"{where}.min_hours: expected a positive number of hours, got {least!r}")
        for key in _mapping(rule.get("unverified"), f"{where}.unverified"):
            if key not in ENFORCED or key not in rule:
                raise SiteError(f"{where}.unverified.{key}: names no rule of this QOS that hpcrl enforces; "
                                f"allowed: {one_of([k for k in ENFORCED if k in rule]) or 'none here'}")
        if rule.get("only_when") is not None and not isinstance(rule["only_when"], str):
            raise SiteError(f"{where}.only_when: expected text (the condition), got {rule['only_when']!r}")
        out[str(qos)] = rule
    return out


def _mapping(value, where: str) -> dict:
    if value is None or value is False:
        return {}
    if not isinstance(value, dict):
        raise SiteError(f"{where}: expected a mapping (key: value), got {type(value).__name__} {value!r}")
    return value


def _factor(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise SiteError(f"{where}: expected a number of at least 0, got {value!r}")
    return float(value)


def suggest(rules: dict[str, dict], hours: float, chained: bool) -> str | None:
    """The QOS to name in a hint: one a batch job of `hours` may use (never an interactive one,
    never a shared one, which changes the job's resources), at the normal charge first."""
    fits = [q for q, r in rules.items()
            if not r.get("interactive_only") and not r.get("shares_node") and not r.get("only_when")
            and (r.get("max_hours") is None or r["max_hours"] >= hours - 1e-9)
            and (r.get("min_hours") is None or r["min_hours"] <= hours + 1e-9)
            and not (chained and r.get("chaining") is False)]
    return min(fits, key=lambda q: (rules[q].get("charge_factor", 1) != 1, str(q)), default=None)


def _cite(rule: dict) -> str:
    return f" ({rule['source']})" if rule.get("source") else ""


def apply(spec: dict, site: dict, given: dict) -> None:
    """Enforce the rules of the site's QOS on a resolved spec (in place): `given` holds the
    resources the user asked for (None where the site's default applies)."""
    rules = qos_rules(site)
    qos = site.get("qos")
    rule = rules.get(qos)
    if rule is not None:
        _batch_only(rules, rule, site, spec["budget"]["hours"])
        _min_hours(rules, rule, site, spec["budget"]["hours"])
        _only_when(rules, rule, site, spec["budget"])
        _one_segment(rules, rule, site, spec["budget"])
        _share(rule, site, spec["resources"], given)
        # flags its jobs need, below the user's own (sbatch_directives checks every name and value)
        flags = _mapping(rule.get("scheduler_flags"), f"site '{site.get('name')}': qos_table.{qos}.scheduler_flags")
        site["scheduler_flags"] = {**flags, **site.get("scheduler_flags", {})}
    site["charge_factor"] = charge_factor(rule or {}, site, spec["resources"])
    _account_suffix(site, spec["resources"])


def _batch_only(rules: dict, rule: dict, site: dict, hours: float) -> None:
    if rule.get("interactive_only"):
        other = suggest(rules, hours, chained=False)
        fix = f"; use --qos {other}" if other else ""
        raise SiteError(f"--qos {site['qos']}: site '{site.get('name')}' gives it to interactive sessions only "
                        f"(salloc), never to a batch job{_cite(rule)}{fix}")


def _warn(text: str) -> None:
    print(f"hpcrl: warning: {text}", file=sys.stderr)


def _unverified(rule: dict, key: str) -> str | None:
    """Why the rule `key` of this QOS is only warned about (None: it is enforced)."""
    table = rule.get("unverified") or {}
    return (str(table[key] or "") or "not confirmed") if key in table else None


def _min_hours(rules: dict, rule: dict, site: dict, hours: float) -> None:
    least = rule.get("min_hours")
    if least is None or hours >= least - 1e-9:
        return
    qos, name = site["qos"], site.get("name")
    why = _unverified(rule, "min_hours")
    if why is not None:
        _warn(f"--qos {qos}: site '{name}' notes a minimum walltime of {least:g} h on it, unverified ({why}); "
              f"--hours {hours:g} may be refused by the scheduler: pass --hours {least:g} or more")
        return
    other = suggest(rules, hours, chained=False)
    instead = f", or use --qos {other}" if other else ""
    raise SiteError(f"--qos {qos}: site '{name}' takes jobs of {least:g} h or more on it, asked --hours {hours:g}"
                    f"{_cite(rule)}; pass --hours {least:g} or more{instead}")


def _only_when(rules: dict, rule: dict, site: dict, budget: dict) -> None:
    """A condition of the QOS that only the site knows (a project's balance): said, not judged."""
    if not rule.get("only_when"):
        return
    hours, total = budget["hours"], budget.get("total_hours")
    other = suggest(rules, hours, chained=budget["max_segments"] != 1 and (total is None or total > hours + 1e-9))
    _warn(f"--qos {site['qos']}: site '{site.get('name')}' gives it only {rule['only_when']}{_cite(rule)}; hpcrl "
          f"cannot check that from here, and the scheduler refuses the job otherwise" +
          (f": then use --qos {other}" if other else ""))


def _one_segment(rules: dict, rule: dict, site: dict, budget: dict) -> None:
    """A QOS without chaining runs one segment: its budget is held to one, so that the job never
    queues a successor (not even one that would find nothing to do)."""
    if rule.get("chaining") is not False:
        return
    hours, total = budget["hours"], budget.get("total_hours")
    if budget["max_segments"] == 1 or (total is not None and total <= hours + 1e-9):
        budget["max_segments"] = 1
        return
    other = suggest(rules, min(hours, 0.25), chained=True)
    instead = f" or test the chain on --qos {other} with short segments ({CHAIN_TEST})" if other else ""
    raise SiteError(f"--qos {site['qos']}: site '{site.get('name')}' forbids job chaining on it, a job that queues "
                    f"the next{_cite(rule)}; run one segment (--total-hours equal to --hours {hours:g}){instead}")


def reshare(site: dict, res: dict, changes: dict) -> None:
    """`hpcrl resume --set resources.KEY=...` on a shared QOS: the share checked again, CPUs and
    memory not given anew scaled to the GPUs now asked."""
    rule = qos_rules(site).get(site.get("qos"))
    if rule:
        _share(rule, site, res, {key: changes.get(key) for key in ("cpus_per_task", "mem_gb")})


def resume_segments(site: dict, ran: int, asked: int | None) -> int | None:
    """`hpcrl resume` of a run on a QOS without chaining: one more segment, queued from the login
    side by the resume itself (never a chain queued from inside the job)."""
    rule = qos_rules(site).get(site.get("qos")) or {}
    if rule.get("chaining") is not False:
        return asked
    if asked is not None and asked > ran + 1:
        raise SiteError(f"--max-segments {asked}: qos '{site.get('qos')}' forbids job chaining{_cite(rule)}; "
                        f"each `hpcrl resume` of this run runs one more segment (--max-segments {ran + 1})")
    return ran + 1


def _share(rule: dict, site: dict, res: dict, given: dict) -> None:
    """A shared QOS: at most max_gpus on one node, and the CPUs and memory of those GPUs."""
    share = rule.get("shares_node")
    if not share:
        return
    gpus, nodes, most = int(res.get("gpus_per_node") or 0), int(res["nodes"]), int(share["max_gpus"])
    if nodes != 1 or not 1 <= gpus <= most:
        asked = f"{nodes} nodes x {gpus} GPUs" if nodes != 1 else f"{gpus} GPUs"
        raise SiteError(f"--qos {site['qos']}: a share of one node, 1 to {most} GPUs, asked {asked}{_cite(rule)}; "
                        f"pass --set resources.gpus_per_node=1 (up to {most}) on one node, or --qos regular "
                        f"for whole nodes")
    for key, per_gpu, unit in (("cpus_per_task", "cpus_per_gpu", "CPUs"), ("mem_gb", "mem_gb_per_gpu", "GB")):
        allowed = share[per_gpu] * gpus
        if given.get(key) is not None and res[key] is not None and res[key] > allowed + 1e-9:
            raise SiteError(f"resources.{key} {res[key]:g}: --qos {site['qos']} gives {share[per_gpu]:g} {unit} per "
                            f"GPU ({allowed:g} for {gpus}){_cite(rule)}; ask at most {allowed:g} or use --qos regular")
        if given.get(key) is None:
            res[key] = int(allowed) if key == "cpus_per_task" else allowed


def charge_factor(rule: dict, site: dict, res: dict) -> float | None:
    """Charged per node-hour held: the QOS's own factor (else the site's), by the share of the
    node a shared QOS holds (NERSC charges a shared job its fraction of the node)."""
    name = site.get("name")
    base = _factor(site.get("charge_factor"), f"site '{name}': charge_factor")
    factor = _factor(rule.get("charge_factor"), f"site '{name}': qos_table.{site.get('qos')}.charge_factor")
    factor = base if factor is None else factor
    node_gpus = int(site.get("gpus_per_node") or 0)
    if factor is not None and rule.get("shares_node") and node_gpus:
        factor = factor * int(res.get("gpus_per_node") or 0) / node_gpus
    return factor


def _account_suffix(site: dict, res: dict) -> None:
    suffix, account = site.get("gpu_account_suffix"), site.get("account")
    if not suffix or not account or not res.get("gpus_per_node") or account.endswith(suffix):
        return
    print(f"hpcrl: warning: --account {account}: GPU jobs on site '{site.get('name')}' are charged to the "
          f"project's GPU allocation, named with '{suffix}'; use --account {account}{suffix}", file=sys.stderr)
