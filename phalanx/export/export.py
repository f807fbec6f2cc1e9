"""`phalanx export`: load a run (or a checkpoint, or an HF export) and write it as HF or GGUF, atomically; or
write a LoRA run's adapters alone in peft's layout (peft_adapter.py)."""

from __future__ import annotations

from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.export.out_dir import atomic_out_dir, check_out_dir

FORMATS = ("hf", "gguf", "peft")
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

    if fmt == "peft":  # the adapters alone: the base is neither read nor merged
        from phalanx.export.hf import TORCH_DTYPES
        from phalanx.export.peft_adapter import write_peft_adapter
        from phalanx.run.model_loader import read_adapters

        adapters = read_adapters(source)
        with atomic_out_dir(out, force) as tmp:
            write_peft_adapter(adapters, tmp, TORCH_DTYPES[dtype])
        return sorted(out.iterdir())

    from phalanx.run.model_loader import load_model

    loaded = load_model(source)  # a LoRA run's: its adapters merged into the base
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
