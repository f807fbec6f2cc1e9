"""What eval.tasks costs training: the same run trained twice by the real CLI, without and with
lm-evaluation-harness tasks scored on its checkpoints in the background (rank 0, nice 10), on this
machine's CPU (or GPU, with --device cuda).

Reported: the median step time outside and during evaluations (from each `eval_tasks_finished` event and
from metrics.jsonl), the whole run's wall time each way, each evaluation's own time, and how long the
end of the run waited for the last checkpoint's. The task is a local multiple-choice task made from the
built-in corpus, so the bench runs offline.

Usage: .venv/bin/python bench/eval_during_training_bench.py [--steps 60] [--interval 20] [--limit 40]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phalanx.data.corpus import iter_documents, resolve_sources

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_task(folder: Path, text: str, items: int = 100) -> None:
    """A multiple-choice task: a line's first half, then its own second half among three others'."""
    lines = [line.strip() for line in text.splitlines() if 30 < len(line.strip()) < 70]
    halves = [
        (line[: line.rfind(" ", 0, len(line) // 2)], line[line.rfind(" ", 0, len(line) // 2) :])
        for line in random.Random(0).sample(lines, 2 * items)
    ]
    rng, rows = random.Random(1), []
    for i, (context, ending) in enumerate(halves[:items]):
        choices = [ending] + [halves[items + (i + k) % items][1] for k in range(3)]
        rng.shuffle(choices)
        rows.append({"context": context, "choices": choices, "answer": choices.index(ending)})
    (folder / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )


def train(root: Path, name: str, args: argparse.Namespace, corpus: Path, extra: list[str]) -> dict:
    command = [
        sys.executable,
        "-m",
        "phalanx",
        "train",
        f"data.sources=[{corpus}]",
        f"run.dir={root}",
        f"run.name={name}",
        "model.max_seq_len=128",
        "train.seq_len=128",
        "train.global_batch_size=8",
        f"train.max_steps={args.steps}",
        f"train.eval_interval={args.steps}",
        f"checkpoint.interval={args.interval}",
        "checkpoint.keep=100",
        "observe.store=none",
        f"parallel.device={args.device}",
        *extra,
        "--json",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **OFFLINE})
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{name}: phalanx train exited {proc.returncode}\n{proc.stderr}")
    run_dir = root / name
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [m["step_seconds"] for m in metrics if "step_seconds" in m and m["step"] > 1]  # step 1 compiles
    finished = [e for e in events if e["kind"] == "eval_tasks_finished"]
    return {
        "wall_seconds": round(wall, 2),
        "median_step_ms": round(1000 * statistics.median(steps), 2),
        "mean_step_ms": round(1000 * statistics.fmean(steps), 2),
        "evaluations": [
            {
                k: round(e[k], 4) if isinstance(e.get(k), float) else e.get(k)
                for k in (
                    "step",
                    "seconds",
                    "steps_during",
                    "step_seconds_during",
                    "step_seconds_outside",
                    "slowdown",
                    "blocked_seconds",
                )
            }
            for e in finished
        ],
        "failed": [e for e in events if e["kind"] == "eval_tasks_failed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=20, help="checkpoint.interval (every one is scored)")
    parser.add_argument("--limit", type=int, default=40, help="eval.limit: questions scored per checkpoint")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs, alternated: a busy host moves both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="phalanx-eval-bench-") as tmp:
        root = Path(tmp)
        sources = [s for s in resolve_sources(["builtin:shakespeare"], Path.cwd()) if s.path.stem == "macbeth"]
        corpus = root / "corpus.txt"
        corpus.write_text("\n\n".join(iter_documents(sources)))
        tasks = root / "tasks"
        tasks.mkdir()
        write_task(tasks, corpus.read_text())
        train(root, "warm", args, corpus, ["train.max_steps=2"])  # data prepared and cached for both runs
        evals = ["eval.tasks=[bench_mc]", f"eval.limit={args.limit}", f"eval.include_path={tasks}"]
        base, with_eval = [], []
        for i in range(args.repeats):
            base.append(train(root, f"without-{i}", args, corpus, []))
            with_eval.append(train(root, f"with-{i}", args, corpus, evals))

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(
        json.dumps(
            {
                "device": args.device,
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "steps": args.steps,
                "checkpoint_interval": args.interval,
                "limit": args.limit,
                "without_eval": base,
                "with_eval": with_eval,
                "median_step_ratio": round(median(with_eval, "median_step_ms") / median(base, "median_step_ms"), 3),
                "wall_ratio": round(median(with_eval, "wall_seconds") / median(base, "wall_seconds"), 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
