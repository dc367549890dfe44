"""Run transformers' own modeling tests on models patched at construction, and compare with an unpatched run.

Needs a checkout of transformers' ``tests/`` at the installed release (nothing is fetched at run time):

    git clone --depth 1 --branch v$(python -c "import transformers; print(transformers.__version__)") \\
        https://github.com/huggingface/transformers /path/to/transformers
    pip install parameterized pytest-timeout    # what transformers' tests import beside the library
    python tests/transformers_suite/run.py --transformers /path/to/transformers --out report.md

For each family and mode (`plugin.MODES`) it runs ``tests/models/<family>/test_modeling_<family>.py`` in a
fresh pytest process with `plugin.py` loaded, reads the JUnit XML, and writes a table: passed / failed /
skipped per mode, and every test that passes unpatched but not patched (fails, is skipped or is missing),
with its reason from `REASONS` (or "unexplained", the first line of its error, when none matches). It exits 1
when any is unexplained.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "bert", "roberta", "modernbert"]
MODES = ["unpatched", "identity", "logn"]

REASONS: dict[str, str] = {}
"""Test-name patterns (regular expressions) of known only-patched failures, and why each is accepted."""


def run_family(tests_root: Path, family: str, mode: str, extra: list[str]) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, first line of the message)}`` of one family's modeling tests in one mode."""
    test_file = tests_root / "tests" / "models" / family / f"test_modeling_{family}.py"
    if not test_file.exists():
        raise SystemExit(f"{test_file} not found: --transformers must be a checkout of transformers' repo.")
    with tempfile.TemporaryDirectory() as tmp:
        junit, counts = Path(tmp) / "junit.xml", Path(tmp) / "counts.json"
        env = {
            **os.environ,
            "HFA_SUITE_MODE": mode,
            "HFA_SUITE_COUNTS": str(counts),
            "HF_HUB_OFFLINE": "1",  # a test that wants the Hub fails at once instead of waiting on the network
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        }
        command = [
            sys.executable, "-m", "pytest", str(test_file), "-p", "plugin", "-q", "-p", "no:cacheprovider",
            f"--junitxml={junit}", "-o", "junit_family=xunit1", *extra,
        ]  # fmt: skip
        subprocess.run(command, cwd=tests_root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not junit.exists():
            raise SystemExit(
                f"pytest wrote no report for {family} ({mode}); run it by hand: {' '.join(command)}"
            )
        results = {}
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, message = "failed", (child.get("message") or child.text or "").strip()
                elif child.tag == "skipped":
                    outcome = "skipped"
            results[name] = (outcome, message.splitlines()[0][:160] if message else "")
        patched = json.loads(counts.read_text()) if counts.exists() else {}
        results["__models__"] = (json.dumps(patched), "")
        return results


def reason_for(test: str) -> str | None:
    return next((why for pattern, why in REASONS.items() if re.search(pattern, test)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--transformers", type=Path, required=True, help="checkout of transformers' repo")
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--out", type=Path, default=Path("transformers_suite_report.md"))
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = parser.parse_args(argv)
    modes = ["unpatched", *[m for m in args.modes if m != "unpatched"]]
    lines = [
        "| family | mode | passed | failed | skipped | models patched | passed unpatched, not patched |",
        "|---|---|---|---|---|---|---|",
    ]
    details, failures, unexplained = [], [], 0
    for family in args.families:
        baseline = None
        for mode in modes:
            start = time.perf_counter()
            results = run_family(args.transformers, family, mode, args.pytest_args)
            models = json.loads(results.pop("__models__")[0])
            tally = {
                o: sum(1 for r, _ in results.values() if r == o) for o in ("passed", "failed", "skipped")
            }
            baseline = baseline or results
            # A test that passes unpatched must pass patched: failing, skipping or vanishing all count.
            regressions = sorted(
                t for t, (o, _) in baseline.items() if o == "passed" and results.get(t, ("",))[0] != "passed"
            )
            for test in regressions:
                outcome, message = results.get(test, ("missing", ""))
                why = reason_for(test) or f"unexplained: {message}"
                unexplained += why.startswith("unexplained")
                details.append(f"| {family} | {mode} | `{test}` ({outcome}) | {why} |")
            failures += [
                f"| {family} | {mode} | `{t}` | {m} |"
                for t, (o, m) in sorted(results.items())
                if o == "failed"
            ]
            lines.append(
                f"| {family} | {mode} | {tally['passed']} | {tally['failed']} | {tally['skipped']} | "
                f"{models.get('patched', '-')} | {len(regressions)} |"
            )
            print(lines[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    report = "\n".join(lines)
    if details:
        report += (
            "\n\n| family | mode | test that passes unpatched, not patched | reason |\n|---|---|---|---|\n"
        )
        report += "\n".join(details)
    if failures:  # every failure, in any mode (unpatched too): flaky tests show here
        report += "\n\n| family | mode | failed test | message |\n|---|---|---|---|\n" + "\n".join(failures)
    args.out.write_text(report + "\n")
    print(f"\n{report}\n\nwritten to {args.out}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
