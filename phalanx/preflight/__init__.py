"""Cluster preflight: check every node and rank before a job starts (issue 6).

run.run_preflight launches worker.py on every rank through the training launcher; the ranks measure
(inventory.py, health.py, compute.py, collectives.py, bisection.py), evaluate.py grades the figures
against thresholds.py, and report.py holds the verdict.
"""
