"""`phalanx eval` (issue 31): lm-evaluation-harness tasks through phalanx's own server and engine, and
bits per byte on held-out text through the model itself.

The tasks are local (a multiple-choice task made here from the corpus, `dataset_path: json`), the harness
runs offline. The command's accuracy is held to the harness's own `hf` model on the HF export of the same
weights (slow: transformers); bits per byte to the test's own forward passes of the same model.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY
from tests.helpers import phalanx, train_json

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
CONTEXT = 128  # the run's max_seq_len: short enough that a few hundred tokens need several windows


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No hub, and a data set cache of the module's own (for the CLI's processes too). One torch thread
    here and in them: a tiny model gains nothing from two, and on 2 cores busy with other tests two
    threads ran the windows 8x slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as env:
        cache = str(tmp_path_factory.mktemp("hf-cache"))
        for name, value in {**OFFLINE, "HF_DATASETS_CACHE": cache, "OMP_NUM_THREADS": "1"}.items():
            env.setenv(name, value)
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run_dir(corpus, runs_root) -> Path:
    summary = train_json(
        *TINY,
        f"model.max_seq_len={CONTEXT}",
        "train.max_steps=4",
        "train.eval_interval=4",
        "train.eval_batches=2",
        "checkpoint.interval=4",
        "checkpoint.keep=1",
        f"data.sources=[{corpus}]",
        f"run.dir={runs_root}",
        "run.name=eval-tiny",
    )
    return Path(summary["run_dir"])


@pytest.fixture(scope="module")
def task_dir(corpus, tmp_path_factory) -> Path:
    """A local multiple-choice task of 30 items: a line's first half, then its own second half among
    three others'."""
    folder = tmp_path_factory.mktemp("tasks")
    lines = [line.strip() for line in corpus.read_text().splitlines() if 30 < len(line.strip()) < 70]
    halves = []
    for line in random.Random(0).sample(lines, 60):
        cut = line.rfind(" ", 0, len(line) // 2)
        halves.append((line[:cut], line[cut:]))
    rng, rows = random.Random(1), []
    for i, (context, ending) in enumerate(halves[:30]):
        choices = [ending] + [halves[30 + (i + k) % 30][1] for k in range(3)]
        rng.shuffle(choices)
        rows.append({"context": context, "choices": choices, "answer": choices.index(ending)})
    (folder / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "eval_mc.yaml").write_text(
        "task: eval_mc\ndataset_path: json\ntest_split: test\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n'
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


@pytest.fixture(scope="module")
def cli_report(run_dir, task_dir) -> dict:
    """`phalanx eval RUN_DIR --tasks eval_mc --include-path DIR --json`, once for the module."""
    proc = phalanx(
        "eval", str(run_dir), "--tasks", "eval_mc", "--include-path", str(task_dir), "--batch-size", "8", "--json"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- tasks through the harness ------------------------------------------------------------------------


def test_tasks_report_names_the_step_and_is_saved_in_the_run(cli_report, run_dir):
    assert cli_report["kind"] == "tasks" and cli_report["step"] == 4 and cli_report["samples"] == {"eval_mc": 30}
    assert cli_report["model"] == str(run_dir / "checkpoints" / "step_00000004")
    metrics = cli_report["tasks"]["eval_mc"]
    assert set(metrics) == {"acc", "acc_norm"}
    for value in metrics.values():
        assert 0 <= value["value"] <= 1 and value["stderr"] > 0
        assert value["value"] * 30 == pytest.approx(round(value["value"] * 30))  # a count of 30 items
    saved = Path(cli_report["saved"])
    assert saved.parent == run_dir / "eval" and saved.name.startswith("step_00000004-")
    assert json.loads(saved.read_text()) == {k: v for k, v in cli_report.items() if k != "saved"}
    assert not list(saved.parent.glob(".*.tmp"))  # written through a temporary file, renamed into place


def test_the_table_lists_task_metric_value_and_stderr(cli_report):
    from rich.console import Console

    from phalanx.eval import report

    console = Console(record=True, width=100)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "out", console)
        report.print_tasks_table(cli_report)
    table = console.export_text()
    assert "eval-tiny, step 4" in table and all(word in table for word in ("task", "metric", "value", "stderr"))
    acc = cli_report["tasks"]["eval_mc"]["acc"]
    assert ["eval_mc", "acc", f"{acc['value']:.4f}", f"{acc['stderr']:.4f}"] in [
        line.split() for line in table.splitlines()
    ]


@pytest.mark.slow
def test_accuracy_and_scores_agree_with_the_harness_hf_model(cli_report, run_dir, task_dir, tmp_path):
    """The harness's own `hf` model (transformers) on the HF export of the same checkpoint: the same
    log-likelihood for every choice (within 1e-4), so the same accuracy, in the command's report too."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from phalanx.eval.harness import evaluate_tasks
    from phalanx.export.hf import write_hf_export
    from phalanx.run.model_loader import load_model

    def per_choice(results) -> list[list[float]]:
        samples = sorted(results["samples"]["eval_mc"], key=lambda s: s["doc_id"])
        return [[resp[0][0] for resp in s["resps"]] for s in samples]

    ours, _ = evaluate_tasks(run_dir, ["eval_mc"], batch_size=8, include_path=task_dir, log_samples=True)
    (tmp_path / "hf").mkdir()
    write_hf_export(load_model(run_dir), tmp_path / "hf")
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},dtype=float32,device=cpu",
        tasks=["eval_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        batch_size=4,
        log_samples=True,
    )
    worst = max(abs(a - b) for x, y in zip(per_choice(ours), per_choice(theirs)) for a, b in zip(x, y))
    assert len(per_choice(ours)) == 30 and worst < 1e-4, f"log-likelihoods differ by up to {worst}"
    for metric in ("acc", "acc_norm"):
        want = theirs["results"]["eval_mc"][f"{metric},none"]
        assert ours["results"]["eval_mc"][f"{metric},none"] == want
        assert cli_report["tasks"]["eval_mc"][metric]["value"] == want


# ---- bits per byte --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(run_dir):
    """The run's model and tokenizer in this process, and the ids the command scores: BOS, then the text."""
    from phalanx.run.model_loader import load_model

    loaded = load_model(run_dir)

    def ids_of(text: str) -> list[int]:
        return [loaded.specials.bos_id, *loaded.tokenizer.encode(text, add_special_tokens=False).ids]

    return loaded.model, ids_of


def held_out(corpus: Path, size: int) -> str:
    text = corpus.read_text()[100_000 : 100_000 + size]
    return text + " — fin, café."  # characters of several UTF-8 bytes: bytes, not characters, count


def eval_text(run_dir: Path, text_file: Path, *options: str) -> dict:
    proc = phalanx("eval", str(run_dir), "--text", str(text_file), "--json", *options)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bits_per_byte_of_a_text_within_the_context_is_one_forward_pass(run_dir, corpus, reference, tmp_path):
    model, ids_of = reference
    text = held_out(corpus, 120)
    ids = ids_of(text)
    assert len(ids) <= CONTEXT
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)
    nll = -sum(float(logprobs[i, t]) for i, t in enumerate(ids[1:]))
    (tmp_path / "short.txt").write_text(text)

    got = eval_text(run_dir, tmp_path / "short.txt")["text"]
    n_bytes = len(text.encode("utf-8"))
    assert (got["tokens"], got["bytes"]) == (len(ids) - 1, n_bytes) and n_bytes > len(text)
    assert got["bits_per_byte"] == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-5)


def test_a_longer_text_is_scored_in_sliding_windows(run_dir, corpus, reference, tmp_path):
    """Stride 1: every token given exactly the CONTEXT tokens before it (fewer at the start), which the
    test computes in two forwards of its own; the default stride (half the window) gives each token at least half
    the window, so it lies close to that."""
    from phalanx.errors import PhalanxError
    from phalanx.eval.bits_per_byte import score_ids

    model, ids_of = reference
    text = held_out(corpus, 300)
    ids = ids_of(text)
    assert len(ids) > 1.5 * CONTEXT  # three windows at the default stride
    with torch.no_grad():
        # Token i given ids[max(0, i - CONTEXT) : i]: for i <= CONTEXT a prefix of the first CONTEXT ids,
        # which one causal forward over them scores; beyond, a window of its own ending at i - 1.
        first = torch.log_softmax(model(torch.tensor([ids[:CONTEXT]])).float()[0], dim=-1)
        windows = torch.tensor([ids[i - CONTEXT : i] for i in range(CONTEXT + 1, len(ids))])
        rest = torch.log_softmax(model(windows).float()[:, -1], dim=-1)
    nll = -sum(float(first[i - 1, ids[i]]) for i in range(1, CONTEXT + 1))
    nll -= sum(float(rest[k, ids[CONTEXT + 1 + k]]) for k in range(len(rest)))
    n_bytes = len(text.encode("utf-8"))
    assert score_ids(model, ids, CONTEXT, stride=1) == pytest.approx(nll, rel=1e-5)
    with pytest.raises(PhalanxError, match="--stride must be between 1 and the context"):
        score_ids(model, ids, CONTEXT, stride=CONTEXT + 1)

    (tmp_path / "long.txt").write_text(text)
    half = eval_text(run_dir, tmp_path / "long.txt")
    assert (half["text"]["context"], half["text"]["stride"], half["step"]) == (CONTEXT, CONTEXT // 2, 4)
    assert half["text"]["tokens"] == len(ids) - 1 and half["text"]["bytes"] == n_bytes
    assert half["text"]["bits_per_byte"] == pytest.approx(nll / math.log(2) / n_bytes, rel=0.02)
    assert Path(half["saved"]).is_file()


# ---- bad input: one line, exit 2 -------------------------------------------------------------------------


def one_line_error(proc: subprocess.CompletedProcess, says: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["RUN", "--tasks", "eval_mcc", "--include-path", "TASKS"], "unknown task 'eval_mcc'"),
        (["RUN", "--tasks", "broken", "--include-path", "BROKEN"], "does not parse"),
        (["RUN", "--tasks", "eval_mc", "--include-path", "MISSING_DATA"], "task 'eval_mc' could not be loaded"),
        (["MISSING", "--tasks", "eval_mc"], "does not exist"),
        (["RUN", "--text", "MISSING"], "--text"),
        (["RUN"], "give either --tasks"),
    ],
    ids=["unknown-task", "task-file-not-yaml", "task-data-missing", "no-run", "no-text", "neither"],
)
def test_bad_input_is_one_line_and_exit_2(run_dir, task_dir, tmp_path, args, says):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "broken.yaml").write_text("task: broken\ndataset_path: [json\n")
    missing_data = tmp_path / "missing-data"
    missing_data.mkdir()
    (missing_data / "eval_mc.yaml").write_text(
        (task_dir / "eval_mc.yaml").read_text().replace(str(task_dir / "mc.jsonl"), str(tmp_path / "nope.jsonl"))
    )
    (tmp_path / "text.txt").write_text("To be, or not to be.")
    paths = {
        "RUN": run_dir,
        "TASKS": task_dir,
        "BROKEN": broken,
        "MISSING_DATA": missing_data,
        "MISSING": tmp_path / "missing",
        "TEXT": tmp_path / "text.txt",
    }
    one_line_error(phalanx("eval", *(str(paths.get(a, a)) for a in args), check=False), says)


def test_without_the_eval_extra_the_command_says_which_to_install(run_dir, tmp_path):
    """As if lm-eval were not installed: sys.modules holds None for it, so its import fails."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['lm_eval'] = None\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "eval", str(run_dir), "--tasks", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    one_line_error(proc, "phalanx eval --tasks needs phalanx's eval extra (lm_eval is not installed)")
    assert "pip install 'phalanx[eval]'" in proc.stderr
