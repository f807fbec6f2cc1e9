"""Which lm-evaluation-harness tasks to run: the harness's registry plus local task files, checked
before a model is loaded so that a typo or a broken file is one line rather than a traceback minutes in.

The harness skips a task file it cannot parse without a word (it logs at debug level), and a task asked
for by name then looks unknown; parsing the files under --include-path here names the file and the error.
"""

from __future__ import annotations

from difflib import get_close_matches
from pathlib import Path
from typing import Any

from phalanx.errors import PhalanxError


def split_task_names(tasks: str) -> list[str]:
    names = [name.strip() for name in tasks.split(",") if name.strip()]
    if not names:
        raise PhalanxError("--tasks names no task: give one or more, separated by commas (--tasks hellaswag,arc_easy)")
    return names


class TaskNotBuilt(PhalanxError):
    def __init__(self, message: str, needs_registry: bool):
        super().__init__(message)
        self.needs_registry = needs_registry  # it names a task the index it was built from does not hold


def load_tasks(names: list[str], include_path: Path | None) -> tuple[Any, list[Any]]:
    """The harness's TaskManager and the built tasks for `names`. The task files under include_path
    (checked to parse) are indexed alone first, since indexing the harness's own ~15,000 task files
    takes seconds (8 s on 2 cores); the harness's tasks join them when a name is not among those files,
    or a local task or group needs one of the harness's to build."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        check_task_files(include_path)
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(_known(name, local) for name in names):
            try:
                return local, build_tasks(names, local)
            except TaskNotBuilt as exc:
                if not exc.needs_registry:
                    raise
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    check_task_names(names, manager, include_path)
    return manager, build_tasks(names, manager)


def check_task_files(include_path: Path) -> None:
    from lm_eval.tasks._yaml_loader import load_yaml  # the harness's own reader: !function tags, include:

    if not include_path.is_dir():
        raise PhalanxError(f"--include-path {include_path} is not a directory of task files (*.yaml)")
    for path in sorted(include_path.glob("**/*.yaml")):
        try:
            load_yaml(path, resolve_func=False)
        except Exception as exc:  # yaml's own errors, a missing include, a file that is not a mapping
            reason = " ".join(str(exc).split())  # yaml's messages span lines
            raise PhalanxError(f"task file {path} does not parse: {reason}") from None


def check_task_names(names: list[str], manager: Any, include_path: Path | None) -> None:
    known = set(manager.all_tasks)
    for name in names:
        if not _known(name, manager):
            close = get_close_matches(name, known, n=3)
            where = "lm-eval's tasks" + (f" or {include_path}" if include_path is not None else "")
            hint = f"; did you mean {', '.join(close)}?" if close else "; `python -m lm_eval ls tasks` lists them"
            raise PhalanxError(f"unknown task {name!r}: not among {where}{hint}")


def build_tasks(names: list[str], manager: Any) -> list[Any]:
    """The harness's Task and Group objects for `names`, built here (their data sets loaded) so that a
    task that cannot be built (its data missing, not downloadable offline, a template that fails) is one
    line before the model loads. simple_evaluate takes these objects as it takes names."""
    built: list[Any] = []
    for name in names:
        try:
            loaded = manager.load([name])
        except Exception as exc:  # datasets', jinja's, the harness's own: any of them means this task
            reason = " ".join(str(exc).split()) or exc.__class__.__name__
            # KeyError: the harness found no task by a name the task (a group) names.
            raise TaskNotBuilt(f"task {name!r} could not be loaded: {reason}", isinstance(exc, KeyError)) from None
        # A group stays a group (its aggregate score is reported); a tag is the tasks it names.
        built += [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())
    return built


def _known(name: str, manager: Any) -> bool:
    return name in manager.all_tasks or bool(manager.match_tasks([name]))  # match_tasks: the harness's patterns
