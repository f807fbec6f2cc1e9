"""`phalanx export`: load a run (or a checkpoint, or an HF export) and write it as HF or GGUF, atomically."""

from __future__ import annotations

from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.export.out_dir import atomic_out_dir, check_out_dir

FORMATS = ("hf", "gguf")
DTYPES = ("f32", "f16", "bf16")
# GGUF also writes llama.cpp's block-quantised types (gguf_export.py), largest first.
QUANTISED = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
GGUF_DTYPES = (*DTYPES, *QUANTISED)


def export_run(source: Path, fmt: str, out: Path, dtype: str = "f32", force: bool = False) -> list[Path]:
    """Write `source` in `fmt` to the directory `out`; returns the files in it."""
    if fmt not in FORMATS:
        raise PhalanxError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    allowed = GGUF_DTYPES if fmt == "gguf" else DTYPES
    if dtype not in allowed:
        extra = " (the quantised types are for --format gguf)" if dtype in GGUF_DTYPES else ""
        raise PhalanxError(f"unknown --dtype {dtype!r} for --format {fmt}; choose one of {', '.join(allowed)}{extra}")
    source, out = Path(source), Path(out).absolute()
    if not source.is_dir():
        raise PhalanxError(f"run directory not found: {source}")
    if out == source.absolute() or source.absolute() in out.parents:
        raise PhalanxError(f"--out {out} is inside {source}; write the export elsewhere")
    check_out_dir(out, force)  # before the (slow) load

    from phalanx.run.model_loader import load_model

    loaded = load_model(source)
    with atomic_out_dir(out, force) as tmp:
        if fmt == "hf":
            from phalanx.export.hf import write_hf_export

            write_hf_export(loaded, tmp, dtype)
        else:
            from phalanx.export.gguf_export import write_gguf
            from phalanx.export.modelfile import modelfile
            from phalanx.run.gguf_format import GGUF_FILE

            write_gguf(loaded, tmp / GGUF_FILE, loaded.name, dtype)
            (tmp / "Modelfile").write_text(modelfile(GGUF_FILE, loaded.chat_template))
    return sorted(out.iterdir())
