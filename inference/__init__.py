"""The batch-1 decode engine, its worker and its benchmark.

What the web process shares with the worker (events, the job protocol, names, logs) lives in `common/`,
which imports no torch; this package is the worker's side.
"""
