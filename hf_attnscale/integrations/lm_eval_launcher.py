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

import sys
from collections.abc import Sequence

from hf_attnscale.checkpoints.real import FetchError
from hf_attnscale.integrations.lm_eval_model import ModelArgsError, register
from hf_attnscale.integrations.lm_eval_tasks_data import TASKS_DIR


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's own CLI with ``argv`` (default: ``sys.argv[1:]``) after registering ``hf-attnscale``.

    Returns the exit status: 0, or 2 after a bad ``--model_args`` value for ``hf-attnscale`` (a
    `ModelArgsError`) or a real checkpoint that could not be fetched, each printed as one line on stderr
    (``hf-attnscale lm-eval: error: ...``). Anything else that fails inside lm-eval keeps its traceback;
    lm-eval's own usage errors exit through argparse (status 2).
    """
    from lm_eval.__main__ import cli_evaluate  # lm-eval's whole CLI: imported only when it runs

    register()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    elif "--help" not in argv and "-h" not in argv:
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
    try:
        cli_evaluate()
    except (ModelArgsError, FetchError) as err:
        print(f"hf-attnscale lm-eval: error: {err}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
