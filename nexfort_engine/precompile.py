"""Ahead-of-time traced graphs that a restart loads instead of re-tracing the model.

A warm start through ``torch.compile`` hits Inductor's caches but Dynamo still re-traces the
whole module: 9.5–11.8 s for SD2.1's UNet and 18–24 s for SDXL's on an H200 (BENCHMARKS.md,
sixteenth session). Here the first compile traces with torch's
``torch._dynamo.aot_compile.aot_compile_fullgraph`` instead, and the result — the transformed
bytecode, its guards and the bundled AOTAutograd/Inductor output — is saved as one file in the
cache entry (:func:`save`). A restarted process loads it (:func:`load`) and calls it; nothing is
traced. The cold process runs what it has just compiled (:func:`live`: the guards Dynamo built
while tracing, the compiled graph in memory) and only writes the file: loading it back cost SDXL
2.9-3.2 s on an H200 (BENCHMARKS.md, twenty-ninth session). ``NEXFORT_RUN_AS_COMPILED=0`` loads it
back in the cold process too (the compiler's switch); the restart tests load it in a new process.

Guards. torch serialises most of a trace's guards (tensor dtypes/devices/sizes, the shape
environment's relations between dynamic sizes, constants and dict keys read from the inputs and
the module). The rest cannot be serialised and are dropped from torch's set here
(:class:`GuardRecorder`): identity guards on globals and functions, and guards on classes defined
inside other classes, as ComfyUI's ``comfy.ops.*.Linear`` layers are. For each dropped guard the
recorder keeps the guarded name and a *fingerprint* of what it resolved to (:func:`fingerprint`:
a module's name, a function's qualified name and bytecode hash, a class's qualified name, a
constant's value). An artifact is used only while those names resolve to the same fingerprints:
names rooted in the call's inputs other than the module (a patch function inside ComfyUI's
``transformer_options``) are fingerprinted on every call; the others (globals, the module's own
classes) in full once, then again whenever one of them resolves to another object
(:class:`Artifact`). The source of every function the trace inlined is hashed too
(torch's ``SourceInfo``), so an edited or upgraded host file makes the artifact stale. A stale or
unreadable artifact is never an error: the caller traces again.

Size guards taken after torch built its set (a cut graph's parts compile then, so Inductor's
32-bit index bounds come late) are saved beside it as Python expressions over the input sizes
(:class:`SizeGuard`) and checked on every call after torch's.

Dynamic sizes are marked on *copies* of the inputs for the trace only: a loaded artifact's
tensor guards expect unmarked inputs (torch does not save the marks).

Requires torch's ``aot_compile_fullgraph`` (2.11+) and one graph per call (``fullgraph``);
:func:`available` says whether this torch has it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import fractions
import functools
import hashlib
import importlib
import inspect
import io
import json
import logging
import math
import pickle
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._guards import Source

from .cache.store import atomic_write_bytes

log = logging.getLogger(__name__)

#: bump when the file layout below changes: older files are then ignored (stale)
FORMAT = 1
#: per cache entry: ``<entry artifacts>/aot/<n>.bin``
DIRNAME = "aot"
#: written instead of artifacts when the model cannot be traced as one graph: the engine then
#: compiles through ``torch.compile`` without trying again
UNSUPPORTED = "unsupported.txt"
#: the calls whose trace failed, by their structure (signature.call_signature): {signature: why}.
#: A graph break usually comes from what the call carries (another node's patch), not from the
#: model: those calls compile through ``torch.compile``, the others keep their saved graphs
UNSUPPORTED_CALLS = "unsupported_calls.json"
#: guard types torch's own AOT path drops as unserialisable (``CheckFunctionManager``)
_UNSERIALIZABLE = ("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH",
                   "CLOSURE_MATCH", "WEAKREF_ALIVE")


class StaleArtifact(RuntimeError):
    """A saved artifact that does not apply here (other torch, edited sources, changed globals)."""


def available() -> bool:
    """Whether this torch has the ahead-of-time pieces used here."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph  # noqa: F401
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable  # noqa: F401
        from torch._dynamo.hooks import Hooks  # noqa: F401
    except ImportError:
        return False
    return True


def serializable(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """A backend's Inductor output in the form ``aot_compile_fullgraph`` can save (torch 2.11
    requires the backend to return it; 2.14 also wraps Inductor's output itself)."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable, SerializableCallable

    if isinstance(compiled, SerializableCallable) or not hasattr(compiled, "serialize"):
        return compiled
    return BundledAOTAutogradSerializableCallable(compiled)


# -- fingerprints of what a dropped guard guarded

@functools.lru_cache(maxsize=4096)  # per-call fingerprints of patch functions: hash each code once
def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    for c in code.co_consts:
        h.update((_code_digest(c) if isinstance(c, types.CodeType) else repr(c)).encode())
    return h.hexdigest()[:16]


def _module(name: str | None) -> str:
    """A module's name without an install path: ComfyUI imports a custom node package under its
    file path (``/home/u/ComfyUI/custom_nodes/pack.nodes``), so two installs sharing one cache
    name the same code differently."""
    return str(name).replace("\\", "/").rsplit("/", 1)[-1]


def fingerprint(value: Any) -> str:
    """What a guarded name resolves to, as a string that is equal in another process exactly when
    it is the same module, function (qualified name and bytecode), class, builtin or constant."""
    if inspect.ismodule(value):
        return f"module:{_module(value.__name__)}"
    if isinstance(value, type):
        return f"class:{_module(value.__module__)}.{value.__qualname__}"
    if inspect.ismethod(value):
        return f"method:{fingerprint(value.__func__)}:{type(value.__self__).__qualname__}"
    if inspect.isfunction(value):
        return f"function:{_module(value.__module__)}.{value.__qualname__}:{_code_digest(value.__code__)}"
    if inspect.isbuiltin(value):
        return f"builtin:{_module(getattr(value, '__module__', None))}.{value.__qualname__}"
    if isinstance(value, (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)):
        return f"const:{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}:{len(value)}"
    if isinstance(value, dict):
        return f"dict:{sorted(map(repr, value))}"
    if isinstance(value, torch.Tensor):
        return f"tensor:{value.dtype}:{tuple(value.shape)}:{value.device.type}"
    return f"object:{_module(type(value).__module__)}.{type(value).__qualname__}"


#: guards that only ask whether a dict holds one key
_KEY_GUARDS = ("DICT_CONTAINS", "DICT_NOT_CONTAINS")


def contains_fingerprint(key: str, value: Any) -> str:
    """A key-presence guard's fingerprint. A class's ``__dict__`` gains unrelated keys as a process
    runs (Dynamo patches ``nn.Module`` once a ``torch.compile``'d call runs), so the guarded
    dict's full key set differs between processes where the answer to this guard does not."""
    try:
        return f"contains:{key!r}:{key in value}"
    except TypeError:
        return fingerprint(value)


def _guard_key(entry: Any) -> str | None:
    if entry.guard_type not in _KEY_GUARDS:
        return None
    key = getattr(getattr(getattr(entry, "orig_guard", None), "create_fn", None), "keywords", {}).get("key")
    return key if isinstance(key, str) else None


@dataclass(frozen=True)
class DroppedGuard:
    """A guard kept out of torch's saved set, checked here by name and fingerprint."""

    guard_type: str
    name: str
    fingerprint: str | None  # None: the guard only needs the name to resolve
    per_call: bool  # rooted in an input other than the module itself
    #: a key-presence guard (DICT_CONTAINS / DICT_NOT_CONTAINS): its key, and the fingerprint is
    #: whether the dict holds it (:func:`contains_fingerprint`), not the dict's whole key set
    key: str | None = None


_ROOT = re.compile(r"^(?:[A-Za-z_]\w*\()*(?:L\[['\"](\w+)['\"]\]|(G)\[|([A-Za-z_]\w*))")


def _root(name: str) -> str | None:
    """The local a guard name starts from, ``"G"`` for a global, ``None`` if it does not parse."""
    m = _ROOT.match(name.strip())
    if m is None:
        return None
    return "G" if m.group(2) else (m.group(1) or m.group(3))


def _rooted_at(name: str, root: str | None) -> bool:
    return _root(name) == root != "G"


#: dropped guards re-resolved by identity on every call (the rest once: the module's own classes,
#: builtins, imported modules, and dict-content guards whose dict keeps its identity anyway)
_IDENTITY = frozenset({"CLOSURE_MATCH", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "CONSTANT_MATCH",
                       "EQUALS_MATCH", "TYPE_MATCH"})


def _per_call(name: str, self_name: str | None) -> bool:
    """Whether a guard name reads the call's inputs (not globals, not the module itself): such
    guards are fingerprinted on every call."""
    root = _root(name)
    return root is None or root not in ("G", self_name)


class GuardRecorder:
    """``guard_filter_fn`` for :func:`trace`: keeps what torch can save, records the rest."""

    def __init__(self, self_name: str | None, originals: dict[int, Any] | None = None) -> None:
        self.self_name = self_name
        #: id of a stand-in seen while tracing -> the object it stands for (trace_ops.originals)
        self.originals = dict(originals or {})
        self.dropped: list[DroppedGuard] = []
        self.kept = 0

    @staticmethod
    def _savable(entry: Any) -> bool:
        if entry.is_global or entry.guard_type in _UNSERIALIZABLE:
            return False
        if any(t in _UNSERIALIZABLE for t in getattr(entry, "derived_guard_types", ()) or ()):
            return False
        # walks a class's MRO: the saved scope rebuilds modules as plain nn.Module (torch's
        # GuardsStatePickler), where such a walk fails (BENCHMARKS.md, Dynamo-level caching)
        if "__mro__" in entry.name:
            return False
        if entry.guard_type == "TYPE_MATCH" and entry.has_value:
            t = entry.value if isinstance(entry.value, type) else type(entry.value)
            if t.__qualname__ != t.__name__:  # a nested class: torch raises while saving it
                return False
        return True

    def __call__(self, entries: Sequence[Any]) -> list[bool]:
        keep = []
        for e in entries:
            ok = self._savable(e)
            keep.append(ok)
            if ok:
                self.kept += 1
                continue
            fp = None
            key = _guard_key(e)
            if e.has_value:
                value = self.originals.get(id(e.value), e.value)
                try:
                    fp = contains_fingerprint(key, value) if key is not None else fingerprint(value)
                except Exception:  # noqa: BLE001 - an odd object: the name must still resolve
                    fp = None
            self.dropped.append(DroppedGuard(e.guard_type, e.name, fp, _per_call(e.name, self.self_name), key))
        return keep


def source_reduction(obj: Any) -> tuple[type, tuple] | None:
    """How to pickle a guard source (``torch._guards.Source``) whose dataclass has fields computed
    in ``__post_init__`` (``init=False``): by its constructor's fields only. torch 2.11's
    ``Source.__reduce__`` passes every field to the constructor, so such a source saves but
    cannot be loaded (``DefaultsSource.__init__() takes from 3 to 4 positional arguments but 6
    were given``: a guard on a function's default argument, as in a model compiled whole without
    the spatial fold). ``None``: pickle it as torch does."""
    if not isinstance(obj, Source) or not dataclasses.is_dataclass(obj):
        return None
    fields = dataclasses.fields(obj)
    if all(f.init for f in fields):
        return None
    return type(obj), tuple(getattr(obj, f.name) for f in fields if f.init)


@contextlib.contextmanager
def _guard_state_pickling() -> Iterator[None]:
    """Two mends to torch's guard-state pickler while saving.

    It marks a module's plain attributes "missing" by ``id``: a model holding
    ``self.dtype = torch.float16`` (every ComfyUI model) then has that dtype singleton pickled as
    missing wherever it appears, and the saved state fails to load ("empty_strided(): argument
    'dtype' must be torch.dtype, not _Missing", torch 2.14). Values that pickle by value are
    exempted. And guard sources with computed fields are pickled so that they load
    (:func:`source_reduction`, torch 2.11)."""
    try:
        from torch._dynamo.guards import GuardsStatePickler
    except ImportError:
        yield
        return
    original = GuardsStatePickler.reducer_override
    plain = (torch.dtype, torch.device, torch.layout, torch.memory_format, str, int, float, bool, type(None))

    def reducer_override(self: Any, obj: Any) -> Any:
        missing = getattr(self, "missing_values", None)
        if missing is not None and isinstance(obj, plain):
            missing.pop(id(obj), None)
        if (reduced := source_reduction(obj)) is not None:
            return reduced
        return original(self, obj)

    GuardsStatePickler.reducer_override = reducer_override  # type: ignore[method-assign]
    try:
        yield
    finally:
        GuardsStatePickler.reducer_override = original  # type: ignore[method-assign]


class _Globals(dict):
    """A traced function's globals as its guard names read them: the function's module dict itself
    (live: a monkeypatch shows), then what the loaded function was given (torch's import aliases),
    then the names Dynamo installs in the module while tracing, which a new process does not have:
    the builtins (``G['__builtins_dict___0']``) and imported modules (``G['__import_comfy_dot_ops']``)."""

    def __init__(self, live: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        super().__init__(extra or {})
        self.live = live

    def __getitem__(self, key: str) -> Any:
        try:
            return self.live[key]
        except KeyError:
            return super().__getitem__(key)

    def __missing__(self, key: str) -> Any:
        if key.startswith("__builtins_dict___"):
            return builtins.__dict__
        if key.startswith("__import_"):
            name = key[len("__import_"):].replace("_dot_", ".")
            return sys.modules.get(name) or importlib.import_module(name)
        raise KeyError(key)


# -- sources the trace inlined

def _module_lines(module_name: str) -> list[str]:
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    return inspect.getsourcelines(module)[0]


def _source_hashes(compiled: Any) -> list[tuple[str, int, int, str]]:
    out = []
    for s in compiled.source_info().inlined_sources:
        out.append((s.module, s.firstlineno, s.lastlineno, s.checksum))
    return sorted(out)


def _stale_sources(sources: list[tuple[str, int, int, str]]) -> str | None:
    for module, first, last, checksum in sources:
        try:
            text = "".join(_module_lines(module)[first - 1 : last - 1])
        except (OSError, TypeError, ImportError) as e:
            return f"source of {module} unavailable ({type(e).__name__})"
        if hashlib.sha256(text.encode()).hexdigest() != checksum:
            return f"{module} lines {first}-{last} changed since the trace"
    return None


# -- one artifact

def _source_name(source: Any) -> str:
    name = source.name  # a method before torch 2.12, a property since
    return str(name() if callable(name) else name)


@dataclass(frozen=True)
class SizeGuard:
    """A size guard taken after Dynamo built the trace's guards, so not in torch's saved set: the
    compile of a cut graph's parts runs while Dynamo builds them (``compiler._finish_split``), and
    Inductor may specialise on a size there. ``code`` is a Python expression over the symbols,
    ``sources`` each symbol's guard name (``L['x'].size()[2]``)."""

    code: str
    sources: dict[str, str]


def _sympy_guard(text: str, **values: int) -> bool:
    """A size guard Python cannot evaluate as printed, evaluated by sympy (slower: rare)."""
    import sympy
    from torch.utils._sympy import functions

    expr = sympy.sympify(text, locals=dict(vars(functions)))  # FloorDiv, Mod, ... by their names
    return bool(expr.xreplace({sym: sympy.Integer(values[str(sym)]) for sym in expr.free_symbols}))


#: what a printed size guard may call: ``math.floor`` and friends, exact fractions, sympy
_SIZE_GUARD_GLOBALS: dict[str, Any] = {"__builtins__": builtins, "math": math, "Fraction": fractions.Fraction,
                                       "_sympy_guard": _sympy_guard}


def _size_printer() -> Any:
    """torch's ``PythonPrinter`` with rationals as exact fractions (Inductor's int32 index guards
    hold terms such as ``floor(160*s0*s1/3 + 5/6)``, which floats would round)."""
    from torch.utils._sympy.printers import PythonPrinter

    class SizePrinter(PythonPrinter):  # type: ignore[misc]
        def _print_Rational(self, expr: Any) -> str:
            return f"Fraction({int(expr.p)}, {int(expr.q)})"

        def _print_Half(self, expr: Any) -> str:
            return "Fraction(1, 2)"

    return SizePrinter()


def size_guards(shape_env: Any, exprs: Sequence[Any]) -> list[SizeGuard]:
    """:class:`SizeGuard` s for sympy guard expressions of ``shape_env``; ``ValueError`` for one
    that cannot be checked from the call's inputs or does not hold at the traced sizes."""
    import sympy

    from .shapes import traced_sizes

    printer = _size_printer()
    values = traced_sizes(shape_env)
    out = []
    for expr in exprs:
        sources: dict[str, str] = {}
        for sym in sorted(expr.free_symbols, key=str):
            found = shape_env.var_to_sources.get(sym)
            if not found:
                raise ValueError(f"size guard {expr}: {sym} is no input size")
            sources[str(sym)] = _source_name(found[0])
        at = {str(s): int(values[s]) for s in expr.free_symbols}
        guard = SizeGuard(printer.doprint(expr), sources)
        try:
            ok = eval(guard.code, _SIZE_GUARD_GLOBALS, at)  # noqa: S307
        except Exception:  # noqa: BLE001 - a printed form Python cannot evaluate: sympy evaluates it
            args = "".join(f", {name}={name}" for name in sources)
            guard = SizeGuard(f"_sympy_guard({sympy.srepr(expr)!r}{args})", sources)
            try:
                ok = eval(guard.code, _SIZE_GUARD_GLOBALS, at)  # noqa: S307
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"size guard {expr}: {type(e).__name__}: {e}") from e
        if not ok:
            raise ValueError(f"size guard {expr} ({guard.code}) does not hold at the traced sizes")
        out.append(guard)
    return out


@dataclass
class Artifact:
    """One traced graph with its guards: call it through :meth:`check` first.

    The guards kept out of torch's set that do not read the call's inputs (globals, the module's
    own classes) are resolved and fingerprinted in full when the artifact is first checked and
    again whenever any of them resolves to another object: every call evaluates them all in one
    expression of ``id``s (tens of microseconds), so a node that monkeypatches, say, ComfyUI's
    attention function between two prompts is noticed as Dynamo's identity guards would notice
    it."""

    compiled: Any  # torch's AOTCompiledFunction
    dropped: list[DroppedGuard]
    sources: list[tuple[str, int, int, str]]
    namespace: dict[str, Any]  # what global guard names (G[...]) resolve in
    path: Path | None = None
    self_name: str | None = None
    size_guards: list[SizeGuard] = field(default_factory=list)
    _each: list[tuple[DroppedGuard, types.CodeType]] = field(default_factory=list)
    _global: list[tuple[DroppedGuard, types.CodeType]] = field(default_factory=list)
    _ids: types.CodeType | None = None
    #: the global names' ids when last resolved in full, and why they failed then ("" = passed)
    _seen: tuple[tuple[int, ...] | None, str] | None = None
    #: the size guards as two expressions: every symbol's value from the call, then all guards
    _size_syms: tuple[str, ...] = ()
    _size_values: types.CodeType | None = None
    _size_all: types.CodeType | None = None

    def __post_init__(self) -> None:
        if self.size_guards:
            sources = {sym: src for g in self.size_guards for sym, src in g.sources.items()}
            self._size_syms = tuple(sources)
            self._size_values = compile("(" + "".join(f"{src}," for src in sources.values()) + ")",
                                        "<nexfort size guards>", "eval")
            self._size_all = compile(" and ".join(f"({g.code})" for g in self.size_guards),
                                     "<nexfort size guards>", "eval")
        names = []
        for d in self.dropped:
            try:
                code = compile(d.name, "<nexfort guard>", "eval")
            except SyntaxError:
                code = compile("___nexfort_unresolvable", "<nexfort guard>", "eval")
            else:
                if not d.per_call and d.guard_type in _IDENTITY and not _rooted_at(d.name, self.self_name):
                    names.append(d.name)
            (self._each if d.per_call else self._global).append((d, code))
        self._ids = compile("(" + "".join(f"id({n})," for n in dict.fromkeys(names)) + ")", "<nexfort guards>", "eval")

    def _scope(self, f_locals: dict[str, Any]) -> dict[str, Any]:
        return {"G": self.namespace, "L": f_locals, **f_locals}

    def _resolve(self, checks: list[tuple[DroppedGuard, types.CodeType]], scope: dict[str, Any]) -> str | None:
        for d, code in checks:
            try:
                value = eval(code, {"__builtins__": builtins}, scope)  # noqa: S307 - torch's own guard names
            except Exception as e:  # noqa: BLE001 - a name that no longer resolves
                return f"{d.guard_type} {d.name}: {type(e).__name__}"
            if d.fingerprint is None:
                continue
            now = contains_fingerprint(d.key, value) if d.key is not None else fingerprint(value)
            if now != d.fingerprint:
                return f"{d.guard_type} {d.name}: {now} != {d.fingerprint}"
        return None

    def _global_ids(self, scope: dict[str, Any]) -> tuple[int, ...] | None:
        assert self._ids is not None
        try:
            return eval(self._ids, {"__builtins__": builtins}, scope)  # noqa: S307
        except Exception:  # noqa: BLE001 - some name does not resolve: _resolve says which
            return None

    def check(self, args: tuple, kwargs: dict) -> str | None:
        """``None`` if this artifact applies to the call ``(args, kwargs)`` (the module first),
        else why not."""
        f_locals = self.compiled.prepare_f_locals(*args, **kwargs)
        scope = self._scope(f_locals)
        ids = self._global_ids(scope)
        if self._seen is None or ids is None or ids != self._seen[0]:
            self._seen = (ids, self._resolve(self._global, scope) or "")
        if self._seen[1]:
            return self._seen[1]
        if self._each and (why := self._resolve(self._each, scope)) is not None:
            return why
        manager = self.compiled._artifacts.guard_manager
        if not manager.check(f_locals):
            return str(failing_parts(manager.check_verbose(f_locals).verbose_code_parts, f_locals))[:500]
        if self._size_all is not None:
            return self._check_sizes(scope)
        return None

    def _check_sizes(self, scope: dict[str, Any]) -> str | None:
        try:
            found = eval(self._size_values, {"__builtins__": builtins}, scope)  # noqa: S307
            values = dict(zip(self._size_syms, found, strict=True))
            if eval(self._size_all, _SIZE_GUARD_GLOBALS, values):  # noqa: S307 - printed by torch's PythonPrinter
                return None
        except Exception as e:  # noqa: BLE001 - an input without the size a guard reads
            return f"size guards: {type(e).__name__}: {e}"
        for g in self.size_guards:
            if not eval(g.code, _SIZE_GUARD_GLOBALS, values):  # noqa: S307
                return f"size guard {g.code} fails ({', '.join(f'{s}={values[s]}' for s in g.sources)})"
        return "size guards fail"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled.fn(*args, **kwargs)


def failing_parts(parts: Sequence[str], f_locals: dict[str, Any]) -> list[str]:
    """The parts of a failed guard that are false for the call's locals. torch lists every part of
    a relational guard (the shape environment's: dozens of size expressions, each with the source
    line that made it) as its failure; the one that failed is what a recompile reason should name.
    Parts this cannot evaluate (torch's helper functions, globals) are left out, and if none is
    left, all are returned."""
    false = []
    for part in parts:
        code = part.split("  #", 1)[0].strip()
        try:
            if not eval(code, {"__builtins__": builtins}, {"L": f_locals}):  # noqa: S307 - torch's printed guard
                false.append(part)
        except Exception:  # noqa: BLE001, S112 - a part that reads more than the call's locals
            continue
    return false or list(parts)


def trace(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    backend: Callable[..., Any],
    self_name: str | None,
    originals: dict[int, Any] | None = None,
) -> tuple[Any, GuardRecorder]:
    """Trace ``fn(*args, **kwargs)`` into one graph compiled by ``backend`` (which must return
    :func:`serializable` output). The caller enters its shape policy and marks dynamic sizes.
    ``originals``: stand-ins the trace may meet (by id) and what they stand for, which their
    guards are fingerprinted as (:mod:`nexfort_engine.trace_ops`)."""
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    recorder = GuardRecorder(self_name, originals)
    # aot_compile_fullgraph cannot restart a trace, as turning a float input into a tensor does
    with torch._dynamo.config.patch(specialize_float=True), _guard_state_pickling():
        compiled = aot_compile_fullgraph(fn, (args, kwargs), Hooks(guard_filter_fn=recorder), backend)
    return compiled, recorder


def to_bytes(compiled: Any, recorder: GuardRecorder, external: dict[str, Any] | None = None,
             sizes: Sequence[SizeGuard] = ()) -> bytes:
    """The file :func:`load` reads: torch's serialised function plus our dropped guards and the
    size guards taken after torch built its own."""
    with _guard_state_pickling():
        data = type(compiled).serialize(compiled, external).serialized_data
    envelope = {
        "format": FORMAT,
        "torch": torch.__version__,
        "dropped": [vars(d) for d in recorder.dropped],
        "size_guards": [{"code": g.code, "sources": dict(g.sources)} for g in sizes],
        "self_name": recorder.self_name,
        "sources": _source_hashes(compiled),
        "compiled": data,
    }
    return pickle.dumps(envelope, protocol=pickle.HIGHEST_PROTOCOL)


def from_bytes(
    data: bytes,
    root_globals: dict[str, Any],
    inductor_config: dict[str, Any] | None = None,
    external: dict[str, Any] | None = None,
) -> Artifact:
    """Load an artifact; :class:`StaleArtifact` if it does not apply to this process.
    ``inductor_config``: the patches it was compiled with (CUDA graphs are decided at load)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    try:
        envelope = pickle.load(io.BytesIO(data))  # noqa: S301 - our own file, hashed by the cache manifest
    except Exception as e:  # noqa: BLE001
        raise StaleArtifact(f"unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
        raise StaleArtifact("another file format")
    if envelope.get("torch") != torch.__version__:
        raise StaleArtifact(f"saved by torch {envelope.get('torch')}")
    if (why := _stale_sources(envelope["sources"])) is not None:
        raise StaleArtifact(why)
    patch = torch._inductor.config.patch(inductor_config) if inductor_config else contextlib.nullcontext()
    try:
        with patch:
            compiled = AOTCompiledFunction.deserialize(envelope["compiled"], root_globals, external)
    except Exception as e:  # noqa: BLE001 - torch's loader: any failure means "trace again"
        raise StaleArtifact(f"torch could not load it ({type(e).__name__}: {str(e)[:200]})") from e
    namespace = _Globals(root_globals, compiled.fn.__globals__)
    dropped = [DroppedGuard(**d) for d in envelope["dropped"]]
    sizes = [SizeGuard(g["code"], dict(g["sources"])) for g in envelope.get("size_guards") or ()]
    return Artifact(compiled, dropped, envelope["sources"], namespace, self_name=envelope.get("self_name"),
                    size_guards=sizes)


def runnable(compiled: Any) -> bool:
    """Whether a just-traced function (:func:`trace`'s) runs as it is: its compiled graph is
    loaded (a split graph's parts are bytes until loaded, ``split.SplitCallable.runnable``)."""
    fn = compiled._artifacts.compiled_fn
    return getattr(type(fn), "runnable", None) is None or bool(fn.runnable)


def live(compiled: Any, recorder: GuardRecorder, root_globals: dict[str, Any],
         sizes: Sequence[SizeGuard] = ()) -> Artifact:
    """The artifact of a function this process just traced and compiled (:func:`trace`), used as it
    is: what :func:`from_bytes` would make of its :func:`to_bytes`, without loading it back (the
    guards Dynamo built while tracing, the compiled graph in memory). Only for a
    :func:`runnable` one."""
    if not runnable(compiled):
        raise ValueError("the compiled graph is not loaded")
    namespace = _Globals(root_globals, compiled.fn.__globals__)
    return Artifact(compiled, list(recorder.dropped), _source_hashes(compiled), namespace,
                    self_name=recorder.self_name, size_guards=list(sizes))


def files(directory: Path) -> list[Path]:
    """The artifacts saved under ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.glob("*.bin")), key=lambda p: int(p.stem) if p.stem.isdigit() else 0)


def broken_calls(directory: Path) -> dict[str, str]:
    """The call signatures :data:`UNSUPPORTED_CALLS` lists under ``directory`` (unreadable: none)."""
    try:
        data = json.loads((directory / UNSUPPORTED_CALLS).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def add_broken_call(directory: Path, sig: str, reason: str) -> None:
    """Record that calls of signature ``sig`` cannot be traced as one graph (atomic rewrite)."""
    calls = broken_calls(directory)
    calls[sig] = reason
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / UNSUPPORTED_CALLS, json.dumps(calls, indent=1, sort_keys=True).encode())
