"""The trainer's configuration: a frozen, typed object made from the schema's one table."""

import dataclasses

import pytest

from hpcrl.rl import config
from hpcrl.schemas.builtin import SCHEMA


def test_the_config_has_one_field_per_schema_row_and_cannot_change():
    cfg = config.resolve({"lr": 2e-5, "algorithm": "gspo"})
    assert [f.name for f in dataclasses.fields(cfg)] == list(SCHEMA.fields)
    assert cfg.lr == cfg["lr"] == 2e-5 and cfg.loss_agg == "seq-mean-token-mean"  # the algorithm's own
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    with pytest.raises(KeyError):
        cfg["no_such_key"]


def test_a_wrong_key_fails_with_the_schemas_one_line_message():
    with pytest.raises(config.ConfigError, match=r"^args\.lrr: unknown argument for trainer 'builtin' "
                                                 r"\(did you mean 'lr'\?\); allowed: "):
        config.resolve({"lrr": 1e-5})
