"""A local multiple-choice task for lm-evaluation-harness, made from the test corpus (`dataset_path: json`),
so that tests run the harness offline: a line's first half, then its own second half among three others'."""

from __future__ import annotations

import json
import random
from pathlib import Path

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_mc_task(folder: Path, corpus: Path, name: str = "eval_mc", items: int = 30) -> Path:
    """`folder` with NAME.yaml and its data: `items` questions of four choices; the folder returned."""
    lines = [line.strip() for line in corpus.read_text().splitlines() if 30 < len(line.strip()) < 70]
    halves = []
    for line in random.Random(0).sample(lines, 2 * items):
        cut = line.rfind(" ", 0, len(line) // 2)
        halves.append((line[:cut], line[cut:]))
    rng, rows = random.Random(1), []
    for i, (context, ending) in enumerate(halves[:items]):
        choices = [ending] + [halves[items + (i + k) % items][1] for k in range(3)]
        rng.shuffle(choices)
        rows.append({"context": context, "choices": choices, "answer": choices.index(ending)})
    (folder / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ntest_split: test\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n'
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder
