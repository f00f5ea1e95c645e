"""The layering of docs/ARCHITECTURE.md, read from the source (every import, also those
inside functions): core imports nothing of the rest; no role imports another role; the
transport knows no role and its modules import one way; roles never parse CBOR."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sdcp_fast"
ROLES = ("verifier", "drafter", "router")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Absolute names of every sdcp_fast module `name` imports, wherever the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sdcp_fast")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("sdcp_fast"):
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names}
    known = modules()
    return {m for m in found if m in known}


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = {name: imports_of(name, path) for name, path in modules().items()}


def test_core_imports_nothing_of_the_rest():
    for name, deps in GRAPH.items():
        if top(name) == "core":
            assert {top(d) for d in deps} <= {"core"}, (name, deps)


@pytest.mark.parametrize("role", ROLES)
def test_no_role_imports_another_role(role):
    for name, deps in GRAPH.items():
        if top(name) == role:
            others = {d for d in deps if top(d) in ROLES and top(d) != role}
            assert not others, f"{name} imports {others}"


def test_shared_pieces_and_transport_import_no_role():
    for name, deps in GRAPH.items():
        if top(name) in ("core", "transport", "cache", "models", "kernels", "aio", "cores", "refs", "commits", "reports",
                        "config", "metrics", "logs"):
            assert not {d for d in deps if top(d) in ROLES}, (name, deps)


def test_transport_imports_run_one_way():
    transport = {n: {d for d in deps if top(d) == "transport" and d != "sdcp_fast.transport"}
                 for n, deps in GRAPH.items() if top(n) == "transport" and n != "sdcp_fast.transport"}
    visiting, done = set(), set()

    def visit(n, path):
        assert n not in visiting, f"import cycle: {' -> '.join([*path, n])}"
        if n in done:
            return
        visiting.add(n)
        for d in transport.get(n, ()):
            visit(d, [*path, n])
        visiting.discard(n)
        done.add(n)

    for n in transport:
        visit(n, [])
    for n, path in modules().items():
        if top(n) == "transport":
            assert "TYPE_CHECKING" not in path.read_text(), f"{n} needs TYPE_CHECKING to import"


CBOR_ATTRIBUTES = {"to_cbor", "from_cbor", "cbor"}


def cbor_uses(path: Path) -> list[str]:
    """Every place the code of `path` encodes or decodes CBOR itself: a message's
    `to_cbor`/`from_cbor`, a contract's `.cbor`, the `cbor` module or cbor2 (docstrings and
    comments do not count). No allow-list: commit records go through `commits.py`, a
    contract in text through `refs.contract_text`, a verdict's name through
    `core.digest.message_fingerprint`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in CBOR_ATTRIBUTES:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in ("cbor", "cbor2"):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "cbor2" for a in node.names):
            found.append((node.lineno, "import cbor2"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cbor2":
            found.append((node.lineno, "from cbor2"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_the_cbor_check_sees_encoding_and_decoding(tmp_path):
    path = tmp_path / "role.py"
    path.write_text('"""to_cbor() in a docstring is fine."""\n'
                    "data = record.to_cbor()\nr = CommitRecord.from_cbor(data)\nh = contract.cbor.hex()\n"
                    "cbor.loads(data)\nimport cbor2\n")
    assert cbor_uses(path) == ["line 2: .to_cbor", "line 3: .from_cbor", "line 4: .cbor", "line 5: cbor",
                               "line 6: import cbor2"]


def test_roles_never_parse_cbor_or_touch_sockets():
    for name, path in modules().items():
        if top(name) in ROLES:
            source = path.read_text()
            assert "sdcp_fast.core.cbor" not in GRAPH[name], name
            assert not cbor_uses(path), f"{name} handles CBOR itself: {cbor_uses(path)}"
            for word in ("import socket", "import h11", "import h2", "start_server", "asyncio.open_connection"):
                assert word not in source, f"{name}: {word}"
