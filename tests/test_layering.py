"""The design's never-rules, checked over the package's own import graph (every import statement,
including those inside functions), so that breaking one fails the suite rather than a later reader."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "phalanx"
ROOT_MODULES = {"errors", "console", "listen"}  # shared leaves beside the stage folders


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every phalanx module `path` imports, absolute or relative, at any depth of the file."""
    found = set()
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from phalanx import cli` imports the module
    return {name for name in found if name == "phalanx" or name.startswith("phalanx.")}


def graph() -> dict[str, set[str]]:
    """module -> the phalanx modules it imports (`from phalanx.x import name` counts as phalanx.x)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts}

    def as_module(name: str) -> str | None:
        return name if name in modules else (name.rsplit(".", 1)[0] if name.rsplit(".", 1)[0] in modules else None)

    return {name: {m for m in map(as_module, imports_of(path)) if m} for name, path in modules.items()}


def folder(module: str) -> str:
    """The stage folder (or root module) a module belongs to: phalanx.serve.engines.torch_engine -> serve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "phalanx"


IMPORTS = graph()


def imported_folders(stage: str) -> dict[str, list[str]]:
    """For a stage folder: each other folder it imports, with the modules that do it."""
    seen: dict[str, list[str]] = defaultdict(list)
    for module, targets in IMPORTS.items():
        if folder(module) == stage:
            for target in targets:
                if folder(target) != stage:
                    seen[folder(target)].append(f"{module} -> {target}")
    return seen


@pytest.mark.parametrize(
    "stage, forbidden",
    [
        (
            "models",
            {
                "train",
                "parallel",
                "data",
                "run",
                "safe",
                "launch",
                "job",
                "observe",
                "serve",
                "export",
                "plan",
                "preflight",
            },
        ),
        ("serve", {"train", "safe", "launch", "job", "observe", "export", "plan", "preflight"}),
        ("observe", {"train", "launch", "job", "serve", "export", "plan", "preflight"}),
        ("export", {"train", "safe", "launch", "job", "observe", "serve", "plan", "preflight"}),
        ("run", {"train", "safe", "launch", "job", "observe", "serve", "export", "plan", "preflight"}),
        ("safe", {"train", "launch", "job", "observe", "serve", "export", "plan", "preflight"}),
        ("launch", {"train", "job", "observe", "serve", "export", "plan", "preflight"}),
    ],
)
def test_stage_does_not_reach_up(stage, forbidden):
    broken = {f: where for f, where in imported_folders(stage).items() if f in forbidden}
    assert not broken, f"{stage} imports {sorted(broken)}: {broken}"


def serve_room(module: str) -> str | None:
    """The room of serve/ a module lives in (core, engines, http, cli), None at serve/'s top (the server,
    which puts an engine under the routes) or outside serve/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "serve" else None


@pytest.mark.parametrize(
    "room, forbidden",
    [
        ("core", {"engines", "http", "cli"}),  # the contract and what every engine shares stand alone
        ("engines", {"http", "cli"}),
        ("http", {"engines", "cli"}),  # the routes know the engine contract, never one engine
        ("cli", {"engines"}),  # /set validates as /api/chat does, through the Ollama schema in http/
    ],
)
def test_serve_rooms(room, forbidden):
    broken = sorted(
        f"{module} -> {target}"
        for module, targets in IMPORTS.items()
        if serve_room(module) == room
        for target in targets
        if serve_room(target) in forbidden
    )
    assert not broken, f"serve/{room} imports {sorted(forbidden)}: {broken}"


def test_config_is_a_leaf():
    allowed = {"errors", "console"}
    broken = {f: where for f, where in imported_folders("config").items() if f not in allowed}
    assert not broken, f"config imports other stages: {broken}"


def test_nothing_imports_the_command_line():
    importers = sorted(m for m, targets in IMPORTS.items() if "phalanx.cli" in targets and m != "phalanx.__main__")
    assert not importers, f"{importers} import phalanx.cli"


def test_no_circle_between_folders():
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in IMPORTS.items():
        for target in targets:
            if folder(module) != folder(target) and target != "phalanx":  # `import phalanx` is the version
                edges[folder(module)].add(folder(target))
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, f"import circles between folders: {circles}"


def test_the_rules_see_real_imports():
    """The graph is not empty by mistake: known edges are there (a parser that saw nothing would pass)."""
    assert "phalanx.models.decoder" in IMPORTS["phalanx.parallel.build"]
    assert "phalanx.parallel.build" in IMPORTS["phalanx.train.trainer"]
    assert "phalanx.run.model_loader" in IMPORTS["phalanx.serve.core.served"]
    assert "phalanx.serve.core.scheduler" in IMPORTS["phalanx.serve.engines.torch_engine"]
    assert "phalanx.serve.core.contract" in IMPORTS["phalanx.serve.http.common"]
    assert "phalanx.errors" in IMPORTS["phalanx.config.loader"]
    # an import inside a function counts too
    assert "phalanx.run.model_loader" in IMPORTS["phalanx.export.export"]
