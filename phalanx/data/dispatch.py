"""Running the units' jobs (data/parts.py): here in this process, on worker processes of this node, or as
Ray tasks across a cluster. Whichever runs them, the results come back in unit order, so the shards can
be written while later units are still being tokenised."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import islice

from phalanx.data.parts import TokenizerSpec, UnitJob
from phalanx.errors import PhalanxError


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use, not what the machine has
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def run_local(jobs: list[UnitJob], spec: TokenizerSpec, workers: int) -> Iterator[dict]:
    """Each job's counts, in order. One worker runs them here, its encoder on every core; more run them
    in spawned processes (fork would copy a parent whose Rust thread pool may be mid-use), each encoder
    on its share of the cores."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield job.run(spec)
        return
    workers = min(workers, len(jobs))
    threads = max(1, available_cores() // workers)
    context = multiprocessing.get_context("spawn")
    # An executor, not a Pool: a worker that dies (the OOM killer) fails the preparation with
    # BrokenProcessPool, where a Pool would wait for its lost unit forever.
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(spec, threads, os.getpid())
    )
    try:
        yield from pool.map(_run_job, jobs)
    finally:  # stopped early (an error, Ctrl-C): no new units; those under way finish their parts
        pool.shutdown(wait=True, cancel_futures=True)


_SPEC: TokenizerSpec | None = None


def _start_worker(spec: TokenizerSpec, threads: int, parent: int) -> None:
    global _SPEC
    _SPEC = spec
    # The Rust encoder's thread pool reads this when it first starts: workers x threads = the cores.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker waits on its queue forever once the preparing process is killed (nothing closes it):
    it goes within a second of its parent instead (`parent` as the parent gave it: a worker still
    starting when the parent died has never seen it as its parent)."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _run_job(job: UnitJob) -> dict:
    return job.run(_SPEC)


def run_on_ray(jobs: list[UnitJob], spec: TokenizerSpec, address: str) -> Iterator[dict]:
    """Each job's counts, in order, each job a Ray task of one CPU, dealt round the cluster's nodes. The
    parts are written by the tasks into the staging directory, which must be on storage every node
    shares (the run root is, for a cluster run)."""
    try:
        import ray
    except ImportError:
        raise PhalanxError("--ray-address needs the 'ray' package: pip install 'phalanx[ray]'") from None
    connected_here = not ray.is_initialized()
    if connected_here:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except Exception as e:  # ConnectionError, or ValueError for an address of the wrong form
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PhalanxError(f"cannot connect to the Ray cluster at {address} ({message})") from None
    try:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=1, max_retries=3)(_ray_job)
        spec_ref = ray.put(spec)  # sent to each node once, not with every task
        # Units go round the nodes' CPUs in turn: Ray's own SPREAD is a hint that short tasks often
        # leave on the first node. Soft: a node that is gone or full passes its units on.
        slots = [n["NodeID"] for n in ray.nodes() if n["Alive"] for _ in range(int(n["Resources"].get("CPU", 0)))]
        window = max(2, 2 * len(slots))  # keep every CPU busy, no more

        def submit(job: UnitJob):
            if not slots:
                return task.remote(job, spec_ref)
            where = NodeAffinitySchedulingStrategy(slots[job.index % len(slots)], soft=True)
            return task.options(scheduling_strategy=where).remote(job, spec_ref)

        queue = iter(jobs)
        pending: deque = deque(submit(job) for job in islice(queue, window))
        while pending:
            result = ray.get(pending.popleft())
            job = next(queue, None)
            if job is not None:
                pending.append(submit(job))
            yield result
    finally:
        if connected_here:
            ray.shutdown()


def _ray_job(job: UnitJob, spec: TokenizerSpec) -> dict:
    import ray

    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one CPU per task: the node runs as many tasks
    return {**job.run(spec), "node": ray.get_runtime_context().get_node_id()}
