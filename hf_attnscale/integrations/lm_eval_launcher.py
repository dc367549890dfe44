"""The ``hf-attnscale lm-eval`` launcher: lm-eval's own command line, with the ``hf-attnscale`` model type
registered and the package's task configs (`TASKS_DIR`) on its include path.

lm-eval's CLI cannot import plugins, so the launcher imports the model type
(`hf_attnscale.integrations.lm_eval_model`) before handing over to lm-eval's own CLI::

    hf-attnscale lm-eval --model hf-attnscale \\
        --model_args pretrained=PATH,scale=logn,train_length=4096,window=1020,sink_tokens=4 \\
        --tasks hfa_stdlib_heldout --device cuda
    # PATH: a folder, a Hub id, smollm2-135m / gemma3-270m (fetched on first use), or add gguf_file=NAME
    python -m hf_attnscale.integrations.lm_eval_launcher ...   # the same

Importing this module needs lm-eval (``pip install hf_attnscale[eval]``); ``import hf_attnscale`` does not.
"""

from __future__ import annotations

import contextlib
import difflib
import sys
from collections.abc import Iterator, Sequence

from hf_attnscale.checkpoints.real import FetchError
from hf_attnscale.integrations.lm_eval_model import MODEL_TYPE, ModelArgsError, register
from hf_attnscale.integrations.lm_eval_ruler import RulerError, offline_and_cached, prepare_run
from hf_attnscale.integrations.lm_eval_tasks_data import TASKS_DIR

HELP_PREFACE = (
    "hf-attnscale lm-eval: lm-eval's own command line (its help follows), with the model type "
    "`--model hf-attnscale` (`--model_args pretrained=NAME_OR_PATH,` then any patch option: "
    "rerope_window=2048,scale=logn,train_length=8192, or window=1020 to stream) and this package's tasks "
    "(hfa_stdlib_32k, hfa_kjv_books, hfa_kjv_64k, hfa_kjv_128k, hfa_passkey_4k ... hfa_passkey_128k, and more): "
    f"{TASKS_DIR / 'README.md'}\n"
)
"""What `main` prints before lm-eval's help: the part lm-eval's own help cannot say."""
TASKS_NOT_FOUND = "Tasks not found: "
"""How lm-eval's CLI begins its error for task names it does not know (a ValueError, ``Tasks not found: a, b``)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's own CLI with ``argv`` (default: ``sys.argv[1:]``) after registering ``hf-attnscale``.

    RULER's tasks run offline, their samples built once (`hf_attnscale.integrations.lm_eval_ruler`).

    Returns the exit status: 0, or 2 after a bad ``--model_args`` value for ``hf-attnscale`` (a
    `ModelArgsError`), a real checkpoint that could not be fetched, a RULER run that cannot start here
    (`RulerError`), or a task name lm-eval does not know (with the nearest names it knows, `unknown_tasks`),
    each printed as one line on stderr
    (``hf-attnscale lm-eval: error: ...``). Anything else that fails inside lm-eval keeps its traceback;
    lm-eval's own usage errors exit through argparse (status 2).
    """
    from lm_eval._cli import (
        HarnessCLI,
    )  # lm-eval's whole CLI (as its own cli_evaluate runs it): only when it runs
    from lm_eval.utils import setup_logging

    register()
    argv = list(sys.argv[1:] if argv is None else argv)
    users_path = any(a == "--include_path" or a.startswith("--include_path=") for a in argv)
    if not users_path:
        argv += ["--include_path", str(TASKS_DIR)]
    if "--help" in argv or "-h" in argv:
        print(HELP_PREFACE)
    elif users_path:
        # lm-eval takes one include path: the user's replaces ours.
        print(
            f"note: --include_path replaces hf_attnscale's own tasks ({TASKS_DIR}); copy them into your "
            "folder to use both.",
            file=sys.stderr,
        )
    # lm-eval 0.4's CLI has no entry that takes arguments: cli_evaluate() parses sys.argv (HarnessCLI.parse_args
    # takes none, and inserts "run" into sys.argv itself). So sys.argv is swapped for a list of our own, and
    # the caller's is put back however the run ends (an error, argparse's SystemExit, --help).
    saved, sys.argv = sys.argv, ["lm-eval", *argv]
    managers: list = []
    try:
        setup_logging()
        cli = HarnessCLI()
        args = cli.parse_args()
        ruler = args.command == "run" and prepare_run(args, MODEL_TYPE)
        with _task_managers_kept(managers), offline_and_cached() if ruler else contextlib.nullcontext():
            cli.execute(args)
    except (ModelArgsError, FetchError, RulerError) as err:
        print(f"hf-attnscale lm-eval: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        if not str(err).startswith(TASKS_NOT_FOUND):
            raise
        missing = str(err).removeprefix(TASKS_NOT_FOUND).split(", ")
        known = managers[-1].all_tasks if managers else []
        print(f"hf-attnscale lm-eval: error: {unknown_tasks(missing, known)}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


def unknown_tasks(missing: Sequence[str], known: Sequence[str]) -> str:
    """The one line for task names lm-eval does not know: each with the names nearest to it among ``known``
    (the tasks, groups and tags of lm-eval's task index, ours included), and where to find them all."""
    named = []
    for name in missing:
        close = [repr(near) for near in difflib.get_close_matches(name, known, n=3)]
        hint = f"{', '.join(close[:-1])} or {close[-1]}" if len(close) > 1 else "".join(close)
        named.append(f"{name!r} (did you mean {hint}?)" if close else repr(name))
    return (
        f"Unknown task{'s' if len(missing) > 1 else ''} {', '.join(named)}; `hf-attnscale lm-eval ls tasks` "
        "lists the tasks, groups and tags lm-eval knows."
    )


@contextlib.contextmanager
def _task_managers_kept(kept: list) -> Iterator[None]:
    """While lm-eval's CLI runs, keep each `TaskManager` it makes in ``kept``: after a misspelt task its index
    gives the nearest names, with no second indexing (15-20 s for lm-eval's own tasks). lm-eval's CLI imports
    the class from ``lm_eval.tasks`` when it runs, so a subclass that keeps its instances stands there
    meanwhile; without one kept, the error has no suggestion."""
    import lm_eval.tasks

    made = lm_eval.tasks.TaskManager

    class Kept(made):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            kept.append(self)

    Kept.__name__ = Kept.__qualname__ = made.__name__
    lm_eval.tasks.TaskManager = Kept
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = made


if __name__ == "__main__":
    sys.exit(main())
