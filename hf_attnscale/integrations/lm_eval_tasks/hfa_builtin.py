"""Dataset loaders for the built-in tasks, named in their YAML as ``!function hfa_builtin.builtin_dataset`` (the
``hfa_stdlib*`` tasks) and ``!function hfa_builtin.long_dataset`` (``hfa_kjv_books``, ``hfa_stdlib_32k``).

lm-eval imports this file by path (from the YAML's folder). The documents are built in memory from this
Python's standard library sources, so the tasks need no data file, no absolute path and no network.
"""

from hf_attnscale.integrations.lm_eval_harness import builtin_dataset, long_dataset

__all__ = ["builtin_dataset", "long_dataset"]
