"""Building RULER's samples (issue 84): lm-eval's six synthetic tasks at ``--length`` tokens of a tokenizer, drawn
once into an empty cache and then read back from it, through `hf_attnscale.integrations.lm_eval_ruler.cached_samples`
(what a ``hf-attnscale lm-eval`` run calls):

    python benchmarks/bench_ruler_samples.py --length 32768 --tokenizer smollm2-135m

One process: lm-eval's RULER modules are imported once (reported apart: it costs the same with or without the
cache), then for each task its 500 samples are drawn (a miss) and read again (a hit), wall time. The cache goes to
a temporary folder, removed after.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from hf_attnscale.checkpoints.models import resolve_model_path
from hf_attnscale.integrations import lm_eval_ruler

GENERATORS = {
    "niah_single_1": ("niah_utils", "niah_single_1"),
    "niah_multikey_2": ("niah_utils", "niah_multikey_2"),
    "niah_multikey_3": ("niah_utils", "niah_multikey_3"),
    "ruler_vt": ("vt_utils", "get_vt_dataset"),
    "ruler_cwe": ("cwe_utils", "get_cw_dataset"),
    "ruler_fwe": ("fwe_utils", "fwe_download"),
}
"""Each synthetic task's ``custom_dataset`` in lm-eval's ``lm_eval/tasks/ruler/`` (its YAML's ``!function``)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument(
        "--tokenizer", default="smollm2-135m", help="a name the model type takes, a folder or a Hub id"
    )
    parser.add_argument("--tasks", nargs="*", default=list(GENERATORS), choices=list(GENERATORS))
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    assert list(GENERATORS) == list(lm_eval_ruler.SYNTHETIC)

    started = time.perf_counter()
    import importlib

    modules = {
        name: importlib.import_module(f"lm_eval.tasks.ruler.{name}")
        for name in {m for m, _ in GENERATORS.values()}
    }
    imported = time.perf_counter() - started
    print(f"lm-eval's RULER modules imported in {imported:.1f} s", flush=True)
    metadata = {"tokenizer": resolve_model_path(args.tokenizer), "max_seq_lengths": [args.length]}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for task in args.tasks:
            module, function = GENERATORS[task]
            generate = getattr(modules[module], function)
            times = []
            for _ in ("miss", "hit"):
                started = time.perf_counter()
                samples = lm_eval_ruler.cached_samples(task, generate, metadata, Path(root))["test"]
                times.append(time.perf_counter() - started)
            rows.append({"task": task, "samples": len(samples), "drawn_s": times[0], "read_s": times[1]})
            print(
                f"{task}: {len(samples)} samples drawn in {times[0]:.1f} s, read back in {times[1]:.2f} s",
                flush=True,
            )
    report = {
        "length": args.length,
        "tokenizer": args.tokenizer,
        "import_s": imported,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }
    print(
        f"all six drawn in {sum(r['drawn_s'] for r in rows):.0f} s, read in {sum(r['read_s'] for r in rows):.1f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
