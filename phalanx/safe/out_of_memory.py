"""A rank that ran out of memory: telling it from other crashes, and reading what it asked for.

The rank (phalanx/train/worker.py) recognises the allocator's error, records it in torch elastic's error
file for its node agent and exits with RankOutOfMemoryError's code; the agent (phalanx/safe/agent.py)
reads the message back to name the rank, the size and the device in one line, and decides whether a
restart can help. The messages are torch's own:

  CPU:        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes. ..."
  CUDA, HIP:  "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of ..."
              (older torch: "... Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; ...")
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

_CPU_BYTES = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
_GPU_SIZE = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB|PiB)")
_GPU_INDEX = re.compile(r"\bGPU (\d+)\b")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocator's refusal (torch.OutOfMemoryError is a RuntimeError too)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


@dataclass(frozen=True)
class AllocationFailure:
    nbytes: int | None  # what the failed allocation asked for, when the message says
    device: str | None  # "CPU", "GPU 0", "GPU" (no index said)

    def describe(self) -> str:
        size = f"tried to allocate {human_bytes(self.nbytes)}" if self.nbytes is not None else "size not reported"
        if self.device is None:
            return size
        return f"{size} on {'the ' if self.device in ('CPU', 'GPU') else ''}{self.device}"


def allocation_failure(message: str) -> AllocationFailure:
    """The size and device an allocator's error message names (None for what it does not say)."""
    if match := _CPU_BYTES.search(message):
        return AllocationFailure(int(match.group(1)), "CPU")
    if match := _GPU_SIZE.search(message):
        nbytes = round(float(match.group(1)) * 1024 ** _UNITS.index(match.group(2)))
        gpu = _GPU_INDEX.search(message)
        return AllocationFailure(nbytes, f"GPU {gpu.group(1)}" if gpu else "GPU")
    return AllocationFailure(None, None)


def read_error_file(path: str | Path | None) -> str:
    """The exception message a rank recorded in torch elastic's error file; "" when there is none."""
    try:
        return str(json.loads(Path(path).read_text())["message"]["message"])
    except (OSError, TypeError, ValueError, KeyError):
        return ""


def human_bytes(nbytes: int) -> str:
    size, unit = float(nbytes), 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{size:.0f} B" if unit == 0 else f"{size:.1f} {_UNITS[unit]}"
