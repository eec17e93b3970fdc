"""Spec and site models: loading, validation, precedence.

Precedence, highest first: CLI flag > --set key=value > spec file > site profile > default.
The result of `resolve` is plain data (dicts), frozen into the run directory at submit.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from . import siterules
from .errors import SiteError, SpecError, did_you_mean, one_of
from .names import NAME_RE  # the one rule for run and site names
from .paths import site_configs_dir, user_sites_dir

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Names that look like credentials: they must come from the user's environment, never a file.
# Whole words of the name only: TOKENIZERS_PARALLELISM (which TinyZero sets) is no secret.
SECRET_RE = re.compile(r"(?:^|_)(?:TOKENS?|API_?KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(?:_|$)", re.I)

SPEC_DEFAULTS = {
    "name": None,
    "trainer": "smoke",
    "args": {},
    "resources": {"nodes": 1, "ranks_per_node": None, "gpus_per_node": None, "cpus_per_task": None, "mem_gb": None},
    "budget": {"hours": None, "hours_min": None, "total_hours": None, "max_segments": 20},
    "env": {},
    "requirements": [],
    "scheduler_flags": {},
    "site": {},
}

SITE_DEFAULTS = {
    "name": None,
    "description": "",
    "extends": None,
    "scheduler": None,
    "account": None,
    "account_env": "HPCRL_ACCOUNT",
    "required": [],
    "qos": None,
    "qos_table": {},
    "partition": None,
    "constraint": None,
    "gpus_per_node": 0,
    "chips_per_vm": None,
    "cpus_per_task": None,
    "mem_gb": None,
    "default_hours": 1.0,
    "modules": [],
    "setup": [],
    "python": "python3",
    "venv_root": None,
    # per file system, the command that reports a project's quota there (hpcrl/quota.py):
    # [{under: PATH, command: "cmnquota {project}"}]; a venv that does not fit is refused
    "venv_quota": [],
    "outputs": None,
    "env": {},
    "signal_lead_s": 120,
    "exit_margin_s": 30,
    "kill_grace_s": 30,
    "scheduler_flags": {},
    "hpcrl_python": None,
    # a ready interpreter for the trainer (the user's own verl venv): no venv is built
    "trainer_python": None,
    # what the allocation is charged per node-hour used (`status` shows the charge); null: not said
    "charge_factor": None,
    # site rules (hpcrl/siterules.py): a GPU job's account ends so (warned otherwise); variables
    # whose values the job's shell expands ($SCRATCH there, not here)
    "gpu_account_suffix": None,
    "job_env": {},
    # GPU sites: the CUDA the nodes' driver runs, the builds the venv installs for it, the
    # venv_root quota, NCCL across nodes (hpcrl/stack.py reads it; docs/perlmutter.md)
    "gpu_stack": {},
}
# Keys a backend adds (Backend.site_keys: TPU's project, zone, bucket, ...) join these in
# site_keys(); the backend owns their meaning and checks them in complete_site.

# Scheduler flags hpcrl sets itself: a user must use the dedicated option instead.
_HOURS = "from the segment hours; use --hours instead"
_RUN_DIR = "so that its log lands in the run directory; nothing to set"
RESERVED_FLAGS = {
    "time": _HOURS, "t": _HOURS, "time-min": "from --hours-min; use --hours-min instead",
    "job-name": "from the run name; use --name instead", "J": "from the run name; use --name instead",
    "output": _RUN_DIR, "o": _RUN_DIR, "error": _RUN_DIR, "e": _RUN_DIR,
    "signal": "from the site's signal_lead_s; use --set site.signal_lead_s=SECONDS instead",
    "account": "from --account; use --account instead", "A": "from --account; use --account instead",
    "qos": "from --qos; use --qos instead", "q": "from --qos; use --qos instead",
    "dependency": "to chain the run's segments; nothing to set", "d": "to chain the run's segments; nothing to set",
    "nodes": "from --nodes; use --nodes instead", "N": "from --nodes; use --nodes instead",
    "chdir": "to the run directory; nothing to set", "D": "to the run directory; nothing to set",
    "open-mode": "to append (every segment adds to its log); nothing to set",
    "parsable": "on every submit; nothing to set", "wrap": "never: the segment script is the job; leave it out",
}
# What a value may be before it makes no sense anywhere (the largest batch allocations are weeks
# and thousands of nodes; a larger number is a typo, and would overflow a scheduler's field).
MAX_SEGMENT_HOURS = 24 * 30
MAX_TOTAL_HOURS = 24 * 365 * 5
MAX_SEGMENTS = 10_000
MAX_NODES = 10_000
MAX_GPUS_PER_NODE = 64
MAX_RANKS_PER_NODE = 256  # CPU ranks (gloo) on a many-core node; GPU ranks are bounded by the GPUs
MAX_CPUS_PER_TASK = 4096
MAX_MEM_GB = 64 * 1024
ACCOUNT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
SET_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
FLAG_NAME_RE = re.compile(r"[a-z][a-z0-9-]*\Z")


def site_keys() -> dict:
    """Every key a site profile may have, with its default: the common ones and each backend's."""
    from . import backends

    keys = dict(SITE_DEFAULTS)
    for kind in backends.names():
        keys.update(backends.backend_class(kind).site_keys)
    return keys


# ---------------------------------------------------------------- YAML


def load_yaml(path: Path, what: str) -> dict:
    from . import yamlcache

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{what} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{what} {path}: cannot read it ({e.__class__.__name__})") from None
    cached = yamlcache.get(text)
    if cached is not None:
        return cached
    import yaml  # lazy: `status` and `logs` never need it, nor a file read before (yamlcache)

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{what} {path}:{where} is not valid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"{what} {path}: the top level must be a mapping of keys, got {type(data).__name__}")
    yamlcache.put(text, data)
    return data


def parse_set(items: list[str]) -> dict:
    """--set a.b=VALUE ... into a nested dict; values are YAML scalars ('4' -> 4, 'true' -> True)."""
    out: dict = {}
    for item in items or []:
        key, sep, raw = str(item).partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected KEY=VALUE, e.g. --set budget.total_hours=10")
        parts = key.strip().split(".")
        if any(not p for p in parts):
            raise SpecError(f"--set {item!r}: the key {key!r} has an empty part; use dotted keys like args.lr")
        bad = next((p for p in parts if not SET_KEY_RE.match(p)), None)
        if bad is not None:
            raise SpecError(f"--set {item!r}: '{bad}' is not a key (letters, digits, _ and -); use dotted keys like args.lr")
        quoted = raw.strip()[:1] in ("'", '"')
        if re.search(r"(^|\s)#", raw) and not quoted:
            value = raw  # YAML would read ' #...' as a comment and silently drop it: keep it whole
        else:
            import yaml  # here: no --set, no yaml (see load_yaml)

            try:
                value = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError:
                value = raw
        if isinstance(value, (dict, list)) and not raw.strip().startswith(("{", "[")):
            value = raw
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise SpecError(f"--set {item!r}: '{p}' is set twice, once as a value")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------- sites


def _site_file(name: str) -> Path | None:
    for d in (user_sites_dir(), site_configs_dir()):
        p = d / f"{name}.yaml"
        if p.is_file():
            return p
    return None


def list_sites() -> dict[str, Path]:
    """name -> file, user profiles shadowing built-ins."""
    found = {}
    for d in (site_configs_dir(), user_sites_dir()):
        if d.is_dir():
            for p in sorted(d.glob("*.yaml")):
                found[p.stem] = p
    return found


def _check_keys(data: dict, allowed: dict, where: str) -> None:
    for key in data:
        if key not in allowed:
            raise SpecError(f"{where}{key}: unknown key{did_you_mean(key, allowed)}; allowed: {one_of(allowed)}")


def load_site(name: str, _seen: tuple = ()) -> dict:
    """The site profile `name` with its `extends:` chain merged (user profiles first)."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise SiteError(f"--site {name!r}: a site name has letters, digits and ._- only")
    path = _site_file(name)
    if path is None:
        known = list_sites()
        raise SiteError(f"--site {name}: unknown site{did_you_mean(name, known)}; known: {one_of(known)} "
                        f"(or add {user_sites_dir()}/{name}.yaml)")
    if name in _seen:
        raise SiteError(f"site {name}: 'extends' loops back to itself ({' -> '.join(_seen + (name,))})")
    data = load_yaml(path, "site file")
    _check_keys(data, site_keys(), f"site file {path}: ")
    parent = data.get("extends")
    if parent == name and path.parent == user_sites_dir():
        base = _load_builtin_site(name, path)
    elif parent:
        base = load_site(parent, _seen + (name,))
    else:
        base = site_keys()
    merged = deep_merge(base, {k: v for k, v in data.items() if k != "extends"})
    merged["name"] = name
    merged["_file"] = str(path)
    return merged


def _load_builtin_site(name: str, user_path: Path) -> dict:
    # A user profile may extend the built-in of the same name (~/.config/hpcrl/sites/perlmutter.yaml
    # with `extends: perlmutter` to add an account).
    builtin = site_configs_dir() / f"{name}.yaml"
    if not builtin.is_file():
        raise SiteError(f"site file {user_path}: extends '{name}', but there is no built-in site of that name")
    data = load_yaml(builtin, "site file")
    return deep_merge(site_keys(), data)


# ---------------------------------------------------------------- validation helpers


def _number(value, where: str, minimum: float | None = None, integer: bool = False, allow_none=True,
            maximum: float | None = None):
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        # YAML 1.1 reads 1e-3 (no dot) as a string: a number written so is still that number
        try:
            value = float(value) if not value.strip().lstrip("+-").isdigit() else int(value)
        except ValueError:
            pass
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        kind = "a whole number" if integer else "a number"
        raise SpecError(f"{where}: expected {kind}, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(f"{where}: must be at least {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{where}: must be at most {maximum:g}, got {value!r}")
    return int(value) if integer else value


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a mapping (key: value), got {type(value).__name__} {value!r}")
    return value


def _str_list(value, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{where}: expected a list of strings, got {value!r}")
    for v in value:
        if "\n" in v or "\0" in v:
            raise SpecError(f"{where}: {v!r} contains a newline; give one item per list entry")
    return value


def validate_env(env, where: str) -> dict[str, str]:
    env = _mapping(env, where)
    out = {}
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME_RE.match(key):
            raise SpecError(f"{where}.{key}: not a valid environment variable name (letters, digits, _)")
        if SECRET_RE.search(key):
            raise SpecError(f"{where}.{key}: looks like a secret; export it in your shell instead "
                            f"(hpcrl passes it to the job through the environment, never a file)")
        if isinstance(value, (dict, list)) or value is None:
            raise SpecError(f"{where}.{key}: expected a string or number, got {value!r}")
        value = str(value).lower() if isinstance(value, bool) else str(value)
        if "\0" in value:
            raise SpecError(f"{where}.{key}: contains a NUL byte")
        out[key] = value
    return out


def validate_scheduler_flags(flags, where: str) -> dict:
    flags = _mapping(flags, where)
    for key, value in flags.items():
        key = str(key)
        if key in RESERVED_FLAGS:
            raise SpecError(f"{where}.{key}: hpcrl sets --{key} itself, {RESERVED_FLAGS[key]}")
        if not FLAG_NAME_RE.match(key):
            raise SpecError(f"{where}.{key}: not a scheduler option name (lowercase letters, digits, -), "
                            f"e.g. mail-type: END")
        if isinstance(value, (dict, list)) or (isinstance(value, str) and ("\n" in value or "\0" in value)):
            raise SpecError(f"{where}.{key}: expected a single-line value, got {value!r}")
    return {str(k): v for k, v in flags.items()}


# ---------------------------------------------------------------- resolution


def _validate_spec_shape(spec: dict) -> None:
    _check_keys(spec, SPEC_DEFAULTS, "")
    for section in ("resources", "budget"):
        _check_keys(_mapping(spec.get(section), section), SPEC_DEFAULTS[section], f"{section}.")
    _check_keys(_mapping(spec.get("site"), "site"), site_keys(), "site.")


def validate_name(name, where: str = "--name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise SpecError(f"{where} {name!r}: a run name has 1-64 letters, digits and . _ - (starting with a letter or digit)")
    return name


def _validate_resources(res: dict, site: dict, trainer) -> dict:
    res = dict(res)
    res["nodes"] = _number(res.get("nodes"), "resources.nodes (--nodes)", 1, integer=True, allow_none=False,
                           maximum=MAX_NODES)
    gpus_given = res.get("gpus_per_node") is not None
    for key, minimum, maximum in (("gpus_per_node", 0, MAX_GPUS_PER_NODE), ("cpus_per_task", 1, MAX_CPUS_PER_TASK)):
        if res.get(key) is None:
            res[key] = site.get(key)
        res[key] = _number(res[key], f"resources.{key}", minimum, integer=True, maximum=maximum)
    if res.get("mem_gb") is None:
        res["mem_gb"] = site.get("mem_gb")
    res["mem_gb"] = _number(res["mem_gb"], "resources.mem_gb", 0.001, maximum=MAX_MEM_GB)
    res["ranks_per_node"] = _ranks_per_node(res, site, trainer, gpus_given)
    return res


def _ranks_per_node(res: dict, site: dict, trainer, gpus_given: bool) -> int | None:
    """resources.ranks_per_node: with resources.nodes, the world size of a trainer that runs under
    torchrun (Trainer.ranks); None for trainers that place their own workers (verl, maxtext)."""
    where = "resources.ranks_per_node"
    ranks = _number(res.get("ranks_per_node"), where, 1, integer=True, maximum=MAX_RANKS_PER_NODE)
    if trainer.ranks is None:
        if ranks is not None:
            raise SpecError(f"{where}: the {trainer.name} trainer starts its own workers ({trainer.ranks_hint}); "
                            f"leave ranks_per_node out")
        return None
    gpus = res.get("gpus_per_node") or 0
    if trainer.ranks != "gpu":  # ranks without devices of their own (smoke): one unless asked
        return ranks or 1
    site_gpus = int(site.get("gpus_per_node") or 0)
    if ranks is None:
        return gpus or 1  # one rank per GPU the job has; one CPU rank where there are none
    if site_gpus and ranks > site_gpus:
        raise SpecError(f"{where} {ranks}: site '{site.get('name')}' has {site_gpus} GPUs per node and the "
                        f"{trainer.name} trainer runs one rank per GPU; use at most {site_gpus} (or more nodes)")
    if gpus and not gpus_given:
        res["gpus_per_node"] = gpus = ranks  # the GPU request follows the ranks asked for
    if gpus and ranks != gpus:
        raise SpecError(f"{where} {ranks}: resources.gpus_per_node is {gpus} and each rank drives one GPU; "
                        f"set both to the same number (or leave ranks_per_node out)")
    return ranks


RESIZABLE = ("nodes", "ranks_per_node", "gpus_per_node", "cpus_per_task", "mem_gb")


def resize(resolved: dict, sets: list[str] | None, nodes: int | None = None) -> dict | None:
    """`hpcrl resume RUN --nodes N --set resources.KEY=VALUE`: the run's resources with those
    changes, validated as at submit against the run's frozen site and trainer (the next segment
    runs on them; the trainer's checkpoints do not depend on the world size). None: no change."""
    from .trainers import get_trainer

    over = parse_set(sets or [])
    bad = next((k for k in over if k != "resources"), None)
    if bad is not None:
        raise SpecError(f"--set {bad}.KEY: hpcrl resume changes only resources.KEY (one of {one_of(RESIZABLE)}), "
                        f"e.g. --set resources.nodes=1; the rest of a run is frozen at submit")
    changes = dict(_mapping(over.get("resources"), "resources"))
    if nodes is not None:
        changes["nodes"] = nodes
    for key in changes:
        if key not in RESIZABLE:
            raise SpecError(f"resources.{key}: unknown key{did_you_mean(key, RESIZABLE)}; allowed: {one_of(RESIZABLE)}")
    if not changes:
        return None
    old = resolved["spec"]["resources"]
    res = {**old, **changes}
    # The frozen values were derived from each other (ranks from GPUs, the GPU request from the
    # ranks): a change of one lets the other follow it again, as at submit.
    for a, b in (("ranks_per_node", "gpus_per_node"), ("gpus_per_node", "ranks_per_node")):
        if a in changes and b not in changes:
            res[b] = None
    trainer = get_trainer(resolved["spec"]["trainer"])
    res = _validate_resources(res, resolved["site"], trainer)
    siterules.reshare(resolved["site"], res, changes)  # a shared QOS: still a share, scaled again
    trainer.check_world(resolved["spec"]["args"], world_size(res))
    return None if res == old else res


def world_size(resources: dict) -> int:
    """Ranks of the whole run: nodes x ranks_per_node (1 for trainers without ranks)."""
    return int(resources.get("nodes") or 1) * int(resources.get("ranks_per_node") or 1)


def _validate_budget(budget: dict, site: dict) -> dict:
    b = dict(budget)
    if b.get("hours") is None:
        b["hours"] = site.get("default_hours") or 1.0
    b["hours"] = _number(b["hours"], "budget.hours (--hours)", 0.001, allow_none=False, maximum=MAX_SEGMENT_HOURS)
    b["hours_min"] = _number(b.get("hours_min"), "budget.hours_min (--hours-min)", 0.001)
    if b["hours_min"] is not None and b["hours_min"] > b["hours"]:
        raise SpecError(f"budget.hours_min (--hours-min) {b['hours_min']}: must not exceed --hours {b['hours']}")
    b["total_hours"] = _number(b.get("total_hours"), "budget.total_hours (--total-hours)", 0.001,
                               maximum=MAX_TOTAL_HOURS)
    b["max_segments"] = _number(b.get("max_segments"), "budget.max_segments (--max-segments)", 1, integer=True,
                                allow_none=False, maximum=MAX_SEGMENTS)
    return b  # its total against one segment: after the QOS's limit (_finish), which --hours must meet first


def check_budget(hours: float, total_hours: float | None) -> None:
    """A total below one segment would stop the chain before its first segment ends."""
    if total_hours is not None and total_hours < hours - 1e-9:
        raise SpecError(f"budget.total_hours (--total-hours) {total_hours:g}: less than one segment's "
                        f"--hours {hours:g}; raise --total-hours or lower --hours")


def check_resume_budget(hours: float | None, total_hours: float | None, max_segments, current: dict) -> None:
    """`hpcrl resume`'s new numbers, bounded as at submit (current: the run's budget now)."""
    if hours is not None:
        _number(hours, "--hours", 0.001, allow_none=False, maximum=MAX_SEGMENT_HOURS)
    if total_hours is not None:
        _number(total_hours, "--total-hours", 0.001, allow_none=False, maximum=MAX_TOTAL_HOURS)
    if max_segments is not None:
        _number(max_segments, "--max-segments", 1, integer=True, allow_none=False, maximum=MAX_SEGMENTS)
    if total_hours is not None:
        check_budget(hours if hours is not None else current["hours"], total_hours)


def _validate_site(site: dict, hours: float) -> dict:
    from . import backends

    name = site.get("name")
    if site.get("scheduler") not in backends.names():
        raise SiteError(f"site '{name}': scheduler must be one of {one_of(backends.names())}, got {site.get('scheduler')!r}")
    if not site.get("account") and site.get("account_env"):
        site["account"] = os.environ.get(site["account_env"]) or None
    account = site.get("account")
    if account is not None and (not isinstance(account, str) or not ACCOUNT_RE.match(account)):
        raise SiteError(f"--account {account!r}: an account name has letters, digits and _ . - only "
                        f"(e.g. m1234_g); check the value given by --account, {site.get('account_env') or 'the site'} "
                        f"or the site profile")
    for key in _str_list(site.get("required"), f"site '{name}': required"):
        if site.get(key) in (None, ""):
            raise SiteError(_missing_site_value(site, key))
    validate_qos(site, hours)
    for key in ("signal_lead_s", "exit_margin_s", "kill_grace_s"):
        site[key] = _number(site.get(key), f"site '{name}': {key}", 0, allow_none=False)
    site["charge_factor"] = _number(site.get("charge_factor"), f"site '{name}': charge_factor", 0)
    site["modules"] = _str_list(site.get("modules"), f"site '{name}': modules")
    site["setup"] = _str_list(site.get("setup"), f"site '{name}': setup")
    site["env"] = validate_env(site.get("env"), f"site '{name}': env")
    site["job_env"] = validate_env(site.get("job_env"), f"site '{name}': job_env")
    site["scheduler_flags"] = validate_scheduler_flags(site.get("scheduler_flags"), f"site '{name}': scheduler_flags")
    site["trainer_python"] = _trainer_python(site)
    return site


def _trainer_python(site: dict) -> str | None:
    """site.trainer_python as the job will run it: $VARS and ~ expanded here, a relative path made
    absolute (the job runs in the run directory); a bare name is looked up on the job's PATH."""
    value = site.get("trainer_python")
    if value is None:
        return None
    where = f"site '{site.get('name')}': trainer_python (--set site.trainer_python=PATH)"
    if not isinstance(value, str) or not value.strip() or "\n" in value or "\0" in value:
        raise SiteError(f"{where}: expected the path of a Python interpreter, got {value!r}")
    path = os.path.expanduser(os.path.expandvars(value))  # an unset $VAR stays, and submit says "no such file"
    return os.path.abspath(path) if "/" in path else path


def _missing_site_value(site: dict, key: str) -> str:
    name = site.get("name")
    hint = {"account": " --account VALUE,"}.get(key, "")
    env = f" export {site['account_env']}=VALUE," if key == "account" and site.get("account_env") else ""
    return (f"site '{name}' needs a value for '{key}': pass{hint} --set site.{key}=VALUE,{env} or add "
            f"'{key}:' to {user_sites_dir()}/{name}.yaml (with 'extends: {name}')")


def validate_qos(site: dict, hours: float) -> None:
    name, table = site.get("name"), _mapping(site.get("qos_table"), f"site '{site.get('name')}': qos_table")
    qos = site.get("qos")
    if not table:
        return
    if qos not in table:
        raise SiteError(f"--qos {qos}: site '{name}' has no such QOS{did_you_mean(qos, table)}; use one of {one_of(table)}")
    limit = _number(_mapping(table[qos], f"qos_table.{qos}").get("max_hours"), f"site '{name}': qos_table.{qos}.max_hours", 0)
    if limit is not None and hours > limit + 1e-9:
        from .siterules import qos_rules, suggest

        better = suggest(qos_rules(site), hours, chained=False)
        fix = f"; use --qos {better}" if better else f"; use --hours {limit:g} or less"
        raise SiteError(f"site '{name}': qos '{qos}' allows at most {limit:g} h, asked {hours:g} h{fix}")


def site_as_given(site_name: str | None, account: str | None = None, sets: list[str] | None = None) -> dict:
    """A site profile with --account / --set site.KEY overrides, its account from the
    environment if need be, and not validated further (what `hpcrl doctor` examines)."""
    site = load_site(site_name or "local")
    bad = next((item for item in sets or [] if not str(item).startswith("site.")), None)
    if bad is not None:
        raise SpecError(f"--set {bad}: hpcrl doctor takes only site.KEY=VALUE, e.g. --set site.account=m1234_g")
    over = parse_set(sets or [])
    _check_keys(_mapping(over.get("site"), "site"), site_keys(), "site.")
    site = deep_merge(site, {k: v for k, v in (over.get("site") or {}).items() if k != "name"})
    if account is not None:
        site["account"] = account
    if not site.get("account") and site.get("account_env"):
        site["account"] = os.environ.get(site["account_env"]) or None
    return site


def resolve(spec_path: str | None, site_name: str | None, sets: list[str] | None = None,
            flags: dict | None = None) -> dict:
    """Spec file + --set + flags + site -> {'spec': ..., 'site': ...}, validated."""
    spec: dict = {}
    if spec_path is not None:
        spec = load_yaml(Path(spec_path), "spec file")
        _validate_spec_shape(spec)
    spec = deep_merge(spec, parse_set(sets or []))
    spec = deep_merge(spec, _flags_to_spec(flags or {}))
    _validate_spec_shape(spec)
    spec = deep_merge(SPEC_DEFAULTS, spec)
    site = load_site(site_name or spec["site"].get("name") or "local")
    site = deep_merge(site, {k: v for k, v in spec.pop("site").items() if k != "name"})
    return _finish(spec, site)


def _flags_to_spec(flags: dict) -> dict:
    out: dict = {}
    place = {"hours": ("budget", "hours"), "hours_min": ("budget", "hours_min"),
             "total_hours": ("budget", "total_hours"), "max_segments": ("budget", "max_segments"),
             "nodes": ("resources", "nodes"), "qos": ("site", "qos"), "account": ("site", "account")}
    for key, value in flags.items():
        if value is None:
            continue
        if key in place:
            section, name = place[key]
            out.setdefault(section, {})[name] = value
        elif key in ("trainer", "name"):
            out[key] = value
    return out


def _finish(spec: dict, site: dict) -> dict:
    from .trainers import get_trainer

    trainer = get_trainer(spec.get("trainer"))
    spec["name"] = validate_name(spec.get("name") or trainer.name, "name")
    spec["budget"] = _validate_budget(_mapping(spec["budget"], "budget"), site)
    given = dict(_mapping(spec["resources"], "resources"))  # None: the site's default applies
    spec["resources"] = _validate_resources(_mapping(spec["resources"], "resources"), site, trainer)
    spec["env"] = validate_env(spec.get("env"), "env")
    spec["requirements"] = _str_list(spec.get("requirements"), "requirements")
    spec["scheduler_flags"] = validate_scheduler_flags(spec.get("scheduler_flags"), "scheduler_flags")
    spec["args"] = trainer.validate_args(_mapping(spec.get("args"), "args"))
    trainer.check_world(spec["args"], world_size(spec["resources"]))
    site = _validate_site(site, spec["budget"]["hours"])
    siterules.apply(spec, site, given)  # the QOS's own rules: chaining, interactive, shares, charge
    check_budget(spec["budget"]["hours"], spec["budget"]["total_hours"])
    if site["trainer_python"] and spec["requirements"]:
        raise SpecError(f"requirements: {spec['requirements']!r} are not installed when site.trainer_python is set "
                        f"(hpcrl builds no venv then); install them into {site['trainer_python']}'s environment "
                        f"and remove them here")
    return {"spec": spec, "site": site}
