"""Training the small models this project ships and experiments with (causal LMs and RoFormer MLMs).

Both trainers are resumable: they write ``checkpoint.pt`` (weights, optimizer, schedule and every random
state) every ``--save-every`` steps and continue from it when re-run with the same ``--out``, with the same
result as an uninterrupted run.
"""
