"""Every file and folder name in a run directory (and the runs root around it), in one place.

RUNS_ROOT/                   `run.dir` in the config
  .cache/data/               prepared token shards, content-addressed and shared by runs
  RUN_NAME/                  one run (`run.name`)
    config.yaml              the resolved config: repeat, resume, export or serve from it
    tokenizer.json           the run's tokenizer
    tokenizer_config.json    a run from a checkpoint (or a tokenizer.json with them beside it): the
    special_tokens_map.json    checkpoint's files that name its special tokens, stop ids and chat
    generation_config.json     template, kept under their own names beside tokenizer.json, where the
    chat_template.jinja        tokenizer loader (data/tokenizer.py) reads them; absent otherwise
    data.json                which prepared shards the run trains on
    metrics.jsonl            one JSON object per step (rank 0)
    events.jsonl             faults, detections, restarts, rollbacks, checkpoints, stragglers
    telemetry.jsonl          host and accelerator samples from each node agent
    ranks/rank_N.jsonl       each rank's own step timings
    summary.json             the last summary of `phalanx train`
    stacks/                  Python stacks of ranks caught hanging (attemptA-rankR.txt)
    tensorboard/             TensorBoard event files (observe.tensorboard)
    metrics_port[.HOST]      the port a node agent's /metrics listens on
    .lock                    held by the launch that owns the run
    .share-probe-TOKEN       a cluster launcher's check that every node sees this directory (removed)
    checkpoints/step_N/      one checkpoint per save (see phalanx/run/checkpoints.py)
    eval/step_N-TIME.json    a `phalanx eval` of checkpoint step_N (lm-eval tasks or bits per byte)
    checkpoints.before-NS/   an earlier line of checkpoints, moved aside by checkpoint.resume=never|PATH

A checkpoint directory holds DCP files, rng_rank{R}.pt, trainer.json and manifest.json (written last).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
TOKENIZER = "tokenizer.json"
# A tokenizer's companion files: the names data/tokenizer.py's TOKENIZER_COMPANIONS reads beside a
# tokenizer.json (spelt here too so that this module stays a leaf; a test holds the two equal).
TOKENIZER_COMPANIONS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
PRETRAINED = "pretrained.json"  # the Hugging Face checkpoint a run started from, and its hash
BASE = "base"  # another run (or a GGUF export) it started from, converted to a Hugging Face checkpoint
DATA_POINTER = "data.json"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
TELEMETRY = "telemetry.jsonl"
RANKS = "ranks"
SUMMARY = "summary.json"
STACKS = "stacks"
TENSORBOARD = "tensorboard"
METRICS_PORT = "metrics_port"
LOCK = ".lock"
SHARE_PROBE = ".share-probe"
CHECKPOINTS = "checkpoints"
EVAL = "eval"

# Inside one checkpoint directory.
TRAINER_STATE = "trainer.json"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_timings_name(rank: int) -> str:
    """Relative to the run directory (the run store keys its read offsets by these names)."""
    return f"{RANKS}/rank_{rank}.jsonl"


def data_cache_dir(runs_root: Path) -> Path:
    return Path(runs_root) / ".cache" / "data"


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory. `RunDir(config.run_dir).metrics` rather than a literal name."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def tokenizer(self) -> Path:
        return self.path / TOKENIZER

    def tokenizer_companions(self) -> list[Path]:
        """Where the run keeps its tokenizer's companion files (each may be absent)."""
        return [self.path / name for name in TOKENIZER_COMPANIONS]

    @property
    def pretrained(self) -> Path:
        return self.path / PRETRAINED

    @property
    def base(self) -> Path:
        return self.path / BASE

    @property
    def data_pointer(self) -> Path:
        return self.path / DATA_POINTER

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def events(self) -> Path:
        return self.path / EVENTS

    @property
    def telemetry(self) -> Path:
        return self.path / TELEMETRY

    @property
    def ranks(self) -> Path:
        return self.path / RANKS

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def stacks(self) -> Path:
        return self.path / STACKS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def rank_timings(self, rank: int) -> Path:
        return self.path / rank_timings_name(rank)

    def rank_timing_names(self) -> list[str]:
        """The rank timing files there are, as names relative to the run directory."""
        return sorted(p.relative_to(self.path).as_posix() for p in self.ranks.glob("rank_*.jsonl"))

    def stack_file(self, attempt: int, rank: int) -> Path:
        return self.stacks / f"attempt{attempt}-rank{rank}.txt"

    def metrics_port_file(self, host: str | None = None) -> Path:
        """Node 0's agent writes `metrics_port`; the others `metrics_port.HOST` (nodes may share the dir)."""
        return self.path / (METRICS_PORT if host is None else f"{METRICS_PORT}.{host}")

    def share_probe(self, token: str) -> Path:
        """Written by node 0 of a cluster launch and read by every other node: a shared filesystem check."""
        return self.path / f"{SHARE_PROBE}-{token}"

    def eval_result(self, step: int, stamp: str) -> Path:
        """Where `phalanx eval` keeps what it measured on checkpoint `step` at time `stamp`."""
        return self.path / EVAL / f"{step_dir_name(step)}-{stamp}.json"

    def checkpoints_aside(self, stamp: int) -> Path:
        return self.path / f"{CHECKPOINTS}.before-{stamp}"


def is_checkpoint_dir(path: Path) -> bool:
    return (Path(path) / TRAINER_STATE).is_file()


def run_of_checkpoint(checkpoint: Path) -> RunDir | None:
    """The run a checkpoint belongs to (RUN_DIR/checkpoints[.before-NS]/step_N), or None if it lives
    elsewhere (copied out on its own)."""
    checkpoint = Path(checkpoint).absolute()
    parent = checkpoint.parent
    if parent.name == CHECKPOINTS or parent.name.startswith(f"{CHECKPOINTS}.before-"):
        return RunDir(parent.parent)
    return None
