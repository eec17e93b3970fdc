"""The program in a model's answer, and the shape it was found in. Stdlib only and no relative
imports (verl loads it by path beside sandbox.py).

Models do not write one clean ```python block. SmolLM2 on a C-to-Python task wrote correct code
followed by a lone closing fence, and a stray opening fence before its ```python block; a regex
pairing fences took the prose as the program and every sample of the run scored `syntax_error`
(issue 40). So fences are read line by line, and each way the answer could hold its program is a
candidate, tried in this order; the first that parses (with the row's prefix in front) and defines a
function or class wins, else the first that parses:

    fenced             a closed block (python, py, python3 or untagged; another language's never),
                       the last block first
    unclosed_fence     an opening fence never closed (the answer ran out of tokens): what follows
                       it, less a last definition cut off mid-way
    lone_closing_fence the code before a bare fence that opens nothing
    unfenced           no fence at all: the whole answer (what a completion task gets)
    unfenced_in_prose  the code-looking runs of lines between the prose, joined

A tagged opening fence inside an open block means the earlier fence was stray (prose followed it):
the block restarts there. When nothing parses, the most likely candidate is returned with its
shape, so a sample's `syntax_error` says which shape failed (`extract` in the reward's dict).
Parsing is ast.parse only (nothing runs here), bounded in count and size.
"""

from __future__ import annotations

import ast
import re
import textwrap

MAX_CHARS = 100_000      # longer answers are not parsed here (the sandbox refuses them too)
MAX_BLOCKS = 16          # the last blocks considered: the answer is at the end
MAX_PARSES = 64          # ast.parse calls per answer, at most
_FENCE_LINE = re.compile(r"^\s{0,3}(`{3,}|~{3,})[ \t]*([A-Za-z0-9_+.#-]*)[^`]*$")
_PYTHON_TAGS = {"", "python", "py", "python3", "py3", "pycon"}
# a column-0 line that starts code (prose rarely starts with these): a keyword, a decorator, a
# comment, or a name followed by a call, an assignment, an attribute or a subscript
_CODE_START = re.compile(r"^(?:(?:async\s+def|def|class|import|from|if|elif|else|for|while|try|except|finally|"
                         r"with|return|assert|raise|pass|global|nonlocal|del|yield|lambda)\b|@|#|"
                         r"[A-Za-z_][\w.]*\s*(?:\(|\[|=(?!=)|[-+*/%&|^]=|,\s*[A-Za-z_]\w*\s*=))")


class _Budget:
    def __init__(self, prefix: str):
        self.prefix, self.left = prefix, MAX_PARSES

    def parse(self, code: str):
        """The module's AST, or None if it does not parse (or the budget is spent)."""
        if not code.strip() or self.left <= 0 or len(code) > MAX_CHARS:
            return None
        self.left -= 1
        try:
            return ast.parse(self.prefix + code)
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return None


def _defines(tree) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body)


def _fences(lines: list) -> tuple[list, tuple | None, int | None]:
    """(closed blocks [(tag, first line, end line)], the unclosed block or None, the line of the
    first fence when it is bare, else None)."""
    blocks, open_at, tag, first_bare = [], None, "", None
    for i, line in enumerate(lines):
        m = _FENCE_LINE.match(line)
        if not m:
            continue
        t = m.group(2).lower()
        if first_bare is None and open_at is None and not blocks:
            first_bare = i if not t else -1
        if open_at is None:
            open_at, tag = i, t
        elif t:  # an opener inside an open block: the earlier fence was stray, prose followed it
            open_at, tag = i, t
        else:
            blocks.append((tag, open_at + 1, i))
            open_at = None
    unclosed = (tag, open_at + 1, len(lines)) if open_at is not None else None
    return blocks, unclosed, (first_bare if first_bare is not None and first_bare >= 0 else None)


def _text(lines: list, start: int, end: int) -> str:
    return textwrap.dedent("\n".join(lines[start:end])).strip("\n")


def _prose_runs(lines: list, budget: _Budget) -> str:
    """The runs of code-looking lines between prose (fence lines dropped), each parsing, joined."""
    runs, cur = [], None
    for line in lines:
        if _FENCE_LINE.match(line):
            continue
        top = line[:1] not in (" ", "\t") and line.strip()
        if top and _CODE_START.match(line):
            cur = cur if cur is not None else []
            cur.append(line)
        elif top:  # prose at column 0 ends a run
            if cur:
                runs.append(cur)
            cur = None
        elif cur is not None:  # indented or blank: continues the run it is in
            cur.append(line)
    if cur:
        runs.append(cur)
    kept = [_parsing_head(run, budget) for run in runs[:MAX_BLOCKS]]  # a run may end in prose that looked like code
    return "\n\n".join(k for k in kept if k)


def _parsing_head(lines: list, budget: _Budget, drop: int = 8) -> str:
    """The lines, less at most `drop` from the end, that parse ("" if none): an answer cut off
    at the token limit mid-function keeps the functions it finished."""
    for end in range(len(lines), max(0, len(lines) - drop) - 1, -1):
        code = textwrap.dedent("\n".join(lines[:end])).strip("\n")
        if code and budget.parse(code) is not None:
            return code
        if budget.left <= 0:
            break
    return ""


def extract(solution_str: str, prefix: str = "") -> tuple[str, str]:
    """(code, shape) of an answer; the code is "" (shape `no_code`) for an empty answer. `prefix`
    is the row's code the answer continues: candidates are parsed with it in front."""
    if "Assistant:" in solution_str:  # a TinyZero-style prompt+response string
        solution_str = solution_str.split("Assistant:", 1)[1]
    if not solution_str.strip():
        return "", "no_code"
    if len(solution_str) > MAX_CHARS:
        return solution_str.strip(), "unfenced"
    budget = _Budget(prefix)
    lines = solution_str.split("\n")
    blocks, unclosed, first_bare = _fences(lines)
    python = [b for b in blocks if b[0] in _PYTHON_TAGS][-MAX_BLOCKS:]

    def candidates():
        for _, start, end in reversed(python):
            yield _text(lines, start, end), "fenced"
        if unclosed and unclosed[0] in _PYTHON_TAGS:
            yield _parsing_head(lines[unclosed[1]:unclosed[2]], budget), "unclosed_fence"
        if first_bare is not None:
            yield _text(lines, 0, first_bare), "lone_closing_fence"
        if not blocks and unclosed is None:
            yield solution_str.strip(), "unfenced"
        yield _prose_runs(lines, budget), "unfenced_in_prose"

    # the first that defines a function or class wins ("Done." after a lone fence parses too, as
    # a name); else the first that parses at all (a script for stdin/stdout tests defines nothing)
    parsed = None
    for code, shape in candidates():
        tree = budget.parse(code)
        if tree is not None and _defines(tree):
            return code, shape
        if tree is not None and parsed is None:
            parsed = (code, shape)
    if parsed is not None:
        return parsed
    # nothing parses: the likeliest candidate, named, so the syntax error says which shape failed
    if python:
        return _text(lines, python[-1][1], python[-1][2]), "fenced"
    before = _text(lines, 0, first_bare) if first_bare is not None else ""
    if before and _CODE_START.match(before):  # code, then the bare fence: it closed, opening nothing
        return before, "lone_closing_fence"
    if unclosed:
        return _text(lines, unclosed[1], unclosed[2]), "unclosed_fence"
    if first_bare is not None:
        return _text(lines, 0, first_bare), "lone_closing_fence"
    return solution_str.strip(), "unfenced"


def extract_code(solution_str: str, prefix: str = "") -> str:
    return extract(solution_str, prefix)[0]


def has_fenced_block(solution_str: str) -> bool:
    """Whether the program came from a closed fenced block (what `code_format_score` rewards)."""
    return extract(solution_str)[1] == "fenced"
