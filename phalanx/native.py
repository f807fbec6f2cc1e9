"""Building and loading the project's C++ op libraries (the serving decode kernel, CPU training attention).

torch's cpp_extension compiles a library's sources on first use (seconds to tens of seconds) and the .so
is kept in $XDG_CACHE_HOME/phalanx/<name> (~/.cache/phalanx by default), keyed by the sources, headers,
flags and torch version, so that every later process only loads it. Each build runs in a folder of its own,
so that a build killed halfway leaves no lock for the next process to wait on. Where no library can be
built (no compiler, one that refuses the flags, a cache that cannot be written) the caller's torch path
serves and a warning says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("phalanx")

AVX512_BF16_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]


def load_library(name: str, sources: list[Path], headers: list[Path], flags: list[str]) -> bool:
    """Build `name` (a TORCH_LIBRARY namespace, e.g. phalanx_decode_kernel) from `sources` once per content
    and keep it; load it into torch.ops. Returns whether it is loaded."""
    text = b"".join(path.read_bytes() for path in sources + headers)
    key = hashlib.sha256(text + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "phalanx" / name.removeprefix("phalanx_")
    kept = cache / f"{name}-{key}.so"
    try:
        if kept.exists():
            torch.ops.load_library(str(kept))
            return True
        from torch.utils import cpp_extension  # only to build: importing it takes about a second

        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as build:  # loads what it builds
            cpp_extension.load(
                name,
                [str(path) for path in sources],
                extra_cflags=flags,
                build_directory=build,
                is_python_module=False,
            )
            os.replace(Path(build) / f"{name}.so", kept)  # atomic: a racing build's copy is the same
    except Exception as e:
        log.warning("%s not built (%s): torch's own ops serve", name, str(e).splitlines()[0])
        return False
    return True
