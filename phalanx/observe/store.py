"""The run store: runs, their step metrics, per-rank timings, events, goodput and hardware telemetry,
in one SQL database.

By default an SQLite file (WAL mode) in the runs root; any SQLAlchemy URL (PostgreSQL) lets several
machines share one store. The schema is migrated to the newest version with Alembic when a store
opens. Writers are node agents (one per node, off the training processes, see follower.py); readers
are the dashboard and `phalanx runs`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic.util.exc import CommandError
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError, SQLAlchemyError

from phalanx.errors import PhalanxError, StoreError
from phalanx.extras import require
from phalanx.observe import tables as t
from phalanx.observe.eval_reports import is_report
from phalanx.observe.redaction import redact as redact_secrets
from phalanx.observe.redaction import redact_url
from phalanx.run.throughput import LAUNCH, RunThroughput

STORE_FILE = "phalanx.db"
MAX_RUN_ID = 2**31 - 1  # runs.id is a 32-bit integer column


MIGRATIONS = Path(__file__).parent / "migrations"
STEP_FIELDS = (
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_sec",
    "mfu",
    "achieved_tflops",
    "peak_mem_gib",
    "step_seconds",
    "compute_seconds",
    "eval_seconds",
    "tokens_seen",
    "moe_imbalance",
)
HOST_FIELDS = ("cpu_ratio", "load1", "memory_used_bytes", "memory_total_bytes", "disk_free_bytes")
DEVICE_FIELDS = (
    "utilization_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
    "ecc_uncorrectable",
)
MAX_TAGS, MAX_TAG_CHARS, MAX_NOTE_CHARS = 20, 40, 4000
# More MoE layers than any model has (DeepSeek-V3 has 58): a longer list in a metrics line is not a
# routing report, and storing it would bloat every step row and the heatmap.
MAX_MOE_LAYERS = 1024
FAILURE_KINDS = ("worker_failed", "hang_detected", "restart", "regroup")


def store_url(spec: str | None, runs_root: Path) -> str:
    """None: the default SQLite file in the runs root; a URL is taken as it is; anything else is a path."""
    if spec is None:
        return f"sqlite:///{(Path(runs_root) / STORE_FILE).resolve()}"
    if "://" in spec:
        return spec
    return f"sqlite:///{Path(spec).resolve()}"


def check_url(url: str) -> None:
    """A PhalanxError (bad input) for what can never be a database URL; says nothing of reachability."""
    try:
        sa.engine.make_url(url)
    except Exception:
        raise PhalanxError(f"not a database URL: {url!r} (e.g. postgresql+psycopg://user@host/db)") from None


def redact(url: str) -> str:
    """The URL without its password, for messages (the one rule of redaction.py)."""
    return redact_url(url)


class RunStore:
    def __init__(self, url: str, create: bool = True):
        """Open (and migrate) the store at `url`. With create=False a missing SQLite file is an error."""
        self.url = url
        check_url(url)
        parsed = sa.engine.make_url(url)
        if parsed.get_backend_name() == "sqlite":
            path = Path(parsed.database or "")
            if not create and not path.is_file():
                raise PhalanxError(f"no run store at {path}; train a run first or pass --store")
            path.parent.mkdir(parents=True, exist_ok=True)
        elif parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3, the driver we install
        if parsed.drivername == "postgresql+psycopg":
            require("postgres", f"the run store {redact(url)}")
        # A store that does not answer must not hold a node agent for minutes: give up after 10 s.
        connect_args = {"connect_timeout": 10} if parsed.get_backend_name() == "postgresql" else {}
        try:
            self.engine = sa.create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
        except (ImportError, SQLAlchemyError) as exc:
            raise PhalanxError(f"cannot use store {redact(url)}: {exc}") from None
        if self.engine.dialect.name == "sqlite":
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self._migrate()

    @classmethod
    def open(cls, spec: str | None, runs_root: Path, create: bool = True) -> RunStore:
        return cls(store_url(spec, runs_root), create=create)

    def close(self) -> None:
        self.engine.dispose()

    def _migrate(self) -> None:
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        # Several node agents may open a new store at the same moment: one migrates, the others wait
        # and then find it done (without the lock, one fails with "table already exists").
        with self._migration_lock(), self._begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7411062)"))  # held until commit
            config.attributes["connection"] = conn
            try:
                command.upgrade(config, "head")
            except CommandError as exc:  # e.g. a store migrated by a newer phalanx
                raise StoreError(
                    f"cannot migrate run store {redact(self.url)}: {exc} (is this phalanx older "
                    "than the one that created it?)",
                    transient=False,
                ) from None

    @contextlib.contextmanager
    def _begin(self) -> Iterator[sa.Connection]:
        """A transaction whose database errors come out as one StoreError line."""
        with self._translate(), self.engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sa.Connection]:
        with self._translate(), self.engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except (OperationalError, InterfaceError, DisconnectionError) as exc:
            raise StoreError(f"run store {redact(self.url)} unavailable: {_reason(exc)}", transient=True) from None
        except SQLAlchemyError as exc:
            raise StoreError(
                f"run store {redact(self.url)} refused the request: {_reason(exc)}", transient=False
            ) from None

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        """For SQLite, an exclusive lock on a file next to the database; PostgreSQL locks in SQL."""
        if self.engine.dialect.name != "sqlite":
            yield
            return
        with open(f"{self.engine.url.database}.migrate-lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def schema_version(self) -> str | None:
        with self._connect() as conn:
            return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()

    # -- writing (node agents) ---------------------------------------------------------------------
    def start_run(
        self,
        name: str,
        run_dir: Path,
        config: dict[str, Any],
        model: str,
        world_size: int | None,
        max_steps: int,
        node: str,
    ) -> int:
        """Register a launch of the run in `run_dir` (a new run or a relaunch) as running; its id."""
        now, run_dir = time.time(), str(Path(run_dir).resolve())
        values = dict(
            name=_clip(name, 200),
            status="running",
            model=_clip(model, 200),
            world_size=world_size,
            config=json.dumps(redact_secrets(config)),
            max_steps=max_steps,
            updated_at=now,
            ended_at=None,
            error=None,
        )
        for _ in range(2):  # a second try if another writer inserted the same directory in between
            try:
                with self._begin() as conn:
                    run_id = conn.execute(sa.select(t.runs.c.id).where(t.runs.c.dir == run_dir)).scalar()
                    if run_id is None:
                        run_id = conn.execute(
                            t.runs.insert().values(dir=run_dir, started_at=now, restarts=0, **values)
                        ).inserted_primary_key[0]
                    else:
                        conn.execute(t.runs.update().where(t.runs.c.id == run_id).values(**values))
                break
            except StoreError as exc:
                if exc.transient or "unique" not in str(exc).lower():
                    raise
        self.add_node(run_id, node)
        return run_id

    def add_node(self, run_id: int, node: str) -> None:
        with self._begin() as conn:
            _add_nodes(conn, run_id, [node])

    def offsets(self, run_id: int) -> dict[str, int]:
        with self._connect() as conn:
            rows = conn.execute(
                sa.select(t.ingest_offsets.c.path, t.ingest_offsets.c.position).where(
                    t.ingest_offsets.c.run_id == run_id
                )
            )
            return {path: position for path, position in rows}

    def ingest(
        self,
        run_id: int,
        metrics: list[dict],
        rank_records: list[dict],
        events: list[dict],
        offsets: dict[str, int],
        telemetry: list[dict] = (),
        eval_scores: list[dict] = (),
    ) -> None:
        """One transaction: new step metrics, per-rank timings, events, hardware samples and benchmark
        scores (eval_reports.py's rows), and how far each file was read (a report: that it was)."""
        now = time.time()
        with self._begin() as conn:
            _insert_telemetry(conn, run_id, telemetry, now)
            if eval_scores:
                conn.execute(t.eval_scores.insert(), [{"run_id": run_id, **row} for row in eval_scores])
            # A report read before is marked already: rewriting every report's mark each second would cost
            # a statement per report of the run (a report without scores is simply read again next launch).
            reports = {row["report"] for row in eval_scores}
            offsets = {p: n for p, n in offsets.items() if not is_report(p) or p in reports}
            if metrics:
                conn.execute(t.steps.insert(), [_step_row(run_id, m) for m in metrics])
            if rank_records:
                conn.execute(
                    t.rank_steps.insert(),
                    [
                        {
                            "run_id": run_id,
                            "step": r["step"],
                            "rank": r["rank"],
                            "node": _clip(r.get("node"), 200),
                            "time": r.get("time", now),
                            **{k: _num(r.get(k)) for k in ("step_seconds", "compute_seconds", "data_seconds")},
                        }
                        for r in rank_records
                    ],
                )
                # The nodes that ran ranks: known from the ranks' own records, so only one writer is needed.
                _add_nodes(conn, run_id, sorted({r["node"] for r in rank_records if r.get("node")}))
            if events:
                conn.execute(
                    t.events.insert(),
                    [
                        {
                            "run_id": run_id,
                            "time": e.get("time", now),
                            "node": _clip(e.get("node"), 200),
                            "rank": e.get("rank"),
                            "kind": _clip(e["kind"], 60),
                            "details": json.dumps(
                                {k: v for k, v in e.items() if k not in ("time", "node", "rank", "kind")}
                            ),
                        }
                        for e in events
                    ],
                )
            for path, position in offsets.items():
                updated = conn.execute(
                    t.ingest_offsets.update()
                    .where(t.ingest_offsets.c.run_id == run_id, t.ingest_offsets.c.path == path)
                    .values(position=position)
                )
                if updated.rowcount == 0:
                    conn.execute(t.ingest_offsets.insert().values(run_id=run_id, path=path, position=position))
            summary = _run_summary(metrics, events)
            if any("step_seconds" in m for m in metrics) or any(e["kind"] == LAUNCH for e in events):
                summary.update(_add_throughput(conn, run_id, metrics, events))
            if any(e["kind"] == "restart" for e in events):
                # Every node's agent logs each restart of the job: count the node that logged most.
                per_node = (
                    sa.select(sa.func.count().label("n"))
                    .where(t.events.c.run_id == run_id, t.events.c.kind == "restart")
                    .group_by(t.events.c.node)
                    .subquery()
                )
                summary["restarts"] = conn.execute(sa.select(sa.func.max(per_node.c.n))).scalar() or 0
            if summary or metrics or events:
                conn.execute(t.runs.update().where(t.runs.c.id == run_id).values(updated_at=now, **summary))

    def finish_run(self, run_id: int, status: str, error: str | None = None) -> None:
        now = time.time()
        with self._begin() as conn:
            conn.execute(
                t.runs.update()
                .where(t.runs.c.id == run_id)
                .values(status=status, error=error, ended_at=now, updated_at=now)
            )

    def set_goodput(self, run_id: int, report: dict[str, Any]) -> None:
        now = time.time()
        with self._begin() as conn:
            conn.execute(t.goodput.delete().where(t.goodput.c.run_id == run_id))
            conn.execute(t.goodput.insert().values(run_id=run_id, updated_at=now, report=json.dumps(report)))
            conn.execute(t.runs.update().where(t.runs.c.id == run_id).values(ettr=report.get("ettr")))

    def add_preflight(self, node: str, passed: bool, results: dict[str, Any], run_id: int | None = None) -> None:
        with self._begin() as conn:
            conn.execute(
                t.preflight.insert().values(
                    run_id=run_id, node=node, time=time.time(), passed=int(passed), results=json.dumps(results)
                )
            )

    def annotate(self, run_id: int, tags: list[str] | None = None, note: str | None = None) -> dict[str, Any]:
        """Set a run's tags and/or note (None leaves one as it is); the run's tags and note after."""
        values: dict[str, Any] = {}
        if tags is not None:
            values["tags"] = json.dumps(clean_tags(tags))
        if note is not None:
            if not isinstance(note, str):
                raise PhalanxError("note must be a string")
            if len(note) > MAX_NOTE_CHARS:
                raise PhalanxError(f"note is {len(note)} characters; at most {MAX_NOTE_CHARS}")
            values["note"] = note.strip() or None
        self.run(run_id)  # a PhalanxError for a run that is not there
        if values:
            with self._begin() as conn:
                conn.execute(t.runs.update().where(t.runs.c.id == run_id).values(**values))
        run = self.run(run_id)
        return {"tags": run["tags"], "note": run["note"]}

    def quarantine_node(self, node: str, reason: str, run: str | None = None) -> None:
        """Keep `node` out of later launches on this store (a newer reason replaces an older one)."""
        with self._begin() as conn:
            conn.execute(t.quarantine.delete().where(t.quarantine.c.node == node))
            conn.execute(t.quarantine.insert().values(node=node, reason=reason, since=time.time(), run=run))

    def clear_quarantine(self, node: str) -> bool:
        """Let `node` join launches again; False if it was not quarantined."""
        with self._begin() as conn:
            return conn.execute(t.quarantine.delete().where(t.quarantine.c.node == node)).rowcount > 0

    def quarantined(self) -> list[dict[str, Any]]:
        with self._connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(t.quarantine).order_by(t.quarantine.c.since)).mappings()]

    # -- reading (dashboard, `phalanx runs`) ---------------------------------------------------------
    def list_runs(self) -> list[dict[str, Any]]:
        with self._connect() as conn:
            rows = conn.execute(sa.select(t.runs).order_by(t.runs.c.started_at.desc())).mappings().all()
            return [_run_dict(row) for row in rows]

    def run(self, run_id: int) -> dict[str, Any]:
        if not 0 < run_id <= MAX_RUN_ID:
            raise PhalanxError(f"no run with id {run_id} in the store")
        with self._connect() as conn:
            row = conn.execute(sa.select(t.runs).where(t.runs.c.id == run_id)).mappings().first()
            if row is None:
                raise PhalanxError(f"no run with id {run_id} in the store")
            run = _run_dict(row)
            # Redacted again on the way out: rows an older phalanx stored kept their secrets.
            run["config"] = redact_secrets(json.loads(row["config"])) if row["config"] else None
            run["nodes"] = list(
                conn.execute(
                    sa.select(t.run_nodes.c.node)
                    .where(t.run_nodes.c.run_id == run_id)
                    .order_by(t.run_nodes.c.joined_at)
                ).scalars()
            )
            return run

    def run_id_for_dir(self, run_dir: Path) -> int | None:
        with self._connect() as conn:
            return conn.execute(sa.select(t.runs.c.id).where(t.runs.c.dir == str(Path(run_dir).resolve()))).scalar()

    def find_run(self, name_or_id: str) -> dict[str, Any]:
        """A run by name (the newest of that name) or by numeric id."""
        with self._connect() as conn:
            query = sa.select(t.runs.c.id).order_by(t.runs.c.started_at.desc())
            run_id = conn.execute(query.where(t.runs.c.name == name_or_id)).scalar()
            if run_id is None and name_or_id.isdigit() and int(name_or_id) <= MAX_RUN_ID:
                run_id = conn.execute(query.where(t.runs.c.id == int(name_or_id))).scalar()
            if run_id is None:
                names = conn.execute(sa.select(t.runs.c.name).distinct()).scalars().all()
                known = ", ".join(sorted(names)[:20]) or "none yet"
                raise PhalanxError(f"no run named {name_or_id!r} in the store (runs: {known})")
        return self.run(run_id)

    def series(self, run_id: int, max_points: int = 1000, every_run: bool = False) -> dict[str, list]:
        """Training curves: every step, or past max_points an evenly spaced sample of steps (as TensorBoard
        samples long runs), read through the (run_id, step) index so a long run answers as fast as a short one.
        A step run twice (before and after a restart) is one point, the mean of its runs at the time of its
        newest; with every_run each run of it is a point of its own, in time order (a wall-time axis)."""
        c = t.steps.c
        fields = (
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_sec",
            "mfu",
            "achieved_tflops",
            "peak_mem_gib",
            "step_seconds",
            "tokens_seen",
            "moe_imbalance",
        )
        with self._connect() as conn:
            last = conn.execute(sa.select(sa.func.max(c.step)).where(c.run_id == run_id)).scalar() or 0
            where = [c.run_id == run_id, c.loss.is_not(None)]
            sample = _sample_steps(last, max_points, per_bin=1)
            if sample is not None:
                where.append(c.step.in_(sample))
            validated = [c.run_id == run_id, c.val_loss.is_not(None)]
            if every_run:
                rows = conn.execute(
                    sa.select(c.step, c.time, *(c[f] for f in fields)).where(*where).order_by(c.time, c.id)
                ).all()
                val = conn.execute(sa.select(c.step, c.time, c.val_loss).where(*validated).order_by(c.time, c.id)).all()
            else:
                rows = conn.execute(
                    sa.select(c.step, sa.func.max(c.time), *(sa.func.avg(c[f]) for f in fields))
                    .where(*where)
                    .group_by(c.step)
                    .order_by(c.step)
                ).all()
                val = conn.execute(
                    sa.select(c.step, sa.func.max(c.time), sa.func.avg(c.val_loss))
                    .where(*validated)
                    .group_by(c.step)
                    .order_by(c.step)
                ).all()
        out: dict[str, list] = {"step": [r[0] for r in rows], "time": [r[1] for r in rows]}
        for i, f in enumerate(fields, start=2):
            out[f] = [r[i] for r in rows]
        out["val_step"], out["val_time"], out["val_loss"] = (
            [r[0] for r in val],
            [r[1] for r in val],
            [r[2] for r in val],
        )
        return out

    def steps_at(self, run_id: int, times: list[float]) -> list[int]:
        """For each time, the step the run had last logged by then (0 before its first): where an event
        without a step of its own (a restart, a crash) happened, on a step axis."""
        c = t.steps.c
        query = (
            sa.select(c.step)
            .where(c.run_id == run_id, c.time <= sa.bindparam("at"))
            .order_by(c.time.desc(), c.id.desc())
            .limit(1)
        )  # through ix_steps_run_time
        with self._connect() as conn:
            return [conn.execute(query, {"at": at}).scalar() or 0 for at in times]

    def telemetry(self, run_id: int, max_points: int = 500) -> dict[str, list[dict[str, Any]]]:
        """Host and accelerator samples, one series per node (and device): every sample, or past
        max_points an evenly spaced sample of them."""
        with self._connect() as conn:
            host = _telemetry_series(conn, t.host_telemetry, run_id, ("node",), HOST_FIELDS, max_points)
            devices = _telemetry_series(conn, t.device_telemetry, run_id, ("node", "device"), DEVICE_FIELDS, max_points)
        return {"host": host, "devices": devices}

    def rank_heatmap(
        self, run_id: int, max_bins: int = 200, samples_per_bin: int = 5, warmup_steps: frozenset[int] = frozenset()
    ) -> dict[str, Any]:
        """Each rank's own compute time per step, or past max_bins per bin of steps (the mean of a few
        evenly spaced steps in it): the straggler heatmap, rows ranks, columns the bins' last steps.
        `range` is the least and greatest cell leaving out `warmup_steps` (the first step of each launch
        compiles and allocates: many times slower, it would wash every other cell out to one colour)."""
        c = t.rank_steps.c
        with self._connect() as conn:
            last = conn.execute(sa.select(sa.func.max(c.step)).where(c.run_id == run_id)).scalar() or 0
            where = [c.run_id == run_id]
            sample = _sample_steps(last, max_bins, per_bin=samples_per_bin)
            if sample is not None:
                where.append(c.step.in_(sample))
            rows = conn.execute(sa.select(c.step, c.rank, c.compute_seconds).where(*where)).all()
        stride = max(1, math.ceil(last / max_bins))
        cells: dict[tuple[int, int], list[float]] = {}
        steady: dict[tuple[int, int], list[float]] = {}
        for step, rank, value in rows:
            if value is not None:
                bin_end = min(last, ((step - 1) // stride + 1) * stride)
                cells.setdefault((bin_end, rank), []).append(value)
                if step not in warmup_steps:
                    steady.setdefault((bin_end, rank), []).append(value)
        steps = sorted({s for s, _ in cells})
        ranks = sorted({r for _, r in cells})
        z = [[statistics.fmean(cells[(s, r)]) if (s, r) in cells else None for s in steps] for r in ranks]
        means = [statistics.fmean(v) for v in steady.values()]
        return {
            "steps": steps,
            "ranks": ranks,
            "compute_seconds": z,
            "stride": stride,
            "range": [min(means), max(means)] if means else None,
        }

    def moe_heatmap(self, run_id: int, max_bins: int = 200, samples_per_bin: int = 5) -> dict[str, Any]:
        """A mixture of experts' routing balance per MoE layer and step, or past max_bins per bin of
        steps (the mean of a few evenly spaced steps in it, as rank_heatmap): rows the MoE layers (0
        first), columns the bins' last steps, each cell the busiest expert's tokens over the mean
        expert's (1: even). No layers for a dense model."""
        c = t.steps.c
        with self._connect() as conn:
            last = conn.execute(sa.select(sa.func.max(c.step)).where(c.run_id == run_id)).scalar() or 0
            where = [c.run_id == run_id, c.moe_imbalance_by_layer.is_not(None)]
            sample = _sample_steps(last, max_bins, per_bin=samples_per_bin)
            if sample is not None:
                where.append(c.step.in_(sample))
            rows = conn.execute(sa.select(c.step, c.moe_imbalance_by_layer).where(*where)).all()
        stride = max(1, math.ceil(last / max_bins))
        cells: dict[tuple[int, int], list[float]] = {}
        for step, by_layer in rows:
            bin_end = min(last, ((step - 1) // stride + 1) * stride)
            for layer, ratio in enumerate(_stored_layer_ratios(by_layer)):
                if ratio is not None:
                    cells.setdefault((bin_end, layer), []).append(ratio)
        steps = sorted({s for s, _ in cells})
        layers = list(range(max((layer for _, layer in cells), default=-1) + 1))
        z = [[statistics.fmean(cells[(s, layer)]) if (s, layer) in cells else None for s in steps] for layer in layers]
        return {"steps": steps, "layers": layers, "imbalance": z, "stride": stride}

    def events(self, run_id: int) -> list[dict[str, Any]]:
        with self._connect() as conn:
            rows = (
                conn.execute(
                    sa.select(t.events).where(t.events.c.run_id == run_id).order_by(t.events.c.time, t.events.c.id)
                )
                .mappings()
                .all()
            )
        return [
            {
                "time": r["time"],
                "node": r["node"],
                "rank": r["rank"],
                "kind": r["kind"],
                **json.loads(r["details"] or "{}"),
            }
            for r in rows
        ]

    def eval_scores(self, run_id: int) -> list[dict[str, Any]]:
        """The run's benchmark scores, one dict per report, task and metric, by step (then report time)."""
        c = t.eval_scores.c
        columns = (c.step, c.time, c.report, c.task, c.metric, c.value, c.stderr, c.samples, c.limit)
        with self._connect() as conn:
            rows = conn.execute(sa.select(*columns).where(c.run_id == run_id).order_by(c.step, c.time, c.id)).mappings()
            return [dict(r) for r in rows]

    def newest_eval_scores(self) -> list[dict[str, Any]]:
        """Every run's newest score per task and metric (of its latest evaluated step, the newer report
        of a step evaluated twice): {run_id, step, task, metric, value, stderr}, for /metrics."""
        c = t.eval_scores.c
        newest = (
            sa.select(c.run_id, sa.func.max(c.step).label("step"))
            .group_by(c.run_id, c.task, c.metric)
            .add_columns(c.task, c.metric)
            .subquery()
        )
        query = (
            sa.select(c.run_id, c.step, c.task, c.metric, c.value, c.stderr)
            .join(
                newest,
                sa.and_(
                    c.run_id == newest.c.run_id,
                    c.step == newest.c.step,
                    c.task == newest.c.task,
                    c.metric == newest.c.metric,
                ),
            )
            .order_by(c.run_id, c.task, c.metric, c.time, c.id)
        )
        with self._connect() as conn:
            latest = {(r["run_id"], r["task"], r["metric"]): dict(r) for r in conn.execute(query).mappings()}
        return list(latest.values())  # ordered by time: a step's newer report is the one kept

    def goodput(self, run_id: int) -> dict[str, Any] | None:
        with self._connect() as conn:
            report = conn.execute(sa.select(t.goodput.c.report).where(t.goodput.c.run_id == run_id)).scalar()
        return json.loads(report) if report else None

    def preflights(self, run_id: int | None = None) -> list[dict[str, Any]]:
        query = sa.select(t.preflight).order_by(t.preflight.c.time)
        if run_id is not None:
            query = query.where(t.preflight.c.run_id == run_id)
        with self._connect() as conn:
            return [
                {**dict(r), "passed": bool(r["passed"]), "results": json.loads(r["results"])}
                for r in conn.execute(query).mappings()
            ]


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL: readers (the dashboard) never block the writer; busy_timeout: a second writer waits, not fails.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _sample_steps(last: int, bins: int, per_bin: int) -> list[int] | None:
    """Up to `per_bin` evenly spaced steps from each of `bins` equal bins of 1..last (None: use all steps)."""
    if last <= bins * per_bin:
        return None
    stride = math.ceil(last / bins)
    gap = max(1, stride // per_bin)
    return sorted(
        {
            min(last, start + offset)
            for start in range(0, last, stride)
            for offset in range(gap, stride + 1, gap)[:per_bin]
        }
    )


def clean_tags(tags: Any) -> list[str]:
    """Tags as stored: a list of distinct short strings without commas (the dashboard's tag field splits
    on them), in the order given. Anything else is a PhalanxError naming what is wrong."""
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise PhalanxError('tags must be a list of strings, e.g. ["baseline", "lr-sweep"]')
    out = list(dict.fromkeys(tag.strip() for tag in tags if tag.strip()))
    for tag in out:
        if len(tag) > MAX_TAG_CHARS or "," in tag or not tag.isprintable():
            raise PhalanxError(f"tag {tag[:60]!r} must be at most {MAX_TAG_CHARS} printable characters, without commas")
    if len(out) > MAX_TAGS:
        raise PhalanxError(f"{len(out)} tags; a run takes at most {MAX_TAGS}")
    return out


def _insert_telemetry(conn: sa.Connection, run_id: int, samples: list[dict], now: float) -> None:
    """The node agents' samples: {"time", "node", "host": {...}, "devices": [{"device", ...}]}, each
    numbered on from its node's newest sample in the run."""
    host_rows, device_rows, last_seq = [], [], {}
    h = t.host_telemetry.c
    for sample in samples:
        when, node = sample.get("time", now), _clip(str(sample.get("node") or "?"), 200)
        if node not in last_seq:  # the run's newest rows, read backwards through (run_id, seq) to this node's
            last_seq[node] = (
                conn.execute(
                    sa.select(h.seq).where(h.run_id == run_id, h.node == node).order_by(h.seq.desc()).limit(1)
                ).scalar()
                or 0
            )
        last_seq[node] += 1
        host = sample.get("host") if isinstance(sample.get("host"), dict) else {}
        host_rows.append(
            {
                "run_id": run_id,
                "seq": last_seq[node],
                "time": when,
                "node": node,
                **{f: _num(host.get(f)) for f in HOST_FIELDS},
            }
        )
        for device in sample.get("devices") or []:
            if isinstance(device, dict) and isinstance(device.get("device"), int):
                device_rows.append(
                    {
                        "run_id": run_id,
                        "seq": last_seq[node],
                        "time": when,
                        "node": node,
                        "device": device["device"],
                        **{f: _num(device.get(f)) for f in DEVICE_FIELDS},
                    }
                )
    if host_rows:
        conn.execute(t.host_telemetry.insert(), host_rows)
    if device_rows:
        conn.execute(t.device_telemetry.insert(), device_rows)


def _telemetry_series(
    conn: sa.Connection, table: sa.Table, run_id: int, keys: tuple[str, ...], fields: tuple[str, ...], max_points: int
) -> list[dict[str, Any]]:
    """One series per distinct `keys` (node, or node and device): time and each field of every sample,
    or past max_points samples an evenly spaced sample of them (by seq, through the (run_id, seq)
    index, as TensorBoard samples long runs), so a week of 5-second samples is still one small answer."""
    c = table.c
    last = conn.execute(sa.select(sa.func.max(c.seq)).where(c.run_id == run_id)).scalar() or 0
    where = [c.run_id == run_id]
    sample = _sample_steps(last, max_points, per_bin=1)
    if sample is not None:
        where.append(c.seq.in_(sample))
    key_columns = [c[k] for k in keys]
    query = sa.select(*key_columns, c.time, *(c[f] for f in fields)).where(*where).order_by(*key_columns, c.seq)
    out: dict[tuple, dict[str, Any]] = {}
    for row in conn.execute(query):
        key = tuple(row[: len(keys)])
        series = out.get(key)
        if series is None:
            series = out[key] = {**dict(zip(keys, key)), "time": [], **{f: [] for f in fields}}
        series["time"].append(row[len(keys)])
        for f, value in zip(fields, row[len(keys) + 1 :]):
            series[f].append(value)
    return list(out.values())


def _add_nodes(conn: sa.Connection, run_id: int, nodes: list[str]) -> None:
    known = set(conn.execute(sa.select(t.run_nodes.c.node).where(t.run_nodes.c.run_id == run_id)).scalars())
    for node in nodes:
        if node not in known:
            conn.execute(t.run_nodes.insert().values(run_id=run_id, node=_clip(node, 200), joined_at=time.time()))


def _clip(value: Any, length: int) -> Any:
    """Strings longer than their column (PostgreSQL refuses them; SQLite would not notice) are cut."""
    return value[:length] if isinstance(value, str) else value


def _reason(exc: SQLAlchemyError) -> str:
    """The driver's own message, first line only."""
    return (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]


def _num(value: Any) -> float | None:
    """A finite number as a float; None for anything else (a string, NaN, an integer too large for a
    float, which a hostile metrics line can hold: JSON has no size limit on integers)."""
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _layer_ratios(value: Any) -> str | None:
    """A metrics line's moe_imbalance_by_layer as stored: JSON of one number per MoE layer, an entry
    that is not a finite number kept as null (the layers after it keep their places); None for
    anything but a list of 1 to MAX_MOE_LAYERS entries with at least one number. The length is checked
    first, so a huge list costs nothing to refuse."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MOE_LAYERS:
        return None
    ratios = [_num(v) for v in value]
    return json.dumps(ratios) if any(r is not None for r in ratios) else None


def _stored_layer_ratios(text: str | None) -> list[float | None]:
    """A stored moe_imbalance_by_layer back as a list; validated again, since a row written by other
    means than ingest (an older copy, a hand edit) must not break the dashboard."""
    try:
        value = json.loads(text or "null")
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    return [_num(v) for v in value[:MAX_MOE_LAYERS]]


def _step_row(run_id: int, m: dict[str, Any]) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "step": m["step"],
        "time": m.get("time", time.time()),
        "skipped": _clip(m.get("skipped"), 40),
        **{f: _num(m.get(f)) for f in STEP_FIELDS},
        "moe_imbalance_by_layer": _layer_ratios(m.get("moe_imbalance_by_layer")),
    }


def _run_summary(metrics: list[dict], events: list[dict]) -> dict[str, Any]:
    """What a batch changes in the runs row: the newest step's figures and running vs restarting (the
    run's throughput is _add_throughput's)."""
    out: dict[str, Any] = {}
    trained = [m for m in metrics if "loss" in m]
    if trained:
        last = trained[-1]
        out.update(
            last_step=last["step"],
            last_loss=_num(last["loss"]),
            tokens_seen=_num(last.get("tokens_seen")),
        )
    validated = [m for m in metrics if m.get("val_loss") is not None]
    if validated:
        out["last_val_loss"] = _num(validated[-1]["val_loss"])
    last_failure = max((e["time"] for e in events if e["kind"] in FAILURE_KINDS), default=None)
    last_progress = max(
        [e["time"] for e in events if e["kind"] == "training_started"] + [m.get("time", 0) for m in trained],
        default=None,
    )
    if last_failure is not None and (last_progress is None or last_failure > last_progress):
        out["status"] = "restarting"
    elif last_progress is not None:
        out["status"] = "running"
    return out


def _add_throughput(conn: sa.Connection, run_id: int, metrics: list[dict], events: list[dict]) -> dict[str, Any]:
    """The runs row's tokens_per_sec, achieved_tflops and mfu with a batch added: the run's average over
    its training time (phalanx/run/throughput.py), from the running sums the row keeps."""
    saved = conn.execute(sa.select(t.runs.c.throughput).where(t.runs.c.id == run_id).with_for_update()).scalar()
    throughput = RunThroughput(json.loads(saved) if saved else None)
    throughput.add(metrics, events)
    return {"throughput": json.dumps(throughput.state()), **throughput.rates()}


def _run_dict(row: Any) -> dict[str, Any]:
    out = {
        k: row[k]
        for k in (
            "id",
            "name",
            "dir",
            "status",
            "model",
            "world_size",
            "started_at",
            "ended_at",
            "updated_at",
            "last_step",
            "max_steps",
            "last_loss",
            "last_val_loss",
            "tokens_per_sec",
            "achieved_tflops",
            "mfu",
            "restarts",
            "ettr",
            "error",
            "tokens_seen",
            "note",
        )
    }
    out["tags"] = json.loads(row["tags"]) if row["tags"] else []
    return out
