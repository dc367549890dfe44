"""What the built-in task YAMLs name as ``!function hfa_builtin.NAME``, from
`hf_attnscale.integrations.lm_eval_tasks_data`: the task classes (``PositionPerplexityTask`` for the ``hfa_stdlib*``,
``hfa_kjv_books`` and ``hfa_stdlib_32k`` tasks, ``PasskeyTask`` for ``hfa_passkey_*``; both a ``BuiltinTask``, where a
``--metadata`` key wins over the YAML's ``dataset_kwargs``), the dataset loaders (``builtin_dataset``,
``long_dataset``, ``passkey_dataset``) and the passkey metrics' functions.

lm-eval imports this file by path (from the YAML's folder). The documents are built in memory from this
Python's standard library sources, so the tasks need no data file, no absolute path and no network.
"""

from hf_attnscale.integrations.lm_eval_tasks_data import (
    BuiltinTask,
    PasskeyTask,
    PositionPerplexityTask,
    builtin_dataset,
    long_dataset,
    mean_present,
    passkey_dataset,
    passkey_results,
)

__all__ = [
    "BuiltinTask",
    "PasskeyTask",
    "PositionPerplexityTask",
    "builtin_dataset",
    "long_dataset",
    "mean_present",
    "passkey_dataset",
    "passkey_results",
]
