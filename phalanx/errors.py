"""The one exception type for bad user input: the CLI prints its message as one line and exits 2."""


class PhalanxError(Exception):
    """A problem the user can fix (bad config, missing file, incompatible checkpoint)."""

    exit_code = 2
