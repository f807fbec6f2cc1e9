"""Load a run config: YAML file(s) joined by `extends:`, then `section.key=value` overrides, then validation.

Everything funnels into one `Config.model_validate`, so a key from a file, a preset or the command line
is checked the same way, and every error is one line naming the key at fault.
"""

from __future__ import annotations

import difflib
import json
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from phalanx.config.schema import Config
from phalanx.errors import PhalanxError

PRESETS_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "demo"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The validated config from a YAML file (or the demo preset when None) plus overrides."""
    source = _locate(str(path) if path else DEFAULT_PRESET, Path.cwd())
    raw = _read_with_extends(source, seen=())
    if isinstance(raw.get("run", {}), dict):
        # A run is named after its config file unless the file chain names it: my.yaml -> runs/my.
        raw.setdefault("run", {}).setdefault("name", source.stem)
    for item in overrides:
        _apply_override(raw, item)
    return validate(raw)


def validate(raw: dict[str, Any]) -> Config:
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        raise PhalanxError(_describe(exc.errors()[0])) from None
    return _absolute_paths(config)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def dump_json(config: Config) -> str:
    return json.dumps(config.model_dump(mode="json"), indent=2)


def _locate(name: str, base: Path) -> Path:
    """A preset name (`demo`) or a YAML path, relative paths taken from `base`."""
    if name in preset_names():
        return PRESETS_DIR / f"{name}.yaml"
    path = (base / name).expanduser()
    if path.is_file():
        return path.resolve()
    if path.suffix not in (".yaml", ".yml"):
        raise PhalanxError(f"config '{name}' is neither a file nor a preset (presets: {', '.join(preset_names())})")
    raise PhalanxError(f"config file not found: {path}")


def _read_with_extends(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if path in seen:
        raise PhalanxError(f"config 'extends' loops back to {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise PhalanxError(f"config {path}{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except OSError as exc:
        raise PhalanxError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise PhalanxError(f"config {path} is not UTF-8 text") from None
    if not isinstance(raw, dict):
        raise PhalanxError(f"config {path} must be a mapping of sections, not {type(raw).__name__}")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise PhalanxError(f"config {path}: 'extends' must be a preset name or a file path")
    return _merge(_read_with_extends(_locate(parent, path.parent), seen + (path,)), raw)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise PhalanxError(f"override '{item}' is not of the form section.key=value")
    if key == "extends":
        raise PhalanxError("'extends' belongs in a config file; name the file or preset as the CONFIG argument")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text  # not YAML: take it as a plain string and let validation judge it
    *sections, leaf = key.split(".")
    node = raw
    for i, part in enumerate(sections):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise PhalanxError(f"override '{item}': '{'.'.join(sections[: i + 1])}' is not a section")
        node = child
    node[leaf] = value


def _describe(error: dict[str, Any]) -> str:
    """One line for a pydantic error: the dotted key, what was given, what was expected."""
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f" (did you mean '{'.'.join(loc[:-1] + close)}'?)" if close else f" (valid: {', '.join(valid)})"
        return f"unknown config key '{key}'{hint}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error":  # our own cross-field checks already name their keys
        return f"invalid config: {message}"
    given = error.get("input")
    hint = " (YAML reads a bare yes, no, on or off as true or false; quote it)" if isinstance(given, bool) else ""
    return f"config key '{key}' = {given!r}: {message}{hint}"


def _valid_keys(section_path: list[str]) -> list[str]:
    model: Any = Config
    for part in section_path:
        if part.isdigit():  # an item of a list section, such as safe.inject.0
            continue
        model = model.model_fields[part].annotation
        if typing.get_origin(model) is list:
            model = typing.get_args(model)[0]
    keys = [field.alias or name for name, field in model.model_fields.items()]  # as written: checkpoint.async
    return keys + ["extends"] if model is Config else keys


def _absolute_paths(config: Config) -> Config:
    """Pin relative paths to the current directory so the saved config works from anywhere."""
    config.run.dir = config.run.dir.expanduser().resolve()
    config.data.sources = [_absolute_source(s) for s in config.data.sources]
    if config.data.tokenizer:
        config.data.tokenizer = str(Path(config.data.tokenizer).expanduser().resolve())
    if config.checkpoint.resume not in ("auto", "never"):
        config.checkpoint.resume = str(Path(config.checkpoint.resume).expanduser().resolve())
    return config


def _absolute_source(source: str) -> str:
    if source.startswith(("builtin:", "hf:")):  # hf: a Hugging Face hub dataset (data/readers/huggingface.py)
        return source
    return str(Path(source).expanduser().absolute())  # absolute(), not resolve(): globs stay globs
