"""The README's examples, taken from the README itself, so that a drifting example fails here first.

Every ```yaml block that is a run config loads through the real loader (`extends:`, presets, `off`);
every `phalanx ...` line of a ```bash block parses against the real command line (option names, types,
ranges) and, where that costs nothing, is validated as the command would validate it before doing any
work: configs and overrides load, `train` launch options and batch sizes fit the rank counts, preflight
thresholds exist, `plan` runs. `my.yaml` in those lines is the README's own config block. Every
```python block compiles, and every file the README points at exists.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from phalanx.cli import app
from phalanx.config.loader import load_config
from phalanx.config.schema import Config
from phalanx.console import split_config_args

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Config files the examples name without shipping them: the README's own config block stands in.
PLACEHOLDER_CONFIGS = ("my.yaml", "configs/llama-8b.yaml")
# Programs other than phalanx that the shell examples run (a typo'd `phalnx` is not one of them).
OTHER_PROGRAMS = {
    "bash",
    "python",
    "python3",
    "pip",
    ".venv/bin/pip",
    ".venv/bin/python",
    ".venv/bin/ruff",
    "curl",
    "export",
    "cd",
    "llama-cli",
    "ollama",
    "printf",
    "tensorboard",
    "docker",
    "kubectl",
    "sbatch",
    "srun",
    "ray",
}


def fenced_blocks(language: str) -> list[tuple[int, str]]:
    """(line number, text) of each ```language block, fences indented inside lists included."""
    found, current, start, indent = [], None, 0, ""
    for number, line in enumerate(README.read_text().splitlines(), 1):
        fence = re.match(r"^(\s*)```(\w*)\s*$", line)
        if fence and current is None:
            current, start, indent = fence.group(2), number, fence.group(1)
            lines: list[str] = []
        elif fence:
            if current == language:
                found.append((start, "\n".join(lines)))
            current = None
        elif current is not None:
            lines.append(line[len(indent) :] if line.startswith(indent) else line)
    return found


def shell_commands() -> list[tuple[int, list[str]]]:
    """(line, words) of every simple command in the ```bash blocks: continuation lines and quotes that
    span lines joined, comments dropped, pipelines and && lists split, `NAME=value` prefixes dropped."""
    commands = []
    for start, block in fenced_blocks("bash"):
        pending, first = "", 0
        for offset, line in enumerate(block.splitlines()):
            if not pending:
                first = start + 1 + offset
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on on the next line
                pending += "\n"
                continue
            pending = ""
            command: list[str] = []
            for word in words + ["|"]:
                if word in ("|", "&&", ";"):
                    while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
                        command.pop(0)
                    if command:
                        commands.append((first, command))
                    if "--" in command and command.index("--") + 1 < len(command):  # `ray job submit -- CMD`
                        commands.append((first, command[command.index("--") + 1 :]))
                    command = []
                else:
                    command.append(word)
    return commands


def phalanx_commands() -> list[tuple[int, list[str]]]:
    return [(line, words[1:]) for line, words in shell_commands() if Path(words[0]).name == "phalanx"]


def readme_config() -> str:
    """The README's full config block: the one with `extends:` and every section."""
    blocks = [text for _, text in fenced_blocks("yaml") if text.startswith("extends:")]
    assert len(blocks) == 1, "the README should have one full config block (starting with extends:)"
    return blocks[0]


@pytest.fixture(scope="module")
def my_yaml(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("readme") / "my.yaml"
    path.write_text(readme_config())
    return path


def parse(args: list[str]):
    """The real command line's parse of `phalanx ARGS`, without running it: (command, its context)."""
    root = typer.main.get_command(app)
    command, ctx = root, root.make_context("phalanx", [a for a in args if a != "--debug"])
    while hasattr(command, "resolve_command"):
        rest = list(getattr(ctx, "protected_args", None) or getattr(ctx, "_protected_args", [])) + list(ctx.args)
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return command, ctx


# -- the YAML blocks --------------------------------------------------------------------------------------
def config_blocks() -> list[tuple[int, str]]:
    sections = set(Config.model_fields) | {"extends"}
    return [
        (line, text)
        for line, text in fenced_blocks("yaml")
        if isinstance(yaml.safe_load(text), dict) and set(yaml.safe_load(text)) <= sections
    ]


def test_the_readme_has_the_examples_this_file_checks():
    """The extraction itself works: an empty list would make every test below pass by checking nothing."""
    assert len(config_blocks()) >= 4
    assert len(phalanx_commands()) >= 40
    assert len(fenced_blocks("python")) >= 4
    assert any(words[:2] == ["train", "my.yaml"] and "--nproc" in words for _, words in phalanx_commands())


@pytest.mark.parametrize("line, text", config_blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_yaml_config_blocks_load_through_the_real_loader(tmp_path, line, text):
    from phalanx.preflight.thresholds import config_overrides

    path = tmp_path / "block.yaml"
    path.write_text(text)
    config = load_config(path)  # raises with the README's own mistake, e.g. `preflight: off` as false
    config_overrides(config.safe.preflight_thresholds)  # the check names in a thresholds block exist


def test_other_yaml_blocks_are_known_not_to_be_configs():
    others = [
        data
        for line, text in fenced_blocks("yaml")
        if (line, text) not in config_blocks()
        for data in [yaml.safe_load(text)]
    ]
    assert others and all("scrape_configs" in data for data in others)  # Prometheus' own config


def test_the_full_config_block_names_every_key_and_its_defaults(my_yaml):
    """Every key of every section is in the block, and where the block leaves the demo preset alone its
    values are the real defaults (a default changed in the schema but not in the README fails)."""
    block = yaml.safe_load(readme_config())
    default = load_config(None).model_dump(mode="json", by_alias=True)  # keys as people write them
    text = readme_config()
    for section, model in Config.model_fields.items():
        keys = {f.alias or name for name, f in model.annotation.model_fields.items()}
        if section == "model":  # the block sets a few shape keys and names the others in a comment
            assert set(block[section]) <= keys and all(re.search(rf"\b{k}\b", text) for k in keys)
        else:
            assert set(block[section]) == keys, f"README config block, section {section}"
    as_loaded = load_config(my_yaml).model_dump(mode="json", by_alias=True)  # `off` read as the loader does
    for section in ("train", "parallel", "safe", "observe"):
        for key, value in as_loaded[section].items():
            assert value == default[section][key], (
                f"README says {section}.{key}: {value}, the default is {default[section][key]}"
            )


# -- the shell blocks -------------------------------------------------------------------------------------
def test_shell_examples_run_known_programs_and_existing_scripts():
    for line, words in shell_commands():
        program = words[0]
        assert Path(program).name == "phalanx" or program in OTHER_PROGRAMS, f"README line {line}: {words}"
        if program == "bash":
            assert (ROOT / words[1]).is_file(), f"README line {line}: {words[1]} does not exist"


def _examples() -> list:
    """phalanx_commands(), with the plans that trace a real step (seconds each) in the slow tier."""
    return [
        pytest.param(line, args, marks=pytest.mark.slow)
        if args[:1] == ["plan"] and "--no-trace" not in args
        else (line, args)
        for line, args in phalanx_commands()
    ]


@pytest.mark.parametrize("line, args", _examples(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_phalanx_examples_parse_and_validate(line, args, my_yaml, tmp_path, monkeypatch):
    from phalanx.job.train_job import check_job
    from phalanx.launch.local import LaunchSpec
    from phalanx.preflight.thresholds import parse_overrides

    args = [str(my_yaml) if a in PLACEHOLDER_CONFIGS else a for a in args]
    _, ctx = parse(args)  # an unknown option, a bad value or a missing argument raises here
    p = ctx.params
    path = ctx.command_path
    if path in ("phalanx train", "phalanx config show", "phalanx data prepare", "phalanx preflight"):
        config = load_config(*split_config_args(p["args"]))
        if path == "phalanx train":
            # A cluster launcher (--launcher ray) finds the rendezvous itself; the rest is checked the same.
            endpoint = p["rdzv_endpoint"] or ("head:29500" if p.get("launcher", "local") != "local" else None)
            check_job(config, LaunchSpec(p["nproc"], p["nnodes"], p["node_rank"], endpoint, p["rdzv_conf"]))
        if path == "phalanx preflight":
            parse_overrides(p["threshold"] or [])
    elif path == "phalanx plan":
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, f"README line {line}: phalanx {' '.join(args)}\n{result.output}"


def test_a_drifted_example_would_fail():
    """The checks above catch what they are for: a misspelt option and batch sizes that do not divide."""
    from phalanx.errors import PhalanxError
    from phalanx.job.train_job import check_job
    from phalanx.launch.local import LaunchSpec

    with pytest.raises(Exception, match="--nprc"):
        parse(["train", "--nprc", "2"])
    with pytest.raises(Exception, match="greater than or equal to 1"):
        parse(["train", "--nproc", "0"])

    with pytest.raises(PhalanxError, match="multiple of"):
        check_job(load_config(None, ["train.micro_batch_size=16"]), LaunchSpec(nproc=2))


# -- the Python blocks and the references -----------------------------------------------------------------
@pytest.mark.parametrize("line, text", fenced_blocks("python"), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_python_blocks_compile(line, text):
    compile(text, f"README.md line {line}", "exec")


def test_every_file_the_readme_points_at_exists():
    text = README.read_text()
    assert not re.search(r"(?<!\.)\.\./", text), "the README points outside the repository"
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # [links](path)
        if not target.startswith(("http://", "https://")) and not (ROOT / target).exists():
            missing.append(target)
    for target in re.findall(r"`((?:phalanx|tests|bench|scripts|grafana)/[\w./-]*\w)`", text):
        if "<" not in target and not (ROOT / target).exists() and not target.startswith("phalanx/run/runs"):
            missing.append(target)
    for target in set(re.findall(r"\b[\w-]+\.md\b", text)):
        if not (ROOT / target).exists():
            missing.append(target)
    assert not missing, f"the README names files that do not exist: {missing}"


def test_readme_anchors_lead_to_headings():
    text = README.read_text()
    headings = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)
    }
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in headings, f"README link to #{anchor} has no heading"
