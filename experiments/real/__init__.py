"""The sections of ``experiments/real_models.py``: the articles' claims on real pretrained checkpoints.

A section's ``run(context)`` computes what it needs through ``context.cells`` (each expensive number is kept
on disk as soon as it is computed, so a stopped run continues where it stopped), writes
``<out>/<section>.json`` and ``.png`` and returns its Markdown table. Computing and plotting are apart: the
computing functions return plain data, and the ``plot_*`` functions draw a figure from it.
"""
