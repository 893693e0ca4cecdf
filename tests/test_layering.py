"""Dependencies point down: the import rules between omniwalk's packages, read from the source.

    graph/, runtime/   know no model, layer, engine or server code
    kernels/           Triton kernels and their torch references: no engine, layers, models, server
    engine/            executors, caches, sampler: may use kernels/, never layers/, models/, server/
    layers/            nn.Modules: may use engine/ (attention backends) and kernels/

Every import counts, at module level or inside a function, absolute or relative.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "omniwalk"

FORBIDDEN = {
    "kernels": ("omniwalk.engine", "omniwalk.layers", "omniwalk.models", "omniwalk.server"),
    "engine": ("omniwalk.layers", "omniwalk.models", "omniwalk.server"),
    "graph": ("omniwalk.engine", "omniwalk.layers", "omniwalk.models", "omniwalk.server"),
    "runtime": ("omniwalk.engine", "omniwalk.layers", "omniwalk.models", "omniwalk.server"),
}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module name) of every import in `source` (the code of `module`, dotted). For
    `from a.b import c`: a.b, and a.b.c as well (c may be a submodule)."""
    package = module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from the module's package, one level up per extra dot
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(source: str, module: str, forbidden: tuple[str, ...]) -> list[str]:
    """'line: module' of each import of a forbidden package (or of a module inside one)."""
    def is_forbidden(name: str) -> bool:
        return any(name == f or name.startswith(f + ".") for f in forbidden)

    bad = {(line, name) for line, name in imported_modules(source, module) if is_forbidden(name)}
    # `from a.b import c` with a.b forbidden: report a.b once, not each name taken from it
    return [f"{line}: {name}" for line, name in sorted(bad)
            if not (line, name.rsplit(".", 1)[0]) in bad]


def modules_of(subpackage: str) -> list[tuple[str, Path]]:
    files = sorted((PACKAGE / subpackage).rglob("*.py"))
    return [(".".join(("omniwalk",) + path.relative_to(PACKAGE).with_suffix("").parts), path) for path in files]


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_imports_point_down(subpackage):
    modules = modules_of(subpackage)
    assert modules, f"no source files under omniwalk/{subpackage}"
    found = {module: bad for module, path in modules
             if (bad := violations(path.read_text(), module, FORBIDDEN[subpackage]))}
    assert not found, f"omniwalk/{subpackage} must not import {FORBIDDEN[subpackage]}: {found}"


@pytest.mark.parametrize("statement", [
    "import omniwalk.layers.norm",
    "from omniwalk.layers import norm",
    "from omniwalk.layers.norm import RMSNorm",
    "from omniwalk import layers",
    "from ..layers import norm",
    "from ..layers.norm import RMSNorm",
    "def f():\n    from omniwalk.layers.norm import RMSNorm",
])
def test_the_check_sees_every_form_of_import(statement):
    assert violations(statement, "omniwalk.engine.sampler", FORBIDDEN["engine"])


def test_the_check_lets_allowed_imports_through():
    source = "import torch\nfrom omniwalk.kernels.triton_support import use_triton\nfrom . import kv_cache\n"
    assert violations(source, "omniwalk.engine.sampler", FORBIDDEN["engine"]) == []
    assert violations("from omniwalk.engine import attention", "omniwalk.layers.transformer", ()) == []
