"""`hpcrl export`: a run's trained model as a Hugging Face directory, with where it came from.

- builtin: a checkpoint of hpcrl's store already holds model.safetensors (or, written in parts by
  fsdp ranks, Hugging Face's sharded files and their index: whole tensors, whatever the world
  size that wrote them), config.json and the tokenizer's files. They are copied out with
  each file's digest checked against the manifest on the way (a corrupt checkpoint is refused),
  leaving out what only a resume needs (optimizer, RNG, reference, trainer state). The weights
  (float32 masters in the checkpoint) are written in --dtype, default the model's own (its
  config.json's); torch is imported only to convert them.
- verl: verl's own merger (`python -m verl.model_merger merge --backend fsdp`) in the run's venv.
- maxtext: MaxText's own converter (`maxtext.checkpoint_conversion.to_huggingface`).
The last two are rendered (and run with --execute where their venv exists on this machine).

Every export writes EXPORT_RECORD into the directory and appends a line to the run's
exports.jsonl (RunLayout.exports), which `status RUN` reads for the newest export.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from .atomicio import atomic_write_json
from .checkpoints.store import MANIFEST_FILE, CheckpointStore, entry_algorithm, file_digest, new_hasher, read_manifest
from .errors import HpcrlError
from .protocol import append_metrics
from .runs import Run
from .shell import command_line
from .venv import path_for as venv_path_for

EXPORT_RECORD = "hpcrl-export.json"
# what only a resume needs: not part of a model directory
RESUME_ONLY = {"optimizer.safetensors", "optimizer.pt", "ref.safetensors", "rng.pt", "trainer_state.json",
               MANIFEST_FILE}
# a checkpoint written in parts by fsdp ranks (hpcrl/checkpoints/trainer/parts.py): Hugging Face's sharded layout
MODEL_INDEX = "model.safetensors.index.json"


def _resume_only(name: str) -> bool:
    return name in RESUME_ONLY or (name.startswith(("optimizer-", "ref-")) and name.endswith(".safetensors"))


def _spec(run: Run) -> dict:
    return json.loads(run.layout.spec.read_text(encoding="utf-8"))


def pick_checkpoint(run: Run, step: int | None, flag: str = "--step") -> tuple[int, Path]:
    """The checkpoint of `step` (default: the newest that is complete) in hpcrl's store; `flag`
    names the option that asked for it in the error (`hpcrl eval`'s is --checkpoint)."""
    store = CheckpointStore(run.layout.checkpoints)
    ckpts = dict(store.list())
    if not ckpts:
        raise HpcrlError(f"run '{run.id}' has no checkpoint yet in {run.layout.checkpoints}")
    if step is None:
        found = store.find_latest(deep=False)
        if found is None:
            raise HpcrlError(f"run '{run.id}': no complete checkpoint in {run.layout.checkpoints}")
        return found
    if step not in ckpts:
        raise HpcrlError(f"{flag} {step}: run '{run.id}' has checkpoints at steps "
                         f"{', '.join(map(str, sorted(ckpts)))} (older ones are pruned: keep_last)")
    return step, ckpts[step]


def _copy_checked(src: Path, dst: Path, entry: dict) -> None:
    algorithm = entry_algorithm(entry)
    try:
        h = new_hasher(algorithm)
    except ValueError as e:
        raise HpcrlError(f"cannot check {src}: {e}") from None
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(1 << 22):
            h.update(chunk)
            fout.write(chunk)
    if h.hexdigest() != entry.get(algorithm) or dst.stat().st_size != entry.get("size"):
        raise HpcrlError(f"checkpoint file {src} fails its {algorithm} check: the checkpoint is damaged; "
                         f"export an older one with --step")


def _fresh_out(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HpcrlError(f"--out {out}: exists and is not an empty directory; choose a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(os.path.join(out.parent, f".{out.name}.tmp-{os.getpid()}"))


DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # name -> safetensors' dtype tag


def _config_dtype(config: Path) -> str | None:
    """The model's own dtype as its config.json states it (transformers 5 "dtype", older "torch_dtype")."""
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return name if name in DTYPES else None


def _header_dtypes(path: Path) -> set:
    """The tensor dtype tags of a safetensors file, from its JSON header alone (no torch)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _cast_weights(directory: Path, dtype: str) -> None:
    """Every floating tensor of the directory's model files in `dtype` (the trainer keeps float32
    masters; a bf16 model is exported as bf16), config.json saying so. torch is imported only when
    a file needs converting."""
    floats = {"F64", "F32", "BF16", "F16"}
    files = sorted(directory.glob("model*.safetensors"))
    todo = [f for f in files if (_header_dtypes(f) & floats) - {DTYPES[dtype]}]
    if todo:
        import torch
        from safetensors.torch import load_file, save_file

        for f in todo:
            tensors = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v)
                       for k, v in load_file(f).items()}
            save_file(tensors, f, metadata={"format": "pt"})
    config = directory / "config.json"
    cfg = json.loads(config.read_text(encoding="utf-8"))
    if not todo and cfg.get("dtype") == dtype:
        return  # nothing to change: the files stay the checkpoint's, byte for byte
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    index = directory / MODEL_INDEX
    if todo and index.exists():  # its total_size counts the bytes of the weights
        data = json.loads(index.read_text(encoding="utf-8"))
        data.setdefault("metadata", {})["total_size"] = sum(_tensor_bytes(f) for f in files)
        index.write_text(json.dumps(data, indent=1, sort_keys=True))


def _tensor_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - n


def export_builtin(run: Run, step: int | None, out: Path, dtype: str | None = None) -> dict:
    step, path = pick_checkpoint(run, step)
    manifest = read_manifest(path)
    if manifest is None:
        raise HpcrlError(f"checkpoint {path}: missing or unreadable {MANIFEST_FILE}")
    files = {rel: e for rel, e in manifest["files"].items() if not _resume_only(Path(rel).name)}
    weights = MODEL_INDEX if MODEL_INDEX in files else "model.safetensors"
    missing = [f for f in (weights, "config.json") if f not in files]
    if missing:
        raise HpcrlError(f"checkpoint {path} has no {', '.join(missing)}: not a built-in trainer's model checkpoint")
    tmp = _fresh_out(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel, entry in sorted(files.items()):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            _copy_checked(path / rel, tmp / rel, entry)
        dtype = dtype or _config_dtype(tmp / "config.json") or "float32"
        _cast_weights(tmp, dtype)
        record = {"run": run.id, "run_dir": str(run.dir), "trainer": "builtin", "step": step,
                  "checkpoint": str(path), "manifest_sha256": file_digest(path / MANIFEST_FILE,
                                                                                    "sha256"),
                  "model_digest": files[weights], "dtype": dtype, "files": sorted(files), "out": str(out.resolve()),
                  "time": round(time.time(), 3)}
        atomic_write_json(tmp / EXPORT_RECORD, record)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    append_metrics(run.layout.exports, record)
    return record


# ---------------------------------------------------------------- other trainers: their converters


def run_python(resolved: dict) -> str:
    """The interpreter the run's trainer runs with: its venv's, else the site's python."""
    venv = venv_path_for(resolved)
    return f"{venv}/bin/python" if venv else (resolved["site"].get("python") or "python3")


def verl_argv(run: Run, resolved: dict, step: int | None, out: Path) -> tuple[int, list[str]]:
    from .trainers.verl import verl_checkpoint_step

    step = step if step is not None else verl_checkpoint_step(run.layout.checkpoints)
    if step is None:
        raise HpcrlError(f"run '{run.id}' has no verl checkpoint yet in {run.layout.checkpoints}")
    actor = run.layout.checkpoints / f"global_step_{step}" / "actor"
    if not actor.is_dir():
        have = sorted(int(p.name.split("_")[-1]) for p in run.layout.checkpoints.glob("global_step_*")
                      if p.name.split("_")[-1].isdigit())
        raise HpcrlError(f"--step {step}: run '{run.id}' has verl checkpoints at steps {', '.join(map(str, have)) or 'none'}")
    return step, [run_python(resolved), "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                  "--local_dir", str(actor), "--target_dir", str(out)]


def maxtext_argv(run: Run, resolved: dict, step: int | None, out: Path) -> tuple[int, list[str]]:
    from .trainers import get_trainer
    from .trainers.base import TrainerContext

    trainer = get_trainer("maxtext")
    ctx = TrainerContext(run_id=run.id, run_dir=run.dir, ckpt_dir=run.layout.checkpoints,
                         args=resolved["spec"]["args"], site=resolved["site"], resources=resolved["spec"]["resources"])
    step = step if step is not None else trainer.checkpoint_step(run.dir, run.layout.checkpoints)
    if step is None:
        raise HpcrlError(f"run '{run.id}' has no MaxText checkpoint yet under {trainer.checkpoint_root(ctx)}")
    keys = trainer.keys(ctx)
    params = f"{trainer.checkpoint_root(ctx)}/{step}/items"
    return step, [run_python(resolved), "-m", "maxtext.checkpoint_conversion.to_huggingface",
                  "src/maxtext/configs/base.yml", f"model_name={keys['model_name']}",
                  f"load_parameters_path={params}", f"base_output_directory={out}", "scan_layers=false"]


CONVERTERS = {"verl": verl_argv, "maxtext": maxtext_argv}


def converter(run: Run, step: int | None, out: Path) -> tuple[int, list[str]]:
    resolved = _spec(run)
    kind = resolved["spec"]["trainer"]
    if kind not in CONVERTERS:
        raise HpcrlError(f"run '{run.id}': trainer {kind} has no checkpoint to export (builtin, verl, maxtext do)")
    return CONVERTERS[kind](run, resolved, step, out)


def execute(run: Run, step: int, argv: list[str], out: Path) -> dict:
    """Run a rendered converter (its interpreter must exist here) and record the export."""
    import subprocess

    if not Path(argv[0]).exists() and shutil.which(argv[0]) is None:
        raise HpcrlError(f"{argv[0]} is not on this machine: run the printed command where the run's venv is")
    rc = subprocess.run(argv).returncode
    if rc != 0:
        raise HpcrlError(f"the converter exited with {rc}: {command_line(argv)}")
    digest = hashlib.sha256(command_line(argv).encode()).hexdigest()[:16]
    record = {"run": run.id, "run_dir": str(run.dir), "trainer": _spec(run)["spec"]["trainer"], "step": step,
              "command": argv, "command_sha256": digest, "out": str(out.resolve()), "time": round(time.time(), 3)}
    atomic_write_json(out / EXPORT_RECORD, record)
    append_metrics(run.layout.exports, record)
    return record


def export(run: Run, step: int | None, out: Path, execute_converter: bool = False,
           dtype: str | None = None) -> tuple[dict | None, list | None]:
    """(record, None) for an export done; (None, argv) for a converter command to run."""
    if _spec(run)["spec"]["trainer"] in ("builtin",):
        return export_builtin(run, step, Path(out), dtype), None
    if dtype is not None:
        raise HpcrlError(f"--dtype {dtype}: only the built-in trainer's exports are converted here; "
                         "the trainer's own converter writes its own dtype (leave --dtype out)")
    step, argv = converter(run, step, Path(out))
    if execute_converter:
        return execute(run, step, argv, Path(out)), None
    return None, argv
