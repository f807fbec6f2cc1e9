"""Where the suite's time goes, and a guard on its length.

At the end of every run pytest prints the slowest tests (setup, call and teardown added up, so a module
fixture's training shows on the test that paid for it) and the total per folder. `--time-limit=SECONDS`
fails the run with one line when the tests took longer than that: CI sets it so that the suite cannot
drift silently toward CI's hard limit. `--timings-json=PATH` writes every test's time, for TESTING.md.

The files run longest first. With two workers sharing the suite a file at a time, a long file dealt out
last runs alone at the end (xdist's own order, by test count, dealt the one-test demo file among the
last: about 200 s of one idle worker). file_seconds.json holds each file's seconds from a whole run
(`python tests/timing.py --file-seconds TIMINGS.json` writes it); a file it does not know is counted at
FALLBACK_SECONDS a test. scripts/test.sh turns xdist's reordering off so that this order holds.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("phalanx timing")
    group.addoption(
        "--slowest", type=int, default=20, metavar="N", help="list the N slowest tests at the end (0: none)"
    )
    group.addoption(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail the run when its tests took longer than this",
    )
    group.addoption(
        "--timings-json",
        default=None,
        metavar="PATH",
        help="write each test's seconds (setup + call + teardown) to PATH as JSON",
    )


def folder_of(nodeid: str) -> str:
    """tests/serve/test_x.py::test_y -> tests/serve; the top-level files are tests/*.py."""
    path = nodeid.split("::")[0].split("/")
    return "/".join(path[:2]) if len(path) > 2 else "/".join(path[:-1] + ["*.py"])


class Timings:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    def folders(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.seconds.items():
            totals[folder_of(nodeid)] += seconds
        return totals

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.wall = time.monotonic() - self.started
        path = self.config.getoption("--timings-json")
        if path:
            Path(path).write_text(
                json.dumps(
                    {
                        "wall_s": round(self.wall, 1),
                        "tests": {k: round(v, 2) for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])},
                    },
                    indent=1,
                )
            )
        limit = self.config.getoption("--time-limit")
        if limit is not None and self.wall > limit and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            self.over_limit = f"the tests took {self.wall:.0f} s, over the {limit:.0f} s limit"

    def pytest_terminal_summary(self, terminalreporter) -> None:
        write = terminalreporter.write_line
        n = self.config.getoption("--slowest")
        if n and self.seconds:
            terminalreporter.section(f"the {n} slowest tests (setup + call + teardown)")
            for nodeid, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:n]:
                write(f"{seconds:8.1f} s  {nodeid}")
            terminalreporter.section("seconds per folder")
            for folder, seconds in sorted(self.folders().items(), key=lambda kv: -kv[1]):
                write(f"{seconds:8.1f} s  {folder}")
            write(
                f"{sum(self.seconds.values()):8.1f} s  all tests ({len(self.seconds)}); {self.wall:.1f} s of wall time"
            )
        if getattr(self, "over_limit", None):
            write(
                f"FAILED: {self.over_limit}: make the costliest tests cheaper (see above) "
                "or move them to the slow tier",
                red=True,
                bold=True,
            )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Timings(config), "phalanx-timings")


FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
FALLBACK_SECONDS = 2.0  # a test of a file file_seconds.json does not know yet


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (see the module docstring); a file's tests keep their order."""
    known = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    counts: dict[str, int] = defaultdict(int)
    for item in items:
        counts[file_of(item.nodeid)] += 1
    seconds = {f: known.get(f, n * FALLBACK_SECONDS) for f, n in counts.items()}
    first_seen = {f: i for i, f in reversed(list(enumerate(file_of(item.nodeid) for item in items)))}
    items.sort(key=lambda item: (-seconds[file_of(item.nodeid)], first_seen[file_of(item.nodeid)]))


def file_seconds(timings: dict) -> dict[str, float]:
    """Each file's seconds in a --timings-json file, longest first."""
    totals: dict[str, float] = defaultdict(float)
    for nodeid, seconds in timings["tests"].items():
        totals[file_of(nodeid)] += seconds
    return {f: round(s, 1) for f, s in sorted(totals.items(), key=lambda kv: -kv[1])}


def markdown(timings: dict, slowest: int = 30) -> str:
    """TESTING.md's tables from a --timings-json file: the slowest tests and the seconds per folder."""
    tests: dict[str, float] = timings["tests"]
    folders: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for nodeid, seconds in tests.items():
        folders[folder_of(nodeid)] += seconds
        counts[folder_of(nodeid)] += 1
    lines = [f"| seconds | the {slowest} slowest tests |", "|---:|---|"]
    lines += [f"| {s:.1f} | `{n}` |" for n, s in sorted(tests.items(), key=lambda kv: -kv[1])[:slowest]]
    lines += ["", "| seconds | tests | folder |", "|---:|---:|---|"]
    lines += [f"| {s:.0f} | {counts[f]} | `{f}` |" for f, s in sorted(folders.items(), key=lambda kv: -kv[1])]
    lines += [f"| {sum(tests.values()):.0f} | {len(tests)} | all ({timings['wall_s']:.0f} s of wall time) |"]
    return "\n".join(lines)


if __name__ == "__main__":
    # python tests/timing.py TIMINGS.json: the tables for TESTING.md;
    # python tests/timing.py --file-seconds TIMINGS.json: the files' seconds, into file_seconds.json.
    import sys

    if sys.argv[1] == "--file-seconds":
        FILE_SECONDS.write_text(json.dumps(file_seconds(json.loads(Path(sys.argv[2]).read_text())), indent=1) + "\n")
    else:
        print(markdown(json.loads(Path(sys.argv[1]).read_text())))
