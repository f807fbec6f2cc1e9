"""Entry point of one rank started by torch's elastic launcher: `python -m phalanx.train.worker CONFIG`.

The launching `phalanx train` has already validated the config, prepared the data and saved the
resolved config in the run directory; each rank only reads it.
"""

from __future__ import annotations

import sys

from phalanx.config.loader import load_config
from phalanx.errors import PhalanxError
from phalanx.train.trainer import attempt_number, train


def main(argv: list[str]) -> int:
    (config_path,) = argv
    try:
        train(load_config(config_path), attempt=attempt_number())
    except PhalanxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
