"""run_preflight: start the preflight on this node's ranks through the training launcher, grade what
they measured, record it in the run store, and quarantine this node if it failed.

`phalanx preflight` calls it; so can `phalanx train` before training and before restarts. Every node
of a multi-node job runs it (as every node runs `phalanx train`); each gets the whole job's report and
records and quarantines only itself, so nodes sharing a store each write their own row.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from phalanx.config.schema import Config
from phalanx.errors import PreflightFailedError, RestartsExhaustedError, StoreError
from phalanx.launch.local import LaunchSpec, OneShot, launch
from phalanx.preflight.evaluate import evaluate
from phalanx.preflight.report import PreflightReport
from phalanx.preflight.timing import SlowRank

OUTPUT_FILE = "preflight.json"


def run_preflight(
    config: Config,
    spec: LaunchSpec,
    quick: bool,
    overrides: dict[str, float] | None = None,
    slow: SlowRank | None = None,
    run_id: int | None = None,
    record: bool = True,
    progress: bool = True,
) -> PreflightReport:
    """Preflight this node as part of the job `spec` describes (the same spec training would use).

    overrides: limits from thresholds.parse_overrides (`--threshold`). slow: a slow-rank drill; None
    reads PHALANX_PREFLIGHT_SLOW_RANK / _FACTOR from the environment. run_id: the store's run this
    preflight belongs to, if any. record: write the result to the run store (observe.store) and
    quarantine this node there if it failed. Raises PreflightFailedError when the preflight could not
    complete (a rank crashed); a completed preflight returns its report, passed or not.
    """
    started = time.perf_counter()
    spec.validate()
    slow = slow if slow is not None else SlowRank.from_env()
    runs_root = Path(config.run.dir)
    runs_root.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="phalanx-preflight-"))
    launcher = uuid.uuid4().hex
    try:
        output = work_dir / OUTPUT_FILE
        params = {
            "quick": quick,
            "device": config.parallel.device,
            "backend": config.parallel.backend,
            "runs_root": str(runs_root.resolve()),
            "output": str(output),
            "overrides": overrides or {},
            "slow": {"rank": slow.rank, "factor": slow.factor} if slow else None,
            "progress": progress,
            "launcher": launcher,
        }
        params_file = work_dir / "params.json"
        params_file.write_text(json.dumps(params))
        job = OneShot("preflight", ("-m", "phalanx.preflight.worker", str(params_file)), work_dir)
        try:
            launch(spec, config, one_shot=job)
        except RestartsExhaustedError as exc:
            raise PreflightFailedError(
                f"the preflight could not complete ({exc}); the ranks' output above says why"
            ) from None
        if not output.is_file():
            raise PreflightFailedError(
                "this node was not admitted to the preflight job (the rendezvous closed without it)"
            )
        raw = json.loads(output.read_text())
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    report = evaluate(raw, overrides)
    report.seconds = time.perf_counter() - started
    report.node = own_node(report, launcher)
    if record:
        _record(config, report, report.node, run_id)
    return report


def own_node(report: PreflightReport, launcher: str) -> str:
    """The node this launcher ran (the rendezvous numbers nodes itself, so the node rank cannot say)."""
    return next(node for node, info in report.nodes.items() if info["launcher"] == launcher)


def _record(config: Config, report: PreflightReport, node: str, run_id: int | None) -> None:
    from phalanx.observe.observer import open_store

    try:
        _write_record(open_store(config), config, report, node, run_id)
    except StoreError as exc:
        report.notes.append(f"not recorded in the run store: {exc}")


def _write_record(store, config: Config, report: PreflightReport, node: str, run_id: int | None) -> None:
    if store is None:
        return
    try:
        row = report.for_node(node)
        store.add_preflight(node, row["passed"], row, run_id=run_id)
        report.recorded.append(node)
        if node in report.failed_nodes:
            store.quarantine_node(node, report.failed_nodes[node], run=config.run.name if run_id is not None else None)
            report.quarantined.append(node)
        elif any(q["node"] == node for q in store.quarantined()):
            report.notes.append(
                f"{node} passed but is still quarantined from an earlier preflight; "
                f"release it with `phalanx preflight --clear {node}`"
            )
    finally:
        store.close()
