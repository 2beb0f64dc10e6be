"""Publish the defaults study: the committed record in docs/study/ becomes every generated page.

1. With ``--import DIR``: the finished runs, timings and session entries of the study directory
   DIR (where ``rootopt bench study --out DIR`` runs) that docs/study/ lacks are appended to it.
2. ``rootopt bench study --out docs/study --finished-only`` renders the summary from the record
   alone (nothing is trained).
3. The summary becomes docs/study_results_v2.json; its tables replace the generated block of
   docs/benchmarks-v2.md, v2's page (and v1's re-reading its own block of
   docs/benchmarks-v1.md, from docs/study_results_v1.json); its plots go to docs/img/
   (study_lr.png, study_long.png, study_tail.png).

Only the generated blocks between their markers are rewritten; the rest of each page is kept
as it is, and a page without its markers stops the script before anything is written.

With ``--protocol v3`` the record is docs/study-v3/ (``--import DIR``: where ``rootopt bench
study --protocol v3 --out DIR`` runs), the summary docs/study_results.json (the current
protocol's; v2's moved to docs/study_results_v2.json) and the block
v3's of docs/benchmarks.md. The blocks outside a study's page (:data:`SHARED`: README.md's
results, docs/optimizer.md's threshold sentences) are v3's once every run each reads has
finished (``rootopt_analysis.bench.study_v3_pages``), v2's until then; both protocols write them.

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


# blocks outside a study's own page, written by whichever study is newest and has finished
# the runs the block reads: (page, begin marker, end marker)
SHARED = (
    ("README.md", study_report.HEADLINE_BEGIN, study_report.HEADLINE_END),
    ("docs/optimizer.md", study_report.THRESHOLD_BEGIN, study_report.THRESHOLD_END),
)


def _read_checked(root: Path, pages: list[tuple[str, str, str]]) -> dict[str, str]:
    """Each page's text, after checking that it holds its block's markers once (before the
    first byte of any page is written)."""
    texts = {}
    for rel, begin, end in pages:
        doc = (root / rel).read_text(encoding="utf-8")
        if doc.count(begin) != 1 or doc.count(end) != 1:
            raise SystemExit(
                f"study_publish: {Path(rel).name} must hold its generated block's markers once"
            )
        texts[rel] = doc
    return texts


def _json(path: Path) -> dict[str, Any] | None:
    """A committed summary, None where there is none; one line naming a file that is not one."""
    if not path.is_file():
        return None
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # also a file that is not UTF-8
        raise SystemExit(f"study_publish: {path.name} is not a study summary ({exc})") from None
    if not isinstance(got, dict):
        raise SystemExit(f"study_publish: {path.name} is not a study summary (not an object)")
    return got


def shared_sources(
    v2: dict[str, Any], v3: dict[str, Any] | None
) -> tuple[dict[str, str], dict[str, str]]:
    """The README's results block and docs/optimizer.md's threshold sentences: v3's where
    every run the block reads has finished, v2's until then; and which study wrote each."""
    from rootopt_analysis.bench import study_v3_pages

    v3_ready = v3 is not None and study_v3_pages.ready(v3)
    head = study_v3_pages.headline(v3) if v3 is not None and v3_ready else study_report.headline(v2)
    v3_text = study_v3_pages.threshold_sentences(v3) if v3 is not None else None
    text = v3_text or (
        study_report.threshold_sentences(v2)
        or "The defaults study has not measured what the threshold does yet."
    )
    wrapped = "\n".join(study_report._wrap(text))
    threshold = f"{study_report.THRESHOLD_BEGIN}\n{wrapped}\n{study_report.THRESHOLD_END}\n"
    blocks = {"README.md": head, "docs/optimizer.md": threshold}
    return blocks, {"readme": "v3" if v3_ready else "v2", "threshold": "v3" if v3_text else "v2"}


def shared_blocks(v2: dict[str, Any], v3: dict[str, Any] | None) -> dict[str, str]:
    return shared_sources(v2, v3)[0]


def _write_shared(root: Path, texts: dict[str, str], v2: dict[str, Any], v3: Any) -> dict[str, str]:
    blocks, sources = shared_sources(v2, v3)
    for rel, begin, end in SHARED:
        atomic_write(root / rel, study_report.splice(texts[rel], blocks[rel], begin, end).encode())
    return sources


def publish(root: Path = ROOT, import_dir: Path | None = None) -> dict[str, object]:
    """Publish into the repository at ``root`` (its docs/ and README.md)."""
    record, results = root / "docs" / "study", root / "docs" / "study_results_v2.json"
    page_path, img = root / "docs" / "benchmarks-v2.md", root / "docs" / "img"
    page_rel = "docs/benchmarks-v2.md"
    texts = _read_checked(root, [(page_rel, study_report.BEGIN, study_report.END), *SHARED])
    summary = _render(record, results, import_dir, [])
    block = study_report.markdown(summary)
    atomic_write(page_path, study_report.splice(texts[page_rel], block).encode())
    # v1's corrections, from v1's committed summary, on v1's own page
    v1_path = root / "docs" / "benchmarks-v1.md"
    v1_page = v1_path.read_text(encoding="utf-8") if v1_path.is_file() else ""
    if study_report.V1_BEGIN in v1_page:
        v1 = json.loads((root / "docs" / "study_results_v1.json").read_text(encoding="utf-8"))
        v1_page = study_report.splice(
            v1_page, study_report.v1_markdown(v1), study_report.V1_BEGIN, study_report.V1_END
        )
        atomic_write(v1_path, v1_page.encode())
    _write_shared(root, texts, summary, _json(root / "docs" / "study_results.json"))
    plots = []
    for name in PLOTS:
        if (record / name).is_file():
            shutil.copyfile(record / name, img / name)
            plots.append(name)
    return {"runs": summary["index"]["runs"], "complete": summary["complete"], "plots": plots}


def publish_v3(root: Path = ROOT, import_dir: Path | None = None) -> dict[str, object]:
    """v3's record into the repository at ``root``: docs/study-v3/, its summary and block,
    and the shared blocks (v3's where their runs have finished, v2's from
    docs/study_results_v2.json until then)."""
    from rootopt_analysis.bench import study_v3

    record, results = root / "docs" / "study-v3", root / "docs" / "study_results.json"
    page_rel = "docs/benchmarks.md"
    v2 = _json(root / "docs" / "study_results_v2.json")
    if v2 is None:
        raise SystemExit("study_publish: docs/study_results_v2.json (v2's summary) is missing")
    texts = _read_checked(root, [(page_rel, study_v3.BEGIN, study_v3.END), *SHARED])
    record.mkdir(exist_ok=True)
    earlier = ["--protocol", "v3", "--earlier", str(root / "docs" / "study")]
    summary = _render(record, results, import_dir, earlier)
    block = study_v3.markdown(summary)
    page = study_report.splice(texts[page_rel], block, study_v3.BEGIN, study_v3.END)
    atomic_write(root / page_rel, page.encode())
    sources = _write_shared(root, texts, v2, summary)
    return {"runs": summary["index"]["runs"], "complete": summary["complete"], **sources}


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
