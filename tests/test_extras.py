"""`pip install phalanx` trains; serving, the run store and exports say which extra they need.

A second venv with only the core would take minutes of pip per run, so the commands run instead in
processes where every package an extra brings cannot be imported: a sitecustomize on PYTHONPATH sets
them to None in sys.modules (as for a package that is not installed, an import raises
ModuleNotFoundError and find_spec finds nothing), in the command and in every process it starts (the
ranks, the store's writer). Which packages those are is computed from pyproject.toml and the installed
packages' own requirements: everything `all` pulls in that the core does not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from phalanx.extras import EXTRA_MODULES, NOT_IN_ALL
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def extra_requirements(extra: str) -> list[Requirement]:
    """The requirements of one extra, with phalanx[other,...] inside it expanded."""
    found = []
    for line in PROJECT["optional-dependencies"][extra]:
        req = Requirement(line)
        if canonicalize_name(req.name) == "phalanx":
            found += [r for other in sorted(req.extras) for r in extra_requirements(other)]
        else:
            found.append(req)
    return found


def installed_closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions these requirements pull in, their own requirements included."""
    seen: set[str] = set()
    todo = [(req, "") for req in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement nobody installed
        if name in seen:
            continue
        seen.add(name)
        todo += [(Requirement(line), e) for line in dist.requires or [] for e in ("", *req.extras)]
    return seen


@cache
def hidden_modules() -> tuple[str, ...]:
    """The top-level modules of every distribution `all` brings that the core does not."""
    core = installed_closure([Requirement(line) for line in PROJECT["dependencies"]])
    only_extras = installed_closure(extra_requirements("all")) - core
    return tuple(
        sorted(
            module
            for module, dists in metadata.packages_distributions().items()
            if module.isidentifier() and all(canonicalize_name(d) in only_extras for d in dists)
        )
    )


@pytest.fixture(scope="module")
def core_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a core-only install: the extras' packages hidden in every Python it starts."""
    site = tmp_path_factory.mktemp("core_only")
    (site / "sitecustomize.py").write_text(
        "# Written by tests/test_extras.py: what an install without phalanx's extras lacks.\n"
        "import sys\n\n"
        f"for name in {hidden_modules()!r}:\n"
        "    sys.modules[name] = None\n"
    )
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def core_phalanx(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_core_lacks_what_the_extras_bring(core_env):
    """The hiding itself works (else every test below would pass on a full install)."""
    assert {
        "fastapi",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "plotly",
        "llguidance",
        "gguf",
        "safetensors",
        "prometheus_client",
        "tensorboard",
        "psycopg",
        "starlette",
    } <= set(hidden_modules())
    probe = subprocess.run([sys.executable, "-c", "import sqlalchemy"], capture_output=True, text=True, env=core_env)
    assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr


@pytest.fixture(scope="module")
def core_run(core_env, corpus, tmp_path_factory):
    """A short training run of the tiny model on the core alone, with the default run store."""
    runs = tmp_path_factory.mktemp("core_runs")
    proc = core_phalanx(
        core_env,
        "train",
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={runs}",
        "run.name=core",
        "train.max_steps=2",
        "train.eval_batches=1",
        "--json",
    )
    return proc, runs


def test_training_needs_only_the_core(core_run):
    proc, runs = core_run
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and Path(summary["last_checkpoint"]).is_dir()
    # The default store is skipped with one note naming the extra, and never created.
    notes = [line for line in proc.stderr.splitlines() if "pip install 'phalanx[observe]'" in line]
    assert len(notes) == 1 and notes[0].startswith("note: the run store is skipped"), proc.stderr
    assert not (runs / "phalanx.db").exists()


@pytest.mark.parametrize(
    "command, extra",
    [
        (["serve", "RUN"], "serve"),
        (["chat", "RUN"], "serve"),
        (["generate", "RUN", "ROMEO:"], "serve"),
        (["export", "RUN", "--format", "hf", "--out", "OUT"], "export"),
        (["dashboard", "--runs", "RUNS", "--port", "0"], "observe"),
        (["runs", "list", "--runs", "RUNS"], "observe"),
        (["runs", "import", "RUN", "--runs", "RUNS"], "observe"),
    ],
)
def test_a_command_names_the_extra_it_needs(core_env, core_run, tmp_path, command, extra):
    _, runs = core_run
    given = {"RUN": str(runs / "core"), "RUNS": str(runs), "OUT": str(tmp_path / "out")}
    proc = core_phalanx(core_env, *(given.get(a, a) for a in command))
    assert proc.returncode == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"pip install 'phalanx[{extra}]'" in lines[0], lines
    assert not (tmp_path / "out").exists() and not (runs / "phalanx.db").exists()


@pytest.mark.parametrize(
    "setting, extra",
    [
        ("observe.store=STORE", "observe"),  # asked for by name: refused, not skipped
        ("observe.metrics_port=0", "observe"),
        ("observe.tensorboard=true", "tensorboard"),
    ],
)
def test_a_setting_the_core_cannot_honour_is_refused_before_the_run(core_env, tmp_path, setting, extra):
    setting = setting.replace("STORE", str(tmp_path / "store.db"))
    proc = core_phalanx(core_env, "train", *TINY, f"run.dir={tmp_path}", "run.name=refused", setting)
    assert proc.returncode == 2 and f"pip install 'phalanx[{extra}]'" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, no store


def test_the_extras_tables_agree():
    """pyproject.toml's extras install every module phalanx/extras.py checks for, `all` is every extra
    that has a check but those it leaves out by name, and the tests get all of it."""
    extras = PROJECT["optional-dependencies"]
    providers = metadata.packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        listed = {canonicalize_name(r.name) for r in extra_requirements(extra)}
        for module in modules:
            assert {canonicalize_name(d) for d in providers[module]} & listed, f"[{extra}] does not install {module}"
    in_all = set().union(*(Requirement(line).extras for line in extras["all"]))
    assert in_all == set(EXTRA_MODULES) - NOT_IN_ALL
    in_test = set().union(
        *(Requirement(line).extras for line in extras["test"] if canonicalize_name(Requirement(line).name) == "phalanx")
    )
    assert {"all", "eval"} <= in_test  # eval: lm-evaluation-harness, which tests/serve/test_serve_lm_eval.py runs
    # Nothing an extra installs is a core dependency too (it would then be in the core, not an extra).
    core = {canonicalize_name(Requirement(line).name) for line in PROJECT["dependencies"]}
    assert not core & {canonicalize_name(r.name) for r in extra_requirements("all")}


def test_the_readme_lists_every_extra():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| extra | adds | for |") :]
    rows = table[: table.index("\n\n")].splitlines()[2:]
    named = {name for row in rows for name in re.findall(r"`([\w-]+)`", row.split("|")[1])}
    assert named == set(PROJECT["optional-dependencies"]) - {"test", "test-all"}  # those two: the Tests section


@pytest.mark.parametrize("source", ["hf:org/name:train", "corpus.jsonl.zst"])
def test_a_data_source_the_core_cannot_read_names_the_data_extra(core_env, tmp_path, source):
    """Hub datasets need `datasets`, .jsonl.zst files `zstandard`: both from the data extra."""
    (tmp_path / "corpus.jsonl.zst").write_bytes(b"")  # refused for the missing package, before it is read
    proc = core_phalanx(
        core_env, "data", "prepare", f"data.sources=[{source.replace('corpus', str(tmp_path / 'corpus'))}]",
        f"run.dir={tmp_path / 'runs'}", "run.name=refused",
    )  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "pip install 'phalanx[data]'" in lines[0], lines
