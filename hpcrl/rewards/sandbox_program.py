"""The program's side of a sample: runs the answer and serves the test interpreter's calls.

Not imported: sandbox.py joins this source to the harness's (sandbox_harness.py) and compiles it,
so it uses the harness's globals (os is posix, send(), recv(), confine()). Stdlib only.

This process is forked by the sample's pid 1 *before* the tests are read, so nothing of a test
(an expected value, another test's text) was ever in its memory; what it learns of the tests is
what the test interpreter sends it: the names it uses and the arguments of its calls. What it
sends back is data (plain(): built-in values only, a subclass as its built-in content), a handle
for any other object (its method calls come back here), or an exception's class names and text.
The test interpreter decides every verdict on its side, with Python's own builtins and modules;
nothing this process does to itself (rebinding set, math, sorted, its own encoder) reaches there.
"""
# ruff: noqa: F821  (os, send, recv, confine, Capped come from the harness's globals)

TAG = "\x00hpcrl"          # a tagged tuple: (TAG, kind, ...), for what is not a plain value
MAX_ITEMS = 1 << 20        # values one reply may hold (the interpreter checks it again)
MUTABLE = (list, dict, set, bytearray)


class TooBig(Exception):
    pass


def serve_program(p, lim, rfd, wfd):
    confine(p, lim, p["uid"])
    code, load = p["code"], p.get("load", True)
    p.clear()
    import builtins, io
    real = builtins.__dict__.copy()  # the builtins by name, as they were before the program ran
    state = {"ns": None, "failed": None, "objs": {}}
    cap = lim["output_kb"] * 1024
    import marshal
    if load:  # the row has assert tests: run the answer now, while the test interpreter starts,
        load_module(code, state, cap)  # and say unasked what its functions and classes are
        try:
            send(wfd, marshal.dumps(("k", kinds(state))))
        except BaseException:
            send(wfd, marshal.dumps(("k", {})))
    while True:
        try:
            blob = recv(rfd, 1 << 26)
        except (EOFError, OSError, ValueError):
            blob = None
        if blob is None:  # the test interpreter is done
            os._exit(0)
        try:
            reply = answer(marshal.loads(blob), code, state, real, cap, io)
        except BaseException as e:  # the program may break anything here; it only loses by it
            reply = ("x", "error", describe_error(e))
        try:
            blob = dumps(reply)
        except BaseException as e:
            blob = dumps(("x", "not_data", describe_error(e)))
        send(wfd, blob)


def dumps(reply):
    import marshal
    return marshal.dumps(reply)


def describe_error(e):
    try:
        return (type(e).__name__ + ": " + str(e))[:200]
    except BaseException:
        return "?"


def load_module(code, state, cap):
    # the answer runs once, as a module: at once when the row has assert tests, else on the first
    # request that needs its names (a row of stdin tests only never runs it this way)
    if state["ns"] is not None or state["failed"] is not None:
        return
    import sys
    state["ns"] = ns = {"__name__": "solution"}
    sys.stdout = sys.stderr = Capped(cap)
    try:
        exec(compile(code, "solution.py", "exec", dont_inherit=True), ns)
    except Full as e:
        state["failed"] = ("x", "output_limit", describe_error(e))
    except BaseException as e:
        state["failed"] = ("x", "error", describe_error(e))


def answer(req, code, state, real, cap, io):
    op = req[0]
    if op == "io":
        return run_io(code, req[1], cap, io)
    load_module(code, state, cap)
    if state["failed"] is not None:
        return state["failed"]
    import sys
    sys.stdout = sys.stderr = Capped(cap)
    objs = state["objs"]
    try:
        if op == "d":
            return ("v", [describe(state["ns"], name, objs) for name in req[1]], None)
        target = resolve(req[1], state["ns"], objs)
        if op == "c":
            args = [unwrap(a, state["ns"], objs, real) for a in req[2]]
            kwargs = {k: unwrap(v, state["ns"], objs, real) for k, v in req[3].items()}
            value = target(*args, **kwargs)
            # arguments changed in place come back (a test that checks its list was sorted)
            mutated = [(i, plain(a, objs)) for i, a in enumerate(args) if isinstance(a, MUTABLE)]
            return ("v", plain(value, objs), mutated)
        if op == "g":
            value = getattr(target, req[2])
            if callable(value) and not isinstance(value, type):
                return ("f",)
            return ("v", plain(value, objs), None)
        if op == "s":
            setattr(target, req[2], unwrap(req[3], state["ns"], objs, real))
            return ("v", None, None)
        if op == "o":
            args = [unwrap(a, state["ns"], objs, real) for a in req[3]]
            return ("v", plain(OPS[req[2]](target, *args), objs), None)
        return ("x", "error", "unknown request")
    except Full as e:
        return ("x", "output_limit", describe_error(e))
    except TooBig as e:
        return ("x", "output_limit", str(e))
    except BaseException as e:  # the program's exception goes back by its classes' names
        names = []
        try:
            for k in type.__dict__["__mro__"].__get__(type(e)):
                names.append(str.__str__(k.__name__) if isinstance(k.__name__, str) else "?")
        except BaseException:
            names = ["Exception"]
        return ("e", names, describe_error(e)[:200])


def run_io(code, stdin, cap, io):
    import sys
    out = Capped(cap)
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), out, Capped(cap)
    try:
        exec(compile(code, "solution.py", "exec", dont_inherit=True), {"__name__": "__main__"})
    except SystemExit as e:
        if e.code not in (None, 0):
            return ("x", "error", describe_error(e))
    except Full as e:
        return ("x", "output_limit", describe_error(e))
    except BaseException as e:
        return ("x", "error", describe_error(e))
    return ("v", io.StringIO.getvalue(out), None)


OPS = {
    "len": len, "iter": iter, "next": next, "bool": bool, "str": str, "repr": repr, "hash": hash,
    "int": int, "float": float, "index": lambda o: o.__index__(),
    "getitem": lambda o, k: o[k], "contains": lambda o, k: k in o,
    "setitem": lambda o, k, v: o.__setitem__(k, v), "delitem": lambda o, k: o.__delitem__(k),
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "call": lambda f, *a: f(*a),
}


def resolve(ref, ns, objs):
    kind = ref[0]
    if kind == "n":
        if ref[1] not in ns:
            raise NameError("name '%s' is not defined" % ref[1])
        return ns[ref[1]]
    if kind == "h":
        return objs[ref[1]]
    if kind == "a":
        return getattr(resolve(ref[1], ns, objs), ref[2])
    raise ValueError("bad reference")


def kinds(state):
    """{name: descriptor} of the module's functions, classes and modules (no values: those are
    asked for by name when a test uses one), so a test needs no round trip to learn them."""
    ns = state["ns"]
    if state["failed"] is not None or ns is None:
        return {}
    out = {}
    for name in list(ns)[:2000]:
        if type(name) is str and not name.startswith("__"):
            v = ns[name]
            if isinstance(v, type) or type(v).__name__ == "module" or callable(v):
                out[str.__str__(name)] = describe(ns, name, None)
    return out


def describe(ns, name, objs):
    """What one of the task's names is here: a function, a class, a value, a module, or undefined."""
    if name not in ns:
        return ("u",)
    v = ns[name]
    if isinstance(v, type):
        return ("c", class_names(v))
    if type(v).__name__ == "module":
        return ("m", str.__str__(v.__name__) if isinstance(v.__name__, str) else "")
    if callable(v):
        return ("f",)
    return ("v", plain(v, objs))


def class_names(cls):
    out = []
    for k in type.__dict__["__mro__"].__get__(cls):
        n = k.__name__
        out.append(str.__str__(n) if isinstance(n, str) else "?")
    return out


def unwrap(v, ns, objs, real, depth=0):
    """The interpreter's argument with its tags replaced: a handle by the object, the program's
    name by its value, a builtin or stdlib function by the real one."""
    t = type(v)
    if t is tuple:
        if len(v) >= 2 and v[0] == TAG:
            kind = v[1]
            if kind == "h":
                return objs[v[2]]
            if kind == "n":
                return ns[v[2]]
            if kind == "b":
                return real[v[2]]
            if kind == "m":
                import importlib
                return getattr(importlib.import_module(v[2]), v[3])
            if kind == "r":
                return range(v[2], v[3], v[4])
            if kind == "q":
                import fractions
                return fractions.Fraction(v[2])
            if kind == "D":
                import decimal
                return decimal.Decimal(v[2])
        return tuple(unwrap(x, ns, objs, real, depth + 1) for x in v)
    if t is list:
        return [unwrap(x, ns, objs, real, depth + 1) for x in v]
    if t is dict:
        return {unwrap(k, ns, objs, real, depth + 1): unwrap(x, ns, objs, real, depth + 1) for k, x in v.items()}
    if t is set:
        return {unwrap(x, ns, objs, real, depth + 1) for x in v}
    if t is frozenset:
        return frozenset(unwrap(x, ns, objs, real, depth + 1) for x in v)
    return v


def plain(v, objs, budget=None, depth=0):
    """v as built-in values only (what marshal writes), read through the base types so that no
    method the program overrode runs; any other object stays here and goes as a handle."""
    if budget is None:
        budget = [MAX_ITEMS]
    budget[0] -= 1
    if budget[0] < 0:
        raise TooBig("a value holds more than %d items" % MAX_ITEMS)
    if depth > 100:
        raise TooBig("a value nested deeper than 100")
    d = depth + 1
    if v is None or v is True or v is False:
        return v
    if isinstance(v, int):
        return int.__index__(v)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, list):
        return [plain(x, objs, budget, d) for x in list.__iter__(v)]
    if isinstance(v, tuple):
        return tuple([plain(x, objs, budget, d) for x in tuple.__iter__(v)])
    if isinstance(v, dict):
        return {plain(k, objs, budget, d): plain(x, objs, budget, d) for k, x in dict.items(v)}
    if isinstance(v, set):
        return {plain(x, objs, budget, d) for x in set.__iter__(v)}
    if isinstance(v, frozenset):
        return frozenset([plain(x, objs, budget, d) for x in frozenset.__iter__(v)])
    if isinstance(v, (bytes, bytearray)):
        return bytes(memoryview(v))
    if isinstance(v, complex):
        return complex(complex.real.__get__(v), complex.imag.__get__(v))
    if type(v) is range:
        return (TAG, "r", v.start, v.stop, v.step)
    module = type(v).__module__
    if module == "fractions" and type(v).__name__ == "Fraction":
        return (TAG, "q", "%d/%d" % (int.__index__(v.numerator), int.__index__(v.denominator)))
    if module == "decimal" and type(v).__name__ == "Decimal":
        return (TAG, "D", str(v))
    hid = len(objs) + 1
    objs[hid] = v
    return (TAG, "h", hid, class_names(type(v)))
