"""Which node-agent exits a scheduler should run again, read from the one exit-code table.

phalanx/errors.py EXIT_CODES says, for each code, whether a scheduler should requeue the job. The Slurm
script and the Kubernetes Job policy are generated from it, so a code added or changed there changes what
every scheduler does, with no second table to forget.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.errors import EXIT_CODES

SIGNALLED = "128 + N"  # the table's row for an exit by signal N
MAX_SIGNAL = 64  # the highest signal number Linux delivers (SIGRTMAX)


@dataclass(frozen=True)
class ExitPolicy:
    requeue: tuple[int, ...]  # failures that are run again (a transient cause: a lost node, the store)
    never: tuple[int, ...]  # failures that running again cannot fix (bad input, a crash loop, a bad node)
    requeue_signalled: bool  # whether an exit by a signal (128 + N) is run again

    def should_requeue(self, code: int) -> bool:
        if code in self.requeue:
            return True
        if code in self.never or code == 0:
            return False
        return self.requeue_signalled and 128 < code <= 128 + MAX_SIGNAL

    def signal_codes(self) -> tuple[int, ...]:
        return tuple(range(129, 129 + MAX_SIGNAL)) if self.requeue_signalled else ()


def exit_policy() -> ExitPolicy:
    requeue, never, signalled = [], [], False
    for row in EXIT_CODES:
        if row.code == SIGNALLED:
            signalled = row.requeue
        elif row.code.isdigit():
            if row.code != "0":
                (requeue if row.requeue else never).append(int(row.code))
        else:  # a row of a form this reader does not know: a scheduler would silently get it wrong
            raise ValueError(f"phalanx.errors.EXIT_CODES: cannot read exit code {row.code!r}")
    return ExitPolicy(tuple(requeue), tuple(never), signalled)
