"""The interface every trainer adapter implements (launcher side; never imports torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints.store import CheckpointStore
from ..errors import SpecError
from ..schemas import Schema


def check_override_keys(overrides, pattern, key_group: int, owned, example: str) -> list[str]:
    """The keys of args.overrides, a list of 'key=value' strings matching `pattern` (the key in
    group key_group); one-line SpecError for anything else or for a key hpcrl sets itself."""
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise SpecError(f"args.overrides: expected a list of 'key=value' strings, got {overrides!r}")
    keys = []
    for ov in overrides:
        m = pattern.match(ov)
        if not m:
            raise SpecError(f"args.overrides: '{ov}' is not key=value, e.g. {example}")
        if m.group(key_group) in owned:
            raise SpecError(f"args.overrides: '{m.group(key_group)}' is set by hpcrl (resume, placement or "
                            f"walltime); use the matching args key or leave it out")
        keys.append(m.group(key_group))
    return keys


@dataclass
class TrainerContext:
    """Everything an adapter may use to build its command line for one run.

    Paths are as the job sees them. `site` and `resources` are plain dicts from the resolved
    spec (site keys such as gpus_per_node, chips_per_vm; resources such as nodes).
    """

    run_id: str
    run_dir: Path
    ckpt_dir: Path
    args: dict
    site: dict
    resources: dict
    python: str = "python3"  # the interpreter that runs the trainer inside the job
    extra: dict = field(default_factory=dict)


class Trainer:
    """Base adapter. Subclasses set `name` and `schema` and override `command`."""

    name = "base"
    # The spec's `args:`: every key with its default, type, bounds and a one-line doc
    # (hpcrl/schemas). `defaults` and `required` below are read from it.
    schema: Schema = Schema("base", [])
    defaults: dict = {}    # key -> default (None: required or no default)
    required: tuple = ()   # keys the user must set (no sensible default exists)
    # Runs the trainer as the protocol says (signals + deadline) or needs help (verl, maxtext).
    obeys_protocol = True
    # The oldest Python the trainer's requirements install on (`hpcrl doctor` checks the site's).
    python_min = (3, 10)
    # What a site.trainer_python must have installed (distribution name), and the version hpcrl
    # pins (another one is a warning at submit); None: hpcrl's own code is enough.
    package: str | None = None
    package_version: str | None = None
    # Runs on the site's GPUs: on a GPU site each segment first checks that the venv's torch sees them.
    uses_gpus = False
    # Ranks under torchrun (resources.ranks_per_node x resources.nodes): None, the trainer places
    # its own workers (ranks_hint says how); "gpu", one rank per GPU (default: the GPUs per node);
    # "any", ranks that need no device (default 1). A world of one runs `command` as it is.
    ranks: str | None = None
    ranks_hint = "it uses the GPUs of resources.gpus_per_node itself"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        assert cls.schema.trainer == cls.name, f"{cls.__name__}: schema is for '{cls.schema.trainer}'"
        cls.defaults = cls.schema.defaults
        cls.required = cls.schema.required

    def validate_args(self, args: dict) -> dict:
        """Return args merged over the defaults, every value checked against the schema: unknown,
        missing or bad values raise a one-line SpecError (hpcrl.schemas.ArgError) naming the key."""
        return self.schema.validate(args)

    def check_world(self, args: dict, world: int) -> None:
        """Trainers with `ranks`: a SpecError when the validated args cannot run on `world` ranks
        (resources.nodes x ranks_per_node), so that submit says so instead of a failed job."""

    def check_submit(self, args: dict, world: int) -> None:
        """A SpecError for what renders (so `hpcrl render` still shows the script) but cannot run
        yet: refused at submit rather than hours later, when the job starts."""

    def check_python(self, args: dict, python: str, env: dict) -> None:
        """A SpecError for what the job's interpreter cannot import (e.g. a module:function reward),
        called at submit only where that interpreter is this machine's `python` (env: the job's)."""

    def requirements(self, args: dict, site: dict) -> list[str]:
        """pip requirements of the venv the trainer runs in (empty: hpcrl's own interpreter)."""
        return []

    def runtime_packages(self, args: dict) -> list[str]:
        """Distributions the trainer imports when it runs with these args (the resolve test checks
        that the venv's requirement set installs each one)."""
        return []

    def files(self, ctx: TrainerContext) -> dict[str, str]:
        """Files (name relative to the run dir -> text) written into the run dir at submit."""
        return {}

    def command(self, ctx: TrainerContext) -> list[str]:
        """argv of the trainer process; the renderer quotes each element."""
        raise NotImplementedError

    def entry(self, ctx: TrainerContext) -> list[str]:
        """Trainers with `ranks`: what follows the interpreter in `command` (`-m MODULE ARGS`),
        which torchrun then starts once per rank."""
        raise NotImplementedError

    def env(self, ctx: TrainerContext) -> dict[str, str]:
        """Extra environment for the trainer (no secrets: those come from the user's env)."""
        return {}

    def venv_installer(self, ctx: TrainerContext) -> str | None:
        """A script (one of `files`, as the job sees it) that builds the venv where the job builds
        it (a TPU VM), called with the venv's path and the requirements file, when the trainer's
        packages document an install that `python -m venv` + `pip install -r` cannot do (None)."""
        return None

    def bootstrap(self, ctx: TrainerContext) -> str:
        """Trusted bash run before the trainer starts (e.g. a Ray cluster); '' for none.

        Must quote every value it interpolates with hpcrl.shell.q.
        """
        return ""

    def total_steps(self, args: dict) -> int | None:
        """Steps of the whole run as the trainer counts them in its metrics' "step" (what an ETA
        divides by), or None when the arguments do not fix it (e.g. an epoch count)."""
        return None

    def checkpoint_step(self, run_dir: Path, ckpt_dir: Path, remote: bool = False) -> int | None:
        """The step of the newest complete checkpoint, or None. remote=False (`status`): cheap,
        never the network; remote=True (a segment's hooks, a watcher): may list remote storage
        and cache what it found in the run directory. The default reads the pointer of hpcrl's
        own checkpoint store (hpcrl/checkpoints/store.py)."""
        return CheckpointStore(ckpt_dir).latest_step()


def torchrun_argv(python: str, nodes: int, ranks_per_node: int, rendezvous: list[str], entry: list[str]) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`: the trainer's own interpreter, whichever venv
    is active, and no reliance on a `torchrun` script on PATH) starting `entry` on every rank of this
    node. `rendezvous`: the backend's options (standalone on one machine, c10d on the first node)."""
    return [python, "-m", "torch.distributed.run", "--nnodes", str(int(nodes)),
            "--nproc-per-node", str(int(ranks_per_node)), *rendezvous, *entry]
