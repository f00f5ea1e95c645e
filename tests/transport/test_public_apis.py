"""The transport uses its libraries (ngh2, h2, hpack, hyperframe, aioquic/qh3, pylsqpack, jh2) through
their public APIs only (issue 37): a walk over the syntax trees of sdcp_fast/transport/ fails on

  1. attribute access with a leading underscore on those libraries' objects or modules: any
     `x._name` where `_name` is a private name the libraries define (found by walking their
     own sources and classes), unless `x` is `self`/`cls` of one of our classes that derives
     from none of their classes (our own attributes may share a name with theirs); and any
     `_name` reached through one of their modules (`h2.connection._decode_headers`);
  2. assignment to `__class__` (a class swapped on a live object);
  3. assignment to another library's functions or methods: to an attribute of one of their
     modules or classes, or of any object where the attribute is a callable of theirs
     (monkeypatching), or to a logger's methods (a replaced logger).

compat.py is the one exception to rule 1: each shim there names the upstream issue it waits for.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import pkgutil
import re
from functools import cache
from pathlib import Path

import pytest

TRANSPORT = Path(__file__).resolve().parents[2] / "sdcp_fast" / "transport"
LIBRARIES = ("h2", "hpack", "hyperframe", "aioquic", "qh3", "pylsqpack", "jh2", "ngh2")
EXEMPT_FROM_PRIVATE = {"compat.py"}
_PRIVATE_IN_SOURCE = re.compile(r"(?:\.|\bdef\s+)(_[A-Za-z0-9]\w*)")
LOGGER_METHODS = frozenset(name for name in dir(logging.Logger) if not name.startswith("_"))


def _modules():
    for top in LIBRARIES:
        try:
            package = importlib.import_module(top)
        except ImportError:
            continue
        yield package
        for info in pkgutil.walk_packages(getattr(package, "__path__", []), prefix=f"{top}."):
            try:
                yield importlib.import_module(info.name)
            except Exception:   # an optional extra of theirs we do not have
                continue


@cache
def library_names() -> tuple[frozenset[str], frozenset[str]]:
    """(private names, public callable names) the libraries define: attributes of their
    modules and classes, and every `._name` or `def _name` in their sources (found by a
    pattern, not parsed: CPython 3.11's parser fails now and then on their large tables)."""
    private, callables = set(), set()
    for module in _modules():
        objects = [module, *(v for v in vars(module).values() if inspect.isclass(v))]
        for obj in objects:
            for name in dir(obj):
                if name.startswith("__"):
                    continue
                if name.startswith("_"):
                    private.add(name)
                elif inspect.isclass(obj) and callable(getattr(obj, name, None)):
                    callables.add(name)
        source = getattr(module, "__file__", None)
        if source and source.endswith(".py"):   # read as text: a superset is harmless here
            private.update(name for name in _PRIVATE_IN_SOURCE.findall(Path(source).read_text())
                           if not name.startswith("__"))
    return frozenset(private), frozenset(callables)


def _library_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to the libraries' modules, classes or functions by imports."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    aliases[(alias.asname or alias.name).split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    private, callables = library_names()
    aliases = _library_aliases(tree)
    exempt = path.name in EXEMPT_FROM_PRIVATE
    found = []

    def where(node: ast.AST) -> str:
        return f"{path.name}:{node.lineno}"

    # classes of ours that derive from a library's class: their `self._x` may be the library's
    derived: set[ast.ClassDef] = {c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                                  and any(_root(b) in aliases for b in c.bases)}
    owner: dict[ast.AST, ast.ClassDef] = {}   # a node's innermost class (nested ones come later)
    for cls in sorted((c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)), key=lambda c: c.lineno):
        for inner in ast.walk(cls):
            owner[inner] = cls

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            own = isinstance(base, ast.Name) and base.id in ("self", "cls") and owner.get(node) not in derived
            via_module = _root(base) in aliases
            is_super = isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
            if not exempt and ((node.attr in private and not own) or via_module or
                               (is_super and owner.get(node) in derived)):
                found.append(f"{where(node)}: private name {node.attr!r} of a library")
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            leaves = [leaf for target in targets
                      for leaf in (target.elts if isinstance(target, ast.Tuple | ast.List) else [target])]
            for leaf in leaves:
                if not isinstance(leaf, ast.Attribute):
                    continue
                on_self = isinstance(leaf.value, ast.Name) and leaf.value.id == "self"
                if leaf.attr == "__class__":
                    found.append(f"{where(leaf)}: assignment to __class__")
                elif _root(leaf.value) in aliases:
                    found.append(f"{where(leaf)}: assignment into a library: {ast.unparse(leaf)}")
                elif leaf.attr in callables and not on_self:
                    found.append(f"{where(leaf)}: assignment over a library method: {ast.unparse(leaf)}")
                elif leaf.attr in LOGGER_METHODS and not on_self:
                    found.append(f"{where(leaf)}: a logger's method replaced: {ast.unparse(leaf)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and _root(node.args[0]) in aliases:
            found.append(f"{where(node)}: setattr on a library")
    return found


def test_the_library_names_are_found():
    private, callables = library_names()
    # names the old transport used, one per library it reached into
    assert {"_receive_headers_frame", "_closed_streams", "_data", "_request_client_certificate",
            "_local_max_streams_bidi", "_quic", "_protocols", "_encode_headers"} <= private
    assert {"receive_data", "send_headers", "datagrams_to_send"} <= callables


@pytest.mark.parametrize("path", sorted(TRANSPORT.glob("*.py")), ids=lambda p: p.name)
def test_the_transport_uses_public_apis_only(path):
    assert violations(path) == []


def test_the_scan_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import h2.connection\n"
        "from aioquic.quic.connection import QuicConnection\n"
        "import logging\n"
        "class Mine(QuicConnection):\n"
        "    def go(self):\n"
        "        self._local_max_streams_bidi.value = 3\n"
        "        return super()._initialize(b'')\n"
        "class Own:\n"
        "    def go(self, conn):\n"
        "        self._quic = None\n"                             # our own attribute: fine
        "        conn._closed_streams.clear()\n"
        "        conn.tls.__class__ = Own\n"
        "        conn.receive_data = print\n"
        "        logging.getLogger('hpack').debug = print\n"
        "h2.connection.H2Connection.MAX_CLOSED_STREAMS = 4096\n"
        "x = h2.connection._decode_headers\n")
    lines = sorted(int(v.split(":")[1]) for v in violations(bad))
    assert lines == [6, 7, 11, 12, 13, 14, 15, 16]
