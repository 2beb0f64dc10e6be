"""``rootopt data``: prepare and verify WebDataset shards.

rootopt data prepare --corpus {stdlib,bbc,kjv,digits,bbc-classes,PATH} --out DIR
    [--tokenizer bytes|bpe:N|TOKENIZER.json] [--text-field text] [--seq_len 128] ...
rootopt data verify DIR
"""

from __future__ import annotations

import argparse
import sys
import time

from rootopt.data import (
    CLASS_CORPORA,
    TEXT_CORPORA,
    CorpusError,
    ShardError,
    ShardWriteError,
    load_manifest,
    prepare,
    verify_shard,
)
from rootopt.data.preparing import MAX_SEED

# The options that only text corpora take, and their defaults.
_TEXT_OPTIONS = {
    "--tokenizer": ("tokenizer", "bytes"),
    "--text-field": ("text_field", "text"),
    "--seq_len": ("seq_len", 128),
    "--max_bytes": ("max_bytes", 4_000_000),
}


def _text_only(args: argparse.Namespace) -> list[str]:
    """The text-corpus options given on the command line."""
    return [flag for flag, (dest, _) in _TEXT_OPTIONS.items() if getattr(args, dest) is not None]


def _defaults(args: argparse.Namespace) -> None:
    for dest, default in _TEXT_OPTIONS.values():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rootopt data", description="prepare and verify WebDataset shards"
    )
    sub = p.add_subparsers(dest="action", required=True)
    pp = sub.add_parser(
        "prepare", help="tokenize a corpus into train/val shards with a sha256 manifest"
    )
    pp.add_argument(
        "--corpus",
        required=True,
        help=f"{', '.join(TEXT_CORPORA)} (text), {', '.join(CLASS_CORPORA)} "
        "(classification), or a text file, a .jsonl file (one document per line) or a "
        "directory of them",
    )
    pp.add_argument(
        "--tokenizer",
        default=None,
        help="bytes (one id per byte; default), bpe:N (train a byte-level BPE of N ids on "
        "the corpus) or the path of a tokenizer.json",
    )
    pp.add_argument(
        "--text-field",
        "--text_field",
        dest="text_field",
        default=None,
        help="the field of a .jsonl line that holds the text (default: text)",
    )
    pp.add_argument("--out", required=True, help="output directory")
    pp.add_argument(
        "--seq_len",
        "--seq-len",
        dest="seq_len",
        type=int,
        default=None,
        help="tokens per sample (text corpora; default 128)",
    )
    pp.add_argument(
        "--max_bytes",
        "--max-bytes",
        dest="max_bytes",
        type=int,
        default=None,
        help="bytes of text to use (text corpora; default 4000000); 0 = all",
    )
    pp.add_argument(
        "--samples_per_shard",
        "--samples-per-shard",
        dest="samples_per_shard",
        type=int,
        default=2000,
    )
    pp.add_argument(
        "--val_fraction", "--val-fraction", dest="val_fraction", type=float, default=0.05
    )
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument(
        "--no-progress",
        "--no_progress",
        dest="progress",
        action="store_false",
        help="no progress bar (it is shown only when stderr is a terminal)",
    )
    pv = sub.add_parser("verify", help="check every shard against the manifest's sha256")
    pv.add_argument("dir")
    args = p.parse_args(argv)
    try:
        if args.action == "verify":
            manifest = load_manifest(args.dir)
            from pathlib import Path

            from rootopt.data.shards import verify_tokenizer

            verify_tokenizer(Path(args.dir), manifest)
            n = 0
            for split in manifest["splits"].values():
                for entry in split:
                    verify_shard(Path(args.dir), entry)
                    n += 1
            print(f"{n} shards OK")
            return 0
        given = _text_only(args)
        if args.corpus in CLASS_CORPORA and given:
            # feature vectors, not text: these would be ignored, so they are refused
            raise CorpusError(
                f"{given[0]}: {args.corpus} is a classification corpus (feature vectors, not "
                f"text) and takes no {given[0]}; leave it out"
            )
        _defaults(args)
        for name, value, lo, hi in (
            ("--seq_len", args.seq_len, 2, 1 << 20),
            ("--max_bytes", args.max_bytes, 0, 1 << 40),
            ("--samples_per_shard", args.samples_per_shard, 1, 1 << 30),
            ("--val_fraction", args.val_fraction, 0.0, 0.5),
            ("--seed", args.seed, 0, MAX_SEED),
        ):
            if not lo <= value <= hi:
                raise CorpusError(f"{name} must be in [{lo}, {hi}]; got {value}")
        t0 = time.perf_counter()
        manifest = prepare(
            args.corpus,
            args.out,
            seq_len=args.seq_len,
            max_bytes=args.max_bytes,
            samples_per_shard=args.samples_per_shard,
            val_fraction=args.val_fraction,
            seed=args.seed,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            progress=args.progress,
        )
    except ShardWriteError as exc:  # a full or read-only disk
        print(f"rootopt data: {exc}", file=sys.stderr)
        return 1
    except (CorpusError, ShardError) as exc:
        print(f"rootopt data: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # stdout's reader left (`| head`): rootopt.cli ends quietly
    except OSError as exc:
        where = exc.filename or (args.dir if args.action == "verify" else args.out)
        print(f"rootopt data: {exc.strerror or exc} ({where})", file=sys.stderr)
        return 1
    tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
    tok = ""
    if manifest["task"] == "lm":
        from rootopt.data.tokenizer import label, record_of

        tok = f" ({label(record_of(manifest))}, {manifest['tokens']} tokens)"
        if args.max_bytes and manifest["text_bytes"] >= args.max_bytes:
            tok += f" from its first {args.max_bytes} bytes (--max_bytes 0 reads all of it)"
    print(
        f"{manifest['task']} corpus {manifest['corpus']}{tok}: {sum(e['samples'] for e in tr)} train samples in "
        f"{len(tr)} shards, {sum(e['samples'] for e in va)} validation samples in {len(va)} shards "
        f"→ {args.out} ({time.perf_counter() - t0:.1f} s; checksums in manifest.json and SHA256SUMS)"
    )
    return 0
