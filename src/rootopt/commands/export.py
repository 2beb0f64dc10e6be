"""``rootopt export RUN_DIR OUT_DIR``: a run's newest valid checkpoint as a Hugging Face
model directory (config.json, model.safetensors, tokenizer files, generation_config.json)
that ``transformers`` loads offline.

OUT_DIR must be missing or empty: an existing directory with files in it is refused and
nothing is written. See docs/models.md, "From your text to a Hugging Face model".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rootopt export", description=__doc__)
    p.add_argument("run_dir", help="a run directory written by rootopt train")
    p.add_argument("out_dir", help="the model directory to create (missing or empty)")
    args = p.parse_args(argv)
    from rootopt.train.tools.export import ExportError, ExportMismatch, export

    if not args.out_dir.strip():
        print("rootopt export: OUT_DIR is empty; name a directory", file=sys.stderr)
        return 2
    try:
        export(Path(args.run_dir), Path(args.out_dir))
    except ExportError as exc:
        print(f"rootopt export: {exc}", file=sys.stderr)
        return 2
    except ExportMismatch as exc:
        print(f"rootopt export: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        print(
            f"rootopt export: I/O error: {exc.strerror or exc}{where}; nothing was published",
            file=sys.stderr,
        )
        return 1
    return 0
