"""The trusted side of the code sandbox: how an assert test is split, and how it is judged here.

Stdlib only and no relative imports (verl loads it by path beside sandbox.py).

A test's text is parsed here (parsing runs nothing). Each decision it makes (an `assert E`, an
`if E: raise ...`) becomes an expression tree evaluated *in this process*: comparisons, `and`/`or`,
arithmetic, subscripts, displays and a fixed table of calls (math.isclose, abs, round, len,
sorted, str.startswith, ...; `_FUNCS`, `_METHODS`) run here, on plain built-in values. What only
the program can compute (a call of its function, a name it binds) is a *hole*: its source goes to
the sandbox, which sends back its value as data (decode()). What needs no program but is beyond the
table (`collections.Counter('ab')`) is evaluated in a *clean* sandbox that ran no program.

A decision is judged inside (counted in Result.inside, reward/judged_inside) only where the hole
itself computes with the test's values in the program's process: an operator or comparison, or a
call of something that is not the program's own (`isinstance(f(x), C)`: the program may rebind
`isinstance`), inside the hole; and statements that decide by raising and cannot be split (a loop
of asserts). Those run in a sandbox of their own, so their text never reaches another test's
program.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from dataclasses import dataclass

MAX_DEPTH = 100      # nesting of a value (both sides agree on it)
MAX_ITEMS = 1 << 24  # the longest sequence a trusted operation may build here
_SINGLETONS = (None, True, False)


class Unsafe(Exception):
    """The node cannot be evaluated here (it is a hole, or needs the clean sandbox)."""


# ------------------------------------------------------------------ values (decode)

def decode(value, depth: int = 0):
    """Plain built-in values from the sandbox's JSON (tagged: {"t": [...]} tuple, {"s": [...]}
    set, {"d": [[k, v], ...]} dict, {"b": "latin-1"} bytes, {"c": [re, im]} complex, {"x": hex} a
    long int); ValueError for anything else. What it returns is made here, of built-in types only,
    so no comparison with it runs code the program chose."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [decode(v, depth + 1) for v in value]
    if kind is dict and len(value) == 1:
        (tag, body), = value.items()
        if tag == "t" and type(body) is list:
            return tuple(decode(v, depth + 1) for v in body)
        if tag == "s" and type(body) is list:
            return frozenset(_hashable(decode(v, depth + 1) for v in body))
        if tag == "d" and type(body) is list and all(type(kv) is list and len(kv) == 2 for kv in body):
            keys = _hashable(decode(kv[0], depth + 1) for kv in body)
            return dict(zip(keys, (decode(kv[1], depth + 1) for kv in body)))
        if tag == "x" and type(body) is str and len(body) <= MAX_ITEMS:  # an int too long for decimal JSON
            return int(body, 16)
        if tag == "b" and type(body) is str:
            return body.encode("latin-1")
        if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(*body)
    raise ValueError("not data")


def _hashable(items) -> list:
    """Set elements or dict keys, refused (ValueError) when many share a hash: int and tuple hashes
    are not randomised, so a program could send 100k colliding keys and make building the set
    here quadratic."""
    items = list(items)
    if len(items) - len({hash(x) for x in items}) > 64:  # TypeError for an unhashable one
        raise ValueError("colliding hashes")
    return items


# ------------------------------------------------------------------ what runs here

def _numbers(xs):
    xs = list(xs)
    if not all(type(x) in (int, float, bool, complex) for x in xs):
        raise TypeError("sum of non-numbers")  # sum(lists, []) is quadratic
    return xs


def _sum(xs, start=0):
    return sum(_numbers(xs), start) if type(start) in (int, float, complex) else _refuse()


def _refuse(*a, **k):
    raise TypeError("not evaluated by the judge")


_FUNCS = {"abs": abs, "round": round, "len": len, "sorted": sorted, "min": min, "max": max, "sum": _sum,
          "all": all, "any": any, "set": set, "frozenset": frozenset, "list": list, "tuple": tuple,
          "dict": dict, "str": str, "int": int, "float": float, "bool": bool, "isinstance": isinstance,
          "type": type, "repr": repr, "reversed": reversed, "enumerate": enumerate, "zip": zip,
          "divmod": divmod, "chr": chr, "ord": ord, "bytes": bytes, "complex": complex}
_TYPES = ("set", "frozenset", "list", "tuple", "dict", "str", "int", "float", "bool", "bytes", "complex")
_MATH = {name: getattr(math, name) for name in (
    "isclose", "sqrt", "floor", "ceil", "fabs", "isnan", "isinf", "isfinite", "log", "log2", "log10",
    "exp", "sin", "cos", "tan", "atan", "atan2", "hypot", "trunc", "gcd", "pi", "e", "tau", "inf", "nan",
    "radians", "degrees", "copysign", "fsum", "prod", "comb", "perm", "factorial")}
_MODULES = {"math": _MATH}
# methods of a built-in value that build nothing larger than it (no ljust(10**12), no format)
_METHODS = {"startswith", "endswith", "strip", "lstrip", "rstrip", "lower", "upper", "split", "rsplit",
            "splitlines", "count", "index", "find", "rfind", "isdigit", "isalpha", "isalnum", "isspace",
            "islower", "isupper", "title", "capitalize", "swapcase", "casefold", "keys", "values", "items",
            "get", "issubset", "issuperset", "isdisjoint", "union", "intersection", "difference",
            "symmetric_difference", "real", "imag", "conjugate", "is_integer", "decode", "encode", "join",
            "replace", "removeprefix", "removesuffix"}
SAFE_NAMES = set(_FUNCS) | set(_MODULES) | {"True", "False", "None"}

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
           ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_UNOPS = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}


def _size(v) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple)) else 0


def _binop(op, a, b):
    """An operator on values of the program's: bounded (no 'x' * 10**12, no 10**10**9, no % formatting)."""
    if op is ast.Mult and isinstance(b, int) and _size(a) * max(b, 0) > MAX_ITEMS:
        raise MemoryError("a product too long")
    if op is ast.Mult and isinstance(a, int) and _size(b) * max(a, 0) > MAX_ITEMS:
        raise MemoryError("a product too long")
    if op is ast.Pow and isinstance(a, int) and isinstance(b, int) and b > 0 \
            and max(a.bit_length(), 1) * b > MAX_ITEMS:
        raise MemoryError("a power too large")
    if op is ast.Mod and isinstance(a, (str, bytes)):
        raise TypeError("no % formatting")
    return _BINOPS[op](a, b)


# ------------------------------------------------------------------ planning a test

@dataclass(frozen=True)
class Plan:
    steps: tuple       # what the sandbox runs for the test: (("exec" | "eval", src), ...); each eval is a hole
    actions: tuple     # ("bind", name, node) | ("check", node, negate) | ("step", i): judged here, in order
    clean: tuple       # sources a clean sandbox evaluates (program-free expected sides)
    inside: bool       # some decision of this test comes from the program's process
    alone: bool        # runs in a sandbox of its own (its text decides inside)
    imports: tuple = ()  # the program's own import statements, replayed in the clean sandbox


class _Planner:
    """Splits one test, given the names the program binds (its functions, classes, globals)."""

    def __init__(self, test: str, program_names: frozenset):
        self.test, self.prog = test, set(program_names)
        self.steps, self.actions, self.clean = [], [], []
        self.trusted = set()   # names bound here by the test's own program-free assignments
        self.assigns, self.sent = {}, set()  # their statements; those a hole needed (sent to the program)
        self.inside = self.alone = False

    def seg(self, node) -> str:
        return ast.get_source_segment(self.test, node) or ast.unparse(node)

    def uses_program(self, node) -> bool:
        return any(isinstance(n, ast.Name) and n.id in self.prog for n in ast.walk(node))

    def names(self, node) -> set:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    def plan(self) -> Plan:
        try:
            tree = ast.parse(self.test)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return Plan((("exec", self.test),), (("step", 0),), (), True, True)
        for node in tree.body:
            self.statement(node)
        if not any(a[0] == "check" for a in self.actions):
            self.inside = True  # no decision here: the test passes if nothing raised inside
        return Plan(tuple(self.steps), tuple(self.actions), tuple(self.clean), self.inside, self.alone)

    def statement(self, node) -> None:
        if isinstance(node, ast.Assert):
            return self.decide(node.test, negate=False)
        if (isinstance(node, ast.If) and not node.orelse and len(node.body) == 1
                and isinstance(node.body[0], ast.Raise)):
            return self.decide(node.test, negate=True)  # `if E: raise ...` decides not E
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and not self.uses_program(node.value):
            # test data (`want = [1, 2]`): bound here; the program gets it only if a call needs it
            name = node.targets[0].id
            self.actions.append(("bind", name, self.tree(node.value)))
            self.assigns[name] = node
            self.trusted.add(name)
            self.prog.discard(name)
            return None
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self.steps.append(("exec", self.seg(node)))
            return None
        # anything else runs in the program's process: setup (`x = f(3)`) binds program values,
        # and a statement that can raise a decision (a loop of asserts) is judged inside, alone.
        # The test data it reads goes with it, and from then on is the program's value: a call
        # such as `sort_in_place(xs)` mutates it there, and `assert xs == [1, 2, 3]` must see that
        # (issue 40: a correct in-place program scored 0 on the unmutated copy kept here)
        self.send_inputs(node)
        for name in self.names(node) & self.trusted:
            self.trusted.discard(name)
            self.prog.add(name)
        self.steps.append(("exec", self.seg(node)))
        self.actions.append(("step", len(self.steps) - 1))
        for target in ast.walk(node):
            if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                self.prog.add(target.id)
                self.trusted.discard(target.id)
        if any(isinstance(n, (ast.Assert, ast.Raise)) for n in ast.walk(node)):
            self.inside = self.alone = True
        return None

    def decide(self, test, negate: bool) -> None:
        self.actions.append(("check", self.tree(test), negate))

    def evaluable(self, node) -> bool:
        try:
            self.tree(node, dry=True)
            return True
        except Unsafe:
            return False

    # a tree is a tuple: ("const", v) ("clean", i) ("hole", i) ("name", n) ("call", f, args, kw)
    # ("method", obj, name, args, kw) ("attr", obj, name) ("bin", op, a, b) ("un", op, a)
    # ("cmp", ops, nodes) ("and" | "or", nodes) ("if", c, a, b) ("sub", v, i) ("slice", a, b, c)
    # ("seq", kind, nodes) ("dict", keys, values)
    def tree(self, node, dry: bool = False):
        try:
            return self._tree(node, dry)
        except Unsafe:
            if dry:
                raise
        if self.uses_program(node) or self.names(node) & self.prog:
            return self.hole(node)
        if self.names(node) & self.trusted:
            return self.hole(node, tainted=True)  # program-free, but from a value only the sandbox made
        self.clean.append(self.value_src(node))
        return ("clean", len(self.clean) - 1)

    def send_inputs(self, node) -> None:
        """The test's own assignments a hole reads (`x = [3, 1]; assert f(x) == 2`), before it."""
        for name in sorted(self.names(node) & self.trusted - self.sent):
            self.sent.add(name)
            self.send_inputs(self.assigns[name].value)
            self.steps.append(("exec", self.seg(self.assigns[name])))

    def value_src(self, node) -> str:
        """The source whose value crosses: a generator expression as the list it yields (a
        generator is not data; `all(f(x) == y for x in xs)` is judged here on that list)."""
        if isinstance(node, ast.GeneratorExp):
            return ast.unparse(ast.ListComp(elt=node.elt, generators=node.generators))
        return self.seg(node)

    def hole(self, node, tainted: bool = False):
        self.send_inputs(node)
        self.steps.append(("eval", self.value_src(node)))
        if tainted or self.leaky(node):
            self.inside = True
        return ("hole", sum(1 for kind, _ in self.steps if kind == "eval") - 1)

    def leaky(self, node) -> bool:
        """True if the hole computes with the test's values in the program's process: an operator,
        a comparison, or a call of something not the program's own, on the program's values."""
        for n in ast.walk(node):
            if not self.uses_program(n):
                continue  # an input to the program's call: whatever it is, the program only loses
            if isinstance(n, (ast.Compare, ast.BoolOp, ast.BinOp, ast.IfExp, ast.UnaryOp, ast.Lambda,
                              ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                return True
            if isinstance(n, ast.Call):
                f = n.func
                own = (isinstance(f, ast.Name) and f.id in self.prog) or \
                      (isinstance(f, ast.Attribute) and self.uses_program(f.value))
                if not own or (isinstance(f, ast.Attribute) and f.attr in _METHODS and n.args):
                    return True  # `r.startswith('ab')` on an object of the program's: its method decides
        return False

    def _tree(self, node, dry: bool):
        t = lambda n: self.tree(n, dry)
        if isinstance(node, ast.Constant):
            return ("const", node.value)
        if isinstance(node, ast.Name):
            if node.id in self.trusted:
                return ("name", node.id)
            if node.id in ("True", "False", "None"):
                return ("const", {"True": True, "False": False, "None": None}[node.id])
            if node.id in _FUNCS and node.id not in self.prog:
                return ("func", node.id)
            raise Unsafe(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in _MODULES and node.value.id not in self.prog \
                    and node.value.id not in self.trusted:
                if node.attr in _MODULES[node.value.id]:
                    return ("mod", node.value.id, node.attr)
                raise Unsafe(node.attr)
            if node.attr in ("real", "imag"):
                return ("attr", t(node.value), node.attr)
            raise Unsafe(node.attr)
        if isinstance(node, ast.Call):
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                raise Unsafe("star")
            if isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS and not (
                    isinstance(node.func.value, ast.Name) and (node.func.value.id in _MODULES
                                                               or node.func.value.id in self.prog)):
                # f(x).startswith(...) is judged here on f(x)'s value; s.get() of an object the
                # program or its setup made (a Stack, a Queue: not data) stays the program's call
                return ("method", t(node.func.value), node.func.attr, tuple(t(a) for a in node.args),
                        tuple((k.arg, t(k.value)) for k in node.keywords))
            f = self._tree(node.func, dry)
            if f[0] not in ("func", "mod"):
                raise Unsafe("call")
            if f[0] == "func" and f[1] in ("isinstance", "type") and any(
                    isinstance(a, ast.Name) and a.id in self.prog for a in node.args):
                raise Unsafe("a program's class")  # isinstance(f(x), C): C is not data
            if f[0] == "func" and f[1] == "isinstance" and len(node.args) == 2 and not self._types(node.args[1]):
                raise Unsafe("isinstance of an unknown type")
            return ("call", f, tuple(t(a) for a in node.args), tuple((k.arg, t(k.value)) for k in node.keywords))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return ("bin", type(node.op), t(node.left), t(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return ("un", type(node.op), t(node.operand))
        if isinstance(node, ast.Compare) and all(type(o) in _CMPOPS for o in node.ops):
            if any(type(o) in (ast.Is, ast.IsNot) for o in node.ops) and not all(
                    isinstance(c, ast.Constant) and any(c.value is s for s in _SINGLETONS)
                    for c in [node.left, *node.comparators] if not self.uses_program(c)):
                raise Unsafe("is")  # identity survives the trip for None, True and False only
            return ("cmp", tuple(type(o) for o in node.ops), (t(node.left), *map(t, node.comparators)))
        if isinstance(node, ast.BoolOp):
            return ("and" if isinstance(node.op, ast.And) else "or", tuple(map(t, node.values)))
        if isinstance(node, ast.IfExp):
            return ("if", t(node.test), t(node.body), t(node.orelse))
        if isinstance(node, ast.Subscript):
            return ("sub", t(node.value), t(node.slice))
        if isinstance(node, ast.Slice):
            part = lambda n: ("const", None) if n is None else t(n)
            return ("slice", part(node.lower), part(node.upper), part(node.step))
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return ("seq", type(node).__name__, tuple(map(t, node.elts)))
        if isinstance(node, ast.Dict) and None not in node.keys:
            return ("dict", tuple(map(t, node.keys)), tuple(map(t, node.values)))
        raise Unsafe(type(node).__name__)

    def _types(self, node) -> bool:
        names = node.elts if isinstance(node, ast.Tuple) else [node]
        return all(isinstance(n, ast.Name) and n.id in _TYPES and n.id not in self.prog for n in names)


@functools.lru_cache(maxsize=4096)
def plan(test: str, program_names: frozenset) -> Plan:
    """The test's steps (what the program's process runs) and actions (what is judged here)."""
    return _Planner(test, program_names).plan()


def program_names(code: str) -> frozenset:
    """Names the program binds at its top level (and `global` ones): a test's name among them is
    the program's value. Its top-level imports are not: a test's `Counter(...)` or `math.pi` means
    the module's, evaluated here or in a clean sandbox that replays the import."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return frozenset()
    names = set()
    def top(stmts):
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(s.name)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                continue
            else:
                for n in ast.walk(s):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        names.add(n.id)
                    elif isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n in s.__dict__.values():
                        names.add(n.name)
                for sub in ("body", "orelse", "finalbody", "handlers"):
                    top([x for x in getattr(s, sub, []) if isinstance(x, ast.stmt)])
    top(tree.body)
    for n in ast.walk(tree):
        if isinstance(n, ast.Global):
            names.update(n.names)
    return frozenset(names)


def program_imports(code: str) -> tuple:
    """The program's top-level imports a clean sandbox replays for a test's expected side
    (`Counter('aab')` after the program's `from collections import Counter`): only those binding
    a module's name to itself (no `as`, no `*`: `from builtins import str as Counter` would let
    the program choose what the expected side means)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return ()
    out = []
    for s in tree.body:
        # never `from __future__ import ...`: replayed after other lines it is a SyntaxError, and the
        # clean sandbox's failure scored a correct program 0 (issue 40); it binds nothing a test reads
        if isinstance(s, (ast.Import, ast.ImportFrom)) and all(a.asname is None and a.name != "*" for a in s.names) \
                and not (isinstance(s, ast.ImportFrom) and (s.level or s.module in ("builtins", "__future__"))):
            out.append(ast.unparse(s))
    return tuple(out)


# ------------------------------------------------------------------ judging a test here

def judge(plan: Plan, values: list, clean: list):
    """(passed, reason) of a test from its holes' values (decoded here) and its clean values
    [(ok, value) | (False, why)]; every decision is made in this process."""
    env = {}
    try:
        holes = [decode(v) for v in values]
    except Exception:  # an overflowing complex, colliding keys, ...: a claim that is not data
        return False, "not_data"
    for action in plan.actions:
        if action[0] == "step":
            continue  # it ran inside without raising (else the sandbox sent an error)
        try:
            if action[0] == "bind":
                env[action[1]] = _eval(action[2], holes, clean, env)
                continue
            ok = bool(_eval(action[1], holes, clean, env))
        except _CleanFailed as e:
            return False, f"clean:{e}"
        except Exception:  # the assert would have raised: the test fails
            return False, "wrong_answer"
        if ok == action[2]:  # negate: `if E: raise` passes when E is false
            return False, "wrong_answer"
    return True, ""


class _CleanFailed(Exception):
    pass


def _eval(node, holes, clean, env):
    e = lambda n: _eval(n, holes, clean, env)
    kind = node[0]
    if kind == "const":
        return node[1]
    if kind == "hole":
        return holes[node[1]]
    if kind == "clean":
        ok, value = clean[node[1]]
        if not ok:
            raise _CleanFailed(value)
        return value
    if kind == "name":
        return env[node[1]]
    if kind == "func":
        return _FUNCS[node[1]]
    if kind == "mod":
        return _MODULES[node[1]][node[2]]
    if kind == "attr":
        return getattr(_builtin(e(node[1])), node[2])
    if kind == "call":
        f = e(node[1])
        return f(*map(e, node[2]), **{k: e(v) for k, v in node[3]})
    if kind == "method":
        obj = _builtin(e(node[1]))
        return getattr(obj, node[2])(*map(e, node[3]), **{k: e(v) for k, v in node[4]})
    if kind == "bin":
        return _binop(node[1], e(node[2]), e(node[3]))
    if kind == "un":
        return _UNOPS[node[1]](e(node[2]))
    if kind == "cmp":
        left = e(node[2][0])
        for op, right_node in zip(node[1], node[2][1:]):
            right = e(right_node)
            if not _CMPOPS[op](left, right):
                return False
            left = right
        return True
    if kind == "and":
        v = True
        for n in node[1]:
            v = e(n)
            if not v:
                return v
        return v
    if kind == "or":
        v = False
        for n in node[1]:
            v = e(n)
            if v:
                return v
        return v
    if kind == "if":
        return e(node[2]) if e(node[1]) else e(node[3])
    if kind == "sub":
        return e(node[1])[e(node[2])]
    if kind == "slice":
        return slice(e(node[1]), e(node[2]), e(node[3]))
    if kind == "seq":
        items = [e(n) for n in node[2]]
        return {"List": list, "Tuple": tuple, "Set": set}[node[1]](items)
    if kind == "dict":
        return dict(zip(map(e, node[1]), map(e, node[2])))
    raise TypeError(kind)


def _builtin(v):
    """Methods are looked up on built-in values only (everything decode() and _FUNCS make is)."""
    if type(v) not in (str, bytes, list, tuple, dict, set, frozenset, int, float, complex, bool):
        raise TypeError("a method of a value that is not plain data")
    return v
