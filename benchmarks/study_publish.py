"""Publish the defaults study: the committed record in docs/study/ becomes every generated page.

1. With ``--import DIR``: the finished runs, timings and session entries of the study directory
   DIR (where ``rootopt bench study --out DIR`` runs) that docs/study/ lacks are appended to it.
2. ``rootopt bench study --out docs/study --finished-only`` renders the summary from the record
   alone (nothing is trained).
3. The summary becomes docs/study_results.json; its tables replace the generated block of
   docs/benchmarks-v2.md, v2's page (and v1's re-reading its own block of docs/benchmarks-v1.md, from
   docs/study_results_v1.json);
   its headline replaces the generated block of README.md; its plots go to docs/img/
   (study_lr.png, study_long.png, study_tail.png).

Only the generated blocks between their markers are rewritten; the rest of each page is kept
as it is, and a page without its markers stops the script before anything is written.

With ``--protocol v3`` the record is docs/study-v3/ (``--import DIR``: where ``rootopt bench
study --protocol v3 --out DIR`` runs), the summary docs/study_results_v3.json and the block
v3's of docs/benchmarks.md; README.md's block becomes v3's once every run its table reads has
finished (``rootopt_analysis.bench.study_v3_readme``), and keeps v2's until then.

Usage: python benchmarks/study_publish.py [--protocol v2|v3] [--import DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from rootopt._atomic import atomic_write
from rootopt_analysis.bench import study_report
from rootopt_analysis.commands.bench import main as bench_main

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ("study_lr.png", "study_long.png", "study_tail.png")


def _render(
    record: Path, results: Path, import_dir: Path | None, extra: list[str]
) -> dict[str, Any]:
    """``rootopt bench study --finished-only`` on ``record`` (after importing ``import_dir``);
    its summary, also written to ``results``."""
    argv = ["study", *extra, "--out", str(record), "--finished-only", "--no-progress"]
    if import_dir is not None:
        argv += ["--import", str(import_dir)]
    if bench_main(argv) != 0:
        raise SystemExit(f"study_publish: rootopt bench {' '.join(argv[:3])} failed")
    summary: dict[str, Any] = json.loads((record / "study.json").read_text(encoding="utf-8"))
    atomic_write(results, study_report.dump_summary(summary).encode())
    return summary


def readme_headline(root: Path, v2_summary: dict[str, Any]) -> str:
    """The README's results block: v3's once every run its table reads has finished
    (docs/study_results_v3.json), until then v2's."""
    from rootopt_analysis.bench import study_v3_readme

    v3_path = root / "docs" / "study_results_v3.json"
    if v3_path.is_file():
        v3 = json.loads(v3_path.read_text(encoding="utf-8"))
        if study_v3_readme.ready(v3):
            return study_v3_readme.headline(v3)
    return study_report.headline(v2_summary)


def publish(root: Path = ROOT, import_dir: Path | None = None) -> dict[str, object]:
    """Publish into the repository at ``root`` (its docs/ and README.md)."""
    record, results = root / "docs" / "study", root / "docs" / "study_results.json"
    page_path, readme_path, img = (
        root / "docs" / "benchmarks-v2.md",
        root / "README.md",
        root / "docs" / "img",
    )
    page, readme = page_path.read_text(encoding="utf-8"), readme_path.read_text(encoding="utf-8")
    # check both pages before the first byte is written
    for doc, begin, end, name in (
        (page, study_report.BEGIN, study_report.END, page_path.name),
        (readme, study_report.HEADLINE_BEGIN, study_report.HEADLINE_END, readme_path.name),
    ):
        if doc.count(begin) != 1 or doc.count(end) != 1:
            raise SystemExit(f"study_publish: {name} must hold its generated block's markers once")
    summary = _render(record, results, import_dir, [])
    block = study_report.markdown(summary)
    page = study_report.splice(page, block)
    atomic_write(page_path, page.encode())
    # v1's corrections, from v1's committed summary, on v1's own page
    v1_path = root / "docs" / "benchmarks-v1.md"
    v1_page = v1_path.read_text(encoding="utf-8") if v1_path.is_file() else ""
    if study_report.V1_BEGIN in v1_page:
        v1 = json.loads((root / "docs" / "study_results_v1.json").read_text(encoding="utf-8"))
        v1_page = study_report.splice(
            v1_page, study_report.v1_markdown(v1), study_report.V1_BEGIN, study_report.V1_END
        )
        atomic_write(v1_path, v1_page.encode())
    head = readme_headline(root, summary)
    atomic_write(
        readme_path,
        study_report.splice(
            readme, head, study_report.HEADLINE_BEGIN, study_report.HEADLINE_END
        ).encode(),
    )
    plots = []
    for name in PLOTS:
        if (record / name).is_file():
            shutil.copyfile(record / name, img / name)
            plots.append(name)
    return {"runs": summary["index"]["runs"], "complete": summary["complete"], "plots": plots}


def publish_v3(root: Path = ROOT, import_dir: Path | None = None) -> dict[str, object]:
    """v3's record into the repository at ``root``: docs/study-v3/, its summary and block."""
    from rootopt_analysis.bench import study_v3, study_v3_readme

    record, results = root / "docs" / "study-v3", root / "docs" / "study_results_v3.json"
    page_path, readme_path = root / "docs" / "benchmarks.md", root / "README.md"
    page, readme = page_path.read_text(encoding="utf-8"), readme_path.read_text(encoding="utf-8")
    # check both pages before the first byte is written
    for doc, begin, end, name in (
        (page, study_v3.BEGIN, study_v3.END, page_path.name),
        (readme, study_report.HEADLINE_BEGIN, study_report.HEADLINE_END, readme_path.name),
    ):
        if doc.count(begin) != 1 or doc.count(end) != 1:
            raise SystemExit(f"study_publish: {name} must hold its generated block's markers once")
    record.mkdir(exist_ok=True)
    earlier = ["--protocol", "v3", "--earlier", str(root / "docs" / "study")]
    summary = _render(record, results, import_dir, earlier)
    block = study_v3.markdown(summary)
    atomic_write(page_path, study_report.splice(page, block, study_v3.BEGIN, study_v3.END).encode())
    readme_ready = study_v3_readme.ready(summary)
    if readme_ready:  # until then the README keeps v2's block
        head = study_v3_readme.headline(summary)
        splice = study_report.splice(
            readme, head, study_report.HEADLINE_BEGIN, study_report.HEADLINE_END
        )
        atomic_write(readme_path, splice.encode())
    return {
        "runs": summary["index"]["runs"],
        "complete": summary["complete"],
        "readme": readme_ready,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protocol", choices=("v2", "v3"), default="v2")
    ap.add_argument("--import", dest="import_dir", default="", metavar="DIR")
    args = ap.parse_args()
    fn = publish_v3 if args.protocol == "v3" else publish
    got = fn(ROOT, Path(args.import_dir) if args.import_dir else None)
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
