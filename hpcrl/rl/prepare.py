"""Make a run self-contained: build the tiny model (or copy SmolLM2) and generate data inside the run dir if asked.

Done once, on the first segment; later segments find the files and reuse them (the build is
deterministic and atomic, so a segment killed half-way just builds again).
"""

from __future__ import annotations

import os
from pathlib import Path


def _path(value) -> Path:
    # recipes say $SCRATCH/...: expanded here, in the job's own environment
    return Path(os.path.expandvars(str(value))).expanduser()


def prepare_model(cfg: dict, run_dir: Path) -> Path:
    if cfg["model"] == "smollm2":  # converted once into the user's cache, copied into the run
        from . import smollm2

        try:
            return smollm2.ensure(run_dir / "model", replace=True)[0]
        except smollm2.Unavailable as e:
            raise FileNotFoundError(f"args.model: {e}") from None
    if cfg["model"] != "tiny":
        path = _path(cfg["model"])
        if not (path / "config.json").is_file():
            from ..errors import not_a_model_dir

            raise FileNotFoundError(not_a_model_dir("args.model", path))
        return path
    path = run_dir / "model"
    if not (path / "config.json").is_file():
        from .tiny import build_tiny_model

        build_tiny_model(path, hidden_size=cfg["tiny_hidden_size"], layers=cfg["tiny_layers"],
                         heads=cfg["tiny_heads"], max_int=cfg["tiny_max_int"], seed=cfg["seed"],
                         vocab=cfg["tiny_vocab"])
    return path


def prepare_data(cfg: dict, run_dir: Path) -> tuple[Path, Path]:
    """(train parquet, val parquet)."""
    if cfg["data"] == "files":
        train = _path(cfg["train_files"])
        val = _path(cfg["val_files"] or cfg["train_files"])
        for key, p in (("train_files", train), ("val_files", val)):
            if not p.is_file():
                raise FileNotFoundError(f"args.{key}: {p} does not exist")
        return train, val
    out = run_dir / "data"
    train, val = out / "train.parquet", out / "test.parquet"
    if not (train.is_file() and val.is_file()) and cfg["data"] == "arithmetic":
        from .data import arithmetic_rows, write_parquet

        rows_train, rows_test = arithmetic_rows(cfg["arithmetic_train_size"], cfg["arithmetic_test_size"],
                                                cfg["seed"], cfg["arithmetic_max_number"])
        write_parquet(rows_test, val)
        write_parquet(rows_train, train)
    if not (train.is_file() and val.is_file()) and cfg["data"] == "code-tiny":
        from .data import code_tiny_rows, write_parquet

        rows_train, rows_test = code_tiny_rows(cfg["code_tiny_train_size"], cfg["code_tiny_test_size"], cfg["seed"])
        write_parquet(rows_test, val)
        write_parquet(rows_train, train)
    if not (train.is_file() and val.is_file()):
        from .data import countdown_rows, write_parquet

        rows_train, rows_test = countdown_rows(
            cfg["countdown_train_size"], cfg["countdown_test_size"], seed=cfg["seed"],
            min_count=cfg["countdown_min_count"], max_count=cfg["countdown_max_count"],
            max_number=cfg["countdown_max_number"], max_target=cfg["countdown_max_target"],
            template=cfg["prompt_template"], ops=cfg["countdown_ops"],
            disjoint=cfg["countdown_test_disjoint"])
        write_parquet(rows_test, val)
        write_parquet(rows_train, train)
    return train, val
