"""Start the ranks of a run through torch's own elastic launcher (the machinery of `torchrun`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import PhalanxError


@dataclass(frozen=True)
class LaunchSpec:
    nproc: int = 1
    nnodes: str = "1"  # "N" or "MIN:MAX", as torchrun takes it
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    @property
    def world_size(self) -> int | None:
        """Total ranks, or None for an elastic range of nodes (known only at rendezvous)."""
        return self.nproc * int(self.nnodes) if self.nnodes.isdigit() else None

    @property
    def single_process(self) -> bool:
        return self.nproc == 1 and self.nnodes == "1"


def launch(spec: LaunchSpec, config_path: Path, show_progress: bool) -> int:
    """Run `phalanx.train.worker` on `spec.nproc` local ranks; returns the first failing rank's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = [f"--nproc-per-node={spec.nproc}", f"--nnodes={spec.nnodes}", f"--node-rank={spec.node_rank}"]
    if spec.rdzv_endpoint:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rdzv_endpoint}"]
    elif spec.nnodes == "1":
        args += ["--standalone"]  # a free local port instead of a fixed 29500: parallel runs don't collide
    else:
        raise PhalanxError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    args += ["--module", "phalanx.train.worker", str(config_path)]
    if not show_progress:
        args.append("--no-progress")
    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        return next((c for c in codes if c and c > 0), 1)
    return 0
