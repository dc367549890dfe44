"""Dataset loaders for the built-in tasks, named in their YAML as ``!function hfa_builtin.builtin_dataset`` (the
``hfa_stdlib*`` tasks), ``!function hfa_builtin.long_dataset`` (``hfa_kjv_books``, ``hfa_stdlib_32k``) and
``!function hfa_builtin.passkey_dataset`` (``hfa_passkey_*``, with its metrics' functions).

lm-eval imports this file by path (from the YAML's folder). The documents are built in memory from this
Python's standard library sources, so the tasks need no data file, no absolute path and no network.
"""

from hf_attnscale.integrations.lm_eval_tasks_data import (
    PositionPerplexityTask,
    builtin_dataset,
    long_dataset,
    mean_present,
    passkey_dataset,
    passkey_results,
)

__all__ = [
    "PositionPerplexityTask",
    "builtin_dataset",
    "long_dataset",
    "mean_present",
    "passkey_dataset",
    "passkey_results",
]
