"""`hpcrl data convert`: a user's .jsonl/.json/.csv/.parquet rows -> the trainer's (and verl's) schema.

A row becomes {data_source, prompt: [system?, user], ability, reward_model: {style, ground_truth},
extra_info: {split, index}}. With --tests-field the data_source is "code" and ground_truth the
JSON {"tests": [...]} the sandboxed code reward reads; with --answer-field ground_truth is the
answer as text. Rows that cannot be converted are dropped, and the report says how many and why.
"""

from __future__ import annotations

import csv
import json
import random
import string
from collections import Counter
from pathlib import Path

from .data import _messages, code_row, read_records


class ConvertError(ValueError):
    """A user mistake: one line naming the flag or the file."""


def read_any(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConvertError(f"--from {path}: no such file")
    if path.suffix.lower() not in (".jsonl", ".json", ".csv", ".parquet"):
        raise ConvertError(f"--from {path}: use a .jsonl, .json, .csv or .parquet file")
    try:
        if path.suffix.lower() == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                records = list(csv.DictReader(f))
        else:
            records = read_records(path)
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"--from {path}: {e}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ConvertError(f"--from {path}: expected rows of objects (a JSON list, JSON lines, CSV or parquet)")
    if not records:
        raise ConvertError(f"--from {path}: the file has no rows")
    from .data import _plain

    return [_plain(r) for r in records]


def get_field(record: dict, name: str):
    """record[name], or a dotted path into nested objects ('meta.question'); KeyError when absent."""
    value = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(name)
        value = value[part]
    return value


def template_fields(template: str) -> list[str]:
    try:
        names = [name for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ConvertError(f"--template {template!r}: {e} (write {{field}} for a field, {{{{ }}}} for a brace)") from None
    for name in names:
        if not name or not all(p.isidentifier() for p in name.split(".")):
            raise ConvertError(f"--template {template!r}: {{{name}}} is not a field name "
                               "(use {prompt} or a field of the file; {{ }} for a literal brace)")
    return names


def parse_tests(value) -> list:
    """A list of tests from a list, a JSON string of one, or text with one assert per line."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            value = json.loads(text)
        else:
            value = [line.strip() for line in text.splitlines() if line.strip().startswith("assert")]
    if not isinstance(value, list):
        raise ValueError("not a list")
    for t in value:
        if not (isinstance(t, str) or isinstance(t, dict) and {"input", "output"} <= set(t)):
            raise ValueError("a test is an assert string or an {input, output} object")
    return [t if isinstance(t, str) else {"input": str(t["input"]), "output": str(t["output"])} for t in value]


def convert(records: list[dict], prompt_field: str, answer_field=None, tests_field=None, system=None,
            template=None, split="train", data_source=None) -> tuple[list, Counter]:
    """(rows, dropped reasons). ConvertError when a named field is in no row or the template is bad."""
    fields = [f for f in (prompt_field, answer_field, tests_field) if f]
    names = template_fields(template) if template else []
    for name in fields + [n for n in names if n != "prompt"]:
        if not any(_has(r, name) for r in records):
            known = ", ".join(sorted({k for r in records[:100] for k in r}))[:300]
            raise ConvertError(f"field {name!r} is in no row of the file; its fields: {known}")
    rows, dropped = [], Counter()
    for i, rec in enumerate(records):
        try:
            rows.append(_row(rec, i, prompt_field, answer_field, tests_field, system, template, split, data_source))
        except _Drop as d:
            dropped[str(d)] += 1
    return rows, dropped


class _Drop(Exception):
    pass


def _has(record, name) -> bool:
    try:
        get_field(record, name)
        return True
    except KeyError:
        return False


def _value(rec, name, what):
    try:
        value = get_field(rec, name)
    except KeyError:
        raise _Drop(f"no {what} field {name!r}") from None
    if value is None or (isinstance(value, str) and not value.strip()):
        raise _Drop(f"empty {what} field {name!r}")
    return value


def _row(rec, i, prompt_field, answer_field, tests_field, system, template, split, data_source) -> dict:
    prompt = str(_value(rec, prompt_field, "prompt"))
    if template:
        view = _Fields(rec, prompt)
        try:
            prompt = template.format_map(view)
        except KeyError as e:
            raise _Drop(f"no template field {e.args[0]!r}") from None
    if tests_field:
        try:
            tests = parse_tests(_value(rec, tests_field, "tests"))
        except (ValueError, TypeError):
            raise _Drop(f"tests field {tests_field!r} is not a list of tests") from None
        if not tests:
            raise _Drop(f"no tests in {tests_field!r}")
        row = code_row(prompt, tests, split, i, system=system)
        if data_source:
            row["data_source"] = data_source
    else:
        answer = _value(rec, answer_field, "answer") if answer_field else None
        row = {"data_source": data_source or "custom", "prompt": _messages(prompt, system), "ability": "custom",
               "reward_model": {"style": "rule", "ground_truth": None if answer is None else str(answer)},
               "extra_info": {"split": split, "index": i}}
    if answer_field and tests_field:
        row["extra_info"]["answer"] = str(_value(rec, answer_field, "answer"))
    return row


class _Fields(dict):
    """format_map view: {prompt} is the prompt field, {a.b} a nested field, others the record's."""

    def __init__(self, rec, prompt):
        super().__init__()
        self.rec, self.prompt = rec, prompt

    def __missing__(self, key):
        if key == "prompt":
            return self.prompt
        return _Dotted(self.rec, key)


class _Dotted:
    """Lets str.format resolve {meta.question}: attribute access walks the record."""

    def __init__(self, rec, key):
        if key not in rec:
            raise KeyError(key)
        self.value = rec[key]

    def __getattr__(self, name):
        if isinstance(self.value, dict) and name in self.value:
            return _Plain(self.value[name])
        raise KeyError(name)

    def __format__(self, spec):
        return format(self.value, spec)


class _Plain(_Dotted):
    def __init__(self, value):
        self.value = value


def split_rows(rows: list, test_rows: int, seed: int) -> tuple[list, list]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    test = sorted(order[:test_rows])
    keep = set(test)
    train_rows = [rows[i] for i in range(len(rows)) if i not in keep]
    test_rows_ = [rows[i] for i in test]
    for split, part in (("train", train_rows), ("test", test_rows_)):
        for j, r in enumerate(part):
            r["extra_info"].update(split=split, index=j)
    return train_rows, test_rows_


def report(src: Path, n_read: int, written: dict, dropped: Counter) -> str:
    lines = [f"read {n_read} rows from {src}; kept {sum(len(r) for r in written.values())}, "
             f"dropped {sum(dropped.values())}"]
    lines += [f"  dropped {n}: {why}" for why, n in dropped.most_common()]
    lines += [f"wrote {len(rows)} rows to {path}" for path, rows in written.items()]
    return "\n".join(lines)
