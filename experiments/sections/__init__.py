"""The sections of ``experiments/evidence.py``, one module each.

A section's ``run(runs, out)`` reads the finished runs it needs under ``runs`` (raising `MissingRuns` when there
is none), writes ``<out>/<section>.json`` and ``.png`` and returns its Markdown table. Its computing functions
return plain data, and its ``plot_*`` function draws the figure from that data.
"""
