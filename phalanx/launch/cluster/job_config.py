"""The config a cluster job carries: loaded with its overrides, checked against the job's shape before
anything is written or submitted, and written out resolved so every node trains from the same file."""

from __future__ import annotations

import re
from pathlib import Path

from phalanx.config.loader import dump_yaml, load_config
from phalanx.config.schema import Config
from phalanx.data.loader import check_batch_sizes
from phalanx.errors import PhalanxError
from phalanx.launch.local import LaunchSpec


def load_job_config(path: str | None, overrides: list[str], nodes: int, ranks_per_node: int) -> Config:
    """The validated config, refused with one line when it cannot run on `nodes` x `ranks_per_node`
    ranks (what `phalanx train` would refuse on the cluster, after the job had waited in the queue)."""
    config = load_config(path, overrides)
    world = nodes * ranks_per_node
    if world > 1 and config.parallel.strategy == "none":
        raise PhalanxError(
            f"parallel.strategy=none runs one process, not {world} ranks; set parallel.strategy=ddp or fsdp"
        )
    check_batch_sizes(config.train.global_batch_size, config.train.micro_batch_size, world)
    LaunchSpec(nproc=ranks_per_node, nnodes=str(nodes), rdzv_endpoint="head:29500").validate()
    return config


def resolved_yaml(config: Config, generator: str) -> str:
    """The config as one self-contained file (no `extends`, overrides applied, absolute paths)."""
    return f"# Written by `{generator}`: the resolved config every node trains from.\n" + dump_yaml(config)


def dns_label(name: str, limit: int) -> str:
    """A run name as a DNS-1123 label (Kubernetes object and host names): lower case, letters, digits
    and '-', starting with a letter, at most `limit` characters."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    label = label if label[:1].isalpha() else f"run-{label}"
    return label[:limit].rstrip("-")


def check_not_source(written: Path, source: str | None) -> None:
    """Refuse to overwrite the user's own config file with its resolved copy."""
    if source and Path(source).expanduser().resolve() == written.resolve():
        raise PhalanxError(f"{written} is the config being resolved; choose another --out")
