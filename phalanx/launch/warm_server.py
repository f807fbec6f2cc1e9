"""Imported by the warm ranks' fork server only (first in warm_ranks.PRELOAD), to make it deaf to SIGTERM.

A scheduler's preemption signal reaches every process of a job at once: Slurm's `scancel --signal=TERM`
(and `--signal=TERM@120` before a time limit) signals all of a job step's processes, the fork server
among them. Killed by it, the server would take its ranks down through their parent-death signal
before they could finish the step and save. So the server ignores SIGTERM (its ranks install their own
handler first thing, phalanx/safe/rank_guard.py); it goes when its agent does, or by SIGKILL from
warm_ranks.stop_server. SIGINT it ignores already (multiprocessing's own choice).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
