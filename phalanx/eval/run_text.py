"""`phalanx eval --text`: bits per byte of a text file, by the model itself (not through the server:
a forward over whole windows needs no KV cache, no slots and no HTTP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phalanx.errors import PhalanxError
from phalanx.eval.bits_per_byte import read_text, score_text
from phalanx.eval.report import base_report


def evaluate_text(path: Path, text_file: Path, context: int | None, stride: int | None, device: str) -> dict[str, Any]:
    from phalanx.parallel.device import pick_device
    from phalanx.run.model_loader import load_model

    if device not in ("auto", "cpu", "cuda"):
        raise PhalanxError(f"--device must be auto|cpu|cuda, not {device!r}")
    if not Path(path).exists():  # before the text, so the model's problem is the one reported first
        raise PhalanxError(f"{path} does not exist: give a run directory, a checkpoint or an export")
    text = read_text(text_file)
    torch_device = pick_device(device)
    loaded = load_model(path, torch_device)  # float32, as training's loss is computed
    max_seq_len = loaded.model.args.max_seq_len
    if context is not None and context > max_seq_len:
        raise PhalanxError(f"--context {context} is longer than the model's max_seq_len {max_seq_len}")
    score = score_text(
        loaded.model, loaded.tokenizer, loaded.specials, text, context or max_seq_len, stride, torch_device
    )
    return {
        **base_report(loaded.checkpoint),
        "kind": "text",
        "text": {"file": str(Path(text_file).absolute()), **score.as_dict()},
    }
