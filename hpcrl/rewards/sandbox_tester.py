"""The test interpreter: runs the row's tests, with Python's own meaning of every name, and decides
each verdict. Not imported: sandbox.py joins this source to the harness's (sandbox_harness.py).

It is a process of its own in the sample's sandbox (its own uid where there is root, not
dumpable, the same limits), forked after the program's process, so the program never held a
test. The test's text runs here with the real builtins and the modules it imports; the names
that cross to the program are the task's (the trainer computes them: names a test uses that
neither the builtins, nor a module, nor the test itself define). Each is bound here to what the
program says it is: a function or class becomes a proxy whose calls go to the program as data,
a value comes as data. Values come back as plain built-in values, checked here (check()), so a
program that rebinds `set`, defines `class math`, or returns a str subclass with a lying method
changes nothing on this side. An object that is not data stays in the program and is a handle
here; a handle compared with a plain value is never equal to it.

What cannot cross (a function of the test's passed to the program, a generator of the test's)
stops the test with `inside`: the trainer then runs that test alone beside the program (counted
in judged_inside). What goes to the trainer is only verdicts.
"""
# ruff: noqa: F821  (os, send, recv, confine, quote, TAG come from the harness's and program's globals)

MAX_REPLY = 1 << 23


class Inside(BaseException):
    """The test needs something that cannot cross as data: it runs beside the program instead."""


class Gone(BaseException):
    """The program's process ended (its CPU limit, a crash, os._exit)."""


class Refused(BaseException):
    def __init__(self, kind, text):
        BaseException.__init__(self, text)
        self.kind = kind


def run_tests(p, lim, tests, wfd, rfd, out):
    for t in tests:  # the tests' stdlib modules, imported while the interpreter's files are
        for name in (t[3] + t[5] if t[0] == "t" else ()):  # readable (plain as root: a prefix in /root)
            try:
                __import__(name)
            except BaseException:
                pass
    confine(p, lim, p["tester_uid"], "/")
    libc("prctl")(4, 0)  # PR_SET_DUMPABLE 0: no /proc/PID/mem or ptrace of this process by the program
    p.clear()
    import builtins
    link = Link(wfd, rfd)
    g = {"__name__": "__main__", "__builtins__": builtins}
    if any(t[0] == "t" for t in tests):  # the program's first word: its functions and classes
        link.hello()
    verdicts = []
    for t in tests:
        if t[0] == "io":
            verdicts.append(io_verdict(link, t[1], t[2]))
            continue
        _, src, crossing, modules, inside, _ = t
        if inside:
            verdicts.append(["inside"])
            continue
        verdicts.append(assert_verdict(link, g, src, crossing, modules))
        if link.gone:  # every later test needs the program too
            verdicts += [["fail", "gone", "the program's process ended"]] * (len(tests) - len(verdicts))
            break
    text = '{"tests":[' + ",".join("[" + ",".join(quote(x) for x in v) + "]" for v in verdicts) + "]}"
    blob = text.encode()
    while blob:
        blob = blob[os.write(out, blob):]


def io_verdict(link, stdin, want):
    try:
        got = link.ask(("io", stdin))
    except Gone:
        return ["fail", "gone", "the program's process ended"]
    except Refused as e:
        return ["fail", e.kind, str(e)[:200]]
    if got[0] == "e":
        return ["fail", "error", got[2]]
    if type(got[1]) is not str:
        return ["fail", "not_data", "stdout is not text"]
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]
    return ["pass"] if norm(got[1]) == norm(want) else ["fail", "wrong_answer", "stdout differs"]


def assert_verdict(link, g, src, crossing, modules):
    try:
        for name in modules:  # a stdlib module the test uses and does not import itself (MBPP's math)
            if name not in g:
                try:
                    g[name] = __import__(name)
                except BaseException:
                    pass
        # a function, class or module of the program's is asked for once per sample; a value (or
        # a name not yet defined) again before each test that uses it, as the program may change it
        ask = [name for name in crossing if name not in link.kinds]
        if ask:
            kinds = link.value(link.ask(("d", ask)))
            if type(kinds) is not list or len(kinds) != len(ask):
                raise Refused("not_data", "the program's reply is not data")
            for name, kind in zip(ask, kinds):
                if type(kind) is not tuple or not kind or type(kind[0]) is not str:
                    raise Refused("not_data", "the program's reply is not data")
                if kind[0] in ("f", "c", "m"):
                    link.kinds[name] = kind
                bind_name(link, g, name, kind)
        for name in crossing:
            if name in link.kinds and name not in ask:
                bind_name(link, g, name, link.kinds[name])
        link.stopped = None
        exec(compile(src, "test", "exec", dont_inherit=True), g)
        if link.stopped is not None:  # raised inside the test and caught there by a bare except
            raise link.stopped
    except Inside:
        return ["inside"]
    except Gone:
        return ["fail", "gone", "the program's process ended"]
    except Refused as e:
        return ["fail", e.kind, str(e)[:200]]
    except AssertionError as e:
        return ["fail", "wrong_answer", ("assert failed: " + str(e))[:200] if str(e) else "an assert failed"]
    except BaseException as e:
        try:
            what = (type(e).__name__ + ": " + str(e))[:200]
        except BaseException:
            what = "?"
        return ["fail", "error", what]
    return ["pass"]


def bind_name(link, g, name, kind):
    if kind[0] == "u":
        g.pop(name, None)  # a NameError, as Python would say it
    elif kind[0] == "f":
        g[name] = Function(link, ("n", name))
    elif kind[0] == "c":
        g[name] = link.cls(kind[1], ("n", name))
    elif kind[0] == "m":
        try:
            g[name] = __import__(kind[1]) if "." not in kind[1] else __import__(kind[1], fromlist=["_"])
        except BaseException:
            g.pop(name, None)
    else:
        g[name] = kind[1]


class Link:
    """The pipe pair to the program: one request, one reply, in turn."""

    def __init__(self, wfd, rfd):
        self.wfd, self.rfd, self.gone, self.classes, self.stopped = wfd, rfd, False, {}, None
        self.kinds = {}  # name -> what the program said it is, for its functions, classes, modules
        self.broken = None  # (reason, text): the channel carried what is not a reply; no later one is read

    def hello(self):
        """The program's unasked first message, once it ran as a module: {name: descriptor} of its
        functions, classes and modules. Anything else in it is ignored (asked for by name later)."""
        import marshal
        try:
            blob = recv(self.rfd, MAX_REPLY)
        except ValueError as e:  # longer than MAX_REPLY: every later reply would be misread too
            self.broken = ("output_limit", str(e))
            return
        except OSError:
            blob = None
        if blob is None:
            self.gone = True
            return
        try:
            msg = marshal.loads(blob)
        except BaseException:
            msg = None
        if type(msg) is not tuple or len(msg) != 2 or msg[0] != "k" or type(msg[1]) is not dict:
            self.broken = ("not_data", "the program's first message is not data")
            return
        for name, kind in list(msg[1].items())[:2000]:
            if type(name) is str and type(kind) is tuple and kind and kind[0] in ("f", "c", "m") and \
                    all(type(x) in (str, list) for x in kind):
                if kind[0] == "c" and not (len(kind) == 2 and type(kind[1]) is list):
                    continue
                self.kinds[name] = kind

    def ask(self, req):
        try:
            return self._ask(req)
        except (Inside, Gone, Refused) as e:
            self.stopped = e
            raise

    def _ask(self, req):
        import marshal
        if self.broken is not None:
            raise Refused(*self.broken)
        if self.gone:
            raise Gone()
        try:
            send(self.wfd, marshal.dumps(self.encode(req)))
            blob = recv(self.rfd, MAX_REPLY)
        except OSError:
            blob = None
        except EOFError:
            blob = None
        except ValueError as e:  # longer than MAX_REPLY: its bytes are left unread
            self.broken = ("output_limit", str(e))
            raise Refused("output_limit", str(e))
        if blob is None:
            self.gone = True
            raise Gone()
        try:
            reply = marshal.loads(blob)
        except BaseException:
            raise Refused("not_data", "the program's reply is not data")
        if type(reply) is not tuple or not reply or type(reply[0]) is not str:
            raise Refused("not_data", "the program's reply is not data")
        if reply[0] == "x":
            raise Refused(str(reply[1]) if len(reply) > 1 and type(reply[1]) is str else "error",
                          reply[2] if len(reply) > 2 and type(reply[2]) is str else "")
        if reply[0] == "e":
            self.throw(reply)
        return reply

    def throw(self, reply):
        names = reply[1] if len(reply) > 1 and type(reply[1]) is list else []
        names = [n for n in names if type(n) is str][:50]
        text = reply[2] if len(reply) > 2 and type(reply[2]) is str else ""
        import builtins
        if names and names[0] in ("StopIteration", "StopAsyncIteration"):
            raise StopIteration
        for n in names:
            base = getattr(builtins, n, None)
            if isinstance(base, type) and issubclass(base, BaseException) and base not in (SystemExit, KeyboardInterrupt):
                if n == names[0]:
                    raise base(text)
                raise self.exc_class(names[0], base)(text)
        raise self.exc_class(names[0] if names else "Exception", Exception)(text)

    def exc_class(self, name, base):
        key = ("exc", name)
        if key not in self.classes:
            self.classes[key] = type(name, (base,), {})
        return self.classes[key]

    def cls(self, names, ref):
        """The tester's stand-in for one of the program's classes: calling it makes an object in
        the program (a handle here); isinstance() works by the class names the program gave."""
        names = [n for n in names if type(n) is str] or ["object"]
        import builtins
        for n in names[1:]:
            base = getattr(builtins, n, None)
            if isinstance(base, type) and issubclass(base, BaseException):
                return self.exc_class(names[0], base)
        key = ("cls", names[0])
        if key not in self.classes:
            self.classes[key] = RemoteClass(names[0], (Handle,), {"_link": self, "_ref": ref})
        elif ref[0] == "n":  # first met as an object's class: calling it must reach the class
            type.__setattr__(self.classes[key], "_ref", ref)
        return self.classes[key]

    def value(self, reply):
        try:
            return self._value(reply)
        except Refused as e:
            self.stopped = e
            raise

    def _value(self, reply):
        if reply[0] == "f":
            raise Refused("not_data", "unexpected reply")
        if len(reply) < 2:
            raise Refused("not_data", "the program's reply is not data")
        return self.check(reply[1], [1 << 20], 0)

    def check(self, v, budget, depth):
        """The program's value made of this interpreter's built-in types only; tags become a
        handle, a range, a Fraction or a Decimal."""
        budget[0] -= 1
        if budget[0] < 0 or depth > 100:
            raise Refused("output_limit", "a value is too large or too deeply nested")
        t = type(v)
        if v is None or t in (bool, int, float, complex, str, bytes):
            return v
        d = depth + 1
        if t is list:
            return [self.check(x, budget, d) for x in v]
        if t is tuple:
            if len(v) >= 2 and v[0] == TAG and type(v[1]) is str:
                return self.tagged(v)
            return tuple([self.check(x, budget, d) for x in v])
        if t is dict:
            return {self.check(k, budget, d): self.check(x, budget, d) for k, x in v.items()}
        if t is set:
            return {self.check(x, budget, d) for x in v}
        if t is frozenset:
            return frozenset([self.check(x, budget, d) for x in v])
        raise Refused("not_data", "a value is not data: " + t.__name__[:60])

    def tagged(self, v):
        kind = v[1]
        try:
            if kind == "h" and type(v[2]) is int and type(v[3]) is list:
                cls = self.cls(v[3], ("h", v[2]))
                if not issubclass(cls, Handle):  # an exception object the program returned
                    cls = self.cls(["object"], ("h", v[2]))
                h = object.__new__(cls)
                object.__setattr__(h, "_ref", ("h", v[2]))
                object.__setattr__(h, "_names", tuple(n for n in v[3] if type(n) is str))
                return h
            if kind == "r" and all(type(x) is int for x in v[2:5]):
                return range(v[2], v[3], v[4])
            if kind == "q" and type(v[2]) is str and len(v[2]) < 10000:
                import fractions
                return fractions.Fraction(v[2])
            if kind == "D" and type(v[2]) is str and len(v[2]) < 10000:
                import decimal
                return decimal.Decimal(v[2])
        except (IndexError, ValueError, ZeroDivisionError, ArithmeticError):
            pass
        raise Refused("not_data", "a value is not data")

    def encode(self, v, depth=0):
        """An argument of the test's as data for the program; what cannot cross raises Inside."""
        t = type(v)
        if v is None or t in (bool, int, float, complex, str, bytes):
            return v
        if depth > 100:
            raise Inside()
        d = depth + 1
        if t is list:
            return [self.encode(x, d) for x in v]
        if t is tuple:
            return tuple([self.encode(x, d) for x in v])
        if t is dict:
            return {self.encode(k, d): self.encode(x, d) for k, x in v.items()}
        if t is set:
            return {self.encode(x, d) for x in v}
        if t is frozenset:
            return frozenset([self.encode(x, d) for x in v])
        if t is bytearray:
            return bytes(v)
        if t is range:
            return (TAG, "r", v.start, v.stop, v.step)
        if isinstance(v, Handle) or isinstance(v, Function):
            ref = object.__getattribute__(v, "_ref")
            if ref[0] == "h":
                return (TAG, "h", ref[1])
            if ref[0] == "n":
                return (TAG, "n", ref[1])
        if isinstance(v, RemoteClass):
            return (TAG, "n", v._ref[1])
        import builtins, sys
        name = getattr(v, "__name__", None)
        if type(name) is str and getattr(builtins, name, None) is v:
            return (TAG, "b", name)
        mod = getattr(v, "__module__", None)
        if type(mod) is str and type(name) is str and mod in sys.modules and getattr(sys.modules[mod], name, None) is v:
            return (TAG, "m", mod, name)
        module = type(v).__module__
        if module == "fractions" and type(v).__name__ == "Fraction":
            return (TAG, "q", str(v))
        if module == "decimal" and type(v).__name__ == "Decimal":
            return (TAG, "D", str(v))
        raise Inside()

    def call(self, ref, args, kwargs):
        reply = self.ask(("c", ref, list(args), dict(kwargs)))
        result = self.value(reply)
        mutated = reply[2] if len(reply) > 2 and type(reply[2]) is list else []
        for item in mutated:  # what Python means: the argument itself changed in place
            if type(item) is not tuple or len(item) != 2 or type(item[0]) is not int or not 0 <= item[0] < len(args):
                continue
            arg, new = args[item[0]], self.check(item[1], [1 << 20], 0)
            if type(arg) is list and type(new) is list:
                arg[:] = new
            elif type(arg) is dict and type(new) is dict:
                arg.clear()
                arg.update(new)
            elif type(arg) is set and type(new) is set:
                arg.clear()
                arg.update(new)
            elif type(arg) is bytearray and type(new) is bytes:
                arg[:] = new
        return result

    def op(self, ref, name, *args):
        return self.value(self.ask(("o", ref, name, list(args))))


class Function:
    """One of the program's functions (or a method): a call goes to the program as data."""

    def __init__(self, link, ref):
        self._link, self._ref = link, ref

    def __call__(self, *args, **kwargs):
        return self._link.call(self._ref, args, kwargs)

    def __repr__(self):
        return "<the program's %s>" % (self._ref[1] if self._ref[0] == "n" else "function")


class RemoteClass(type):
    def __call__(cls, *args, **kwargs):
        return cls._link.call(cls._ref, args, kwargs)

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return attribute(cls._link, cls._ref, attr)

    def __instancecheck__(cls, obj):
        return isinstance(type(obj), RemoteClass) and type.__getattribute__(cls, "__name__") in getattr(obj, "_names", ())

    def __subclasscheck__(cls, sub):
        return type.__subclasscheck__(cls, sub)


def attribute(link, ref, attr):
    reply = link.ask(("g", ref, attr))
    if reply[0] == "f":
        return Function(link, ("a", ref, attr))
    return link.value(reply)


def _binary(name):
    def method(self, other):
        if not isinstance(other, Handle):  # never equal to a plain value: its __eq__ may lie
            return NotImplemented
        return self._link.op(self._ref, name, other)
    return method


def _unary(name):
    def method(self, *args):
        return self._link.op(self._ref, name, *args)
    return method


class Handle:
    """An object of the program's: attribute reads, method calls and the protocols below are
    requests to the program; comparisons only with another of its objects."""
    _names = ()

    def __getattr__(self, attr):
        if attr.startswith("__") or attr in ("_ref", "_link", "_names"):
            raise AttributeError(attr)
        return attribute(self._link, self._ref, attr)

    def __setattr__(self, attr, value):
        self._link.ask(("s", self._ref, attr, value))

    def __call__(self, *args, **kwargs):
        return self._link.call(self._ref, args, kwargs)

    def __iter__(self):
        return self._link.op(self._ref, "iter")

    def __next__(self):
        return self._link.op(self._ref, "next")

    def __hash__(self):
        return self._link.op(self._ref, "hash")

    __len__ = _unary("len")
    __bool__ = _unary("bool")
    __str__ = _unary("str")
    __repr__ = _unary("repr")
    __int__ = _unary("int")
    __float__ = _unary("float")
    __index__ = _unary("index")
    __getitem__ = _unary("getitem")
    __setitem__ = _unary("setitem")
    __delitem__ = _unary("delitem")
    __contains__ = _unary("contains")
    __eq__ = _binary("eq")
    __ne__ = _binary("ne")
    __lt__ = _binary("lt")
    __le__ = _binary("le")
    __gt__ = _binary("gt")
    __ge__ = _binary("ge")
    __add__ = _binary("add")
    __sub__ = _binary("sub")
    __mul__ = _binary("mul")
