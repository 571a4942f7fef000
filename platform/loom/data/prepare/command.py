"""The `loom data` verbs behind the CLI's parser (kept here so the CLI stays a dispatcher)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loom.data.prepare.pieces import DEFAULT_MAX_DOC_MB
from loom.data.prepare.run import check_out, finished, prepare
from loom.data.prepare.show import inspect_text
from loom.data.prepare.units import units_for_inputs
from loom.errors import EXIT_INTERRUPTED, EXIT_OK, ConfigError


def prepare_command(args: argparse.Namespace) -> int:
    """`loom data prepare INPUT... --out DIR`: refuse bad input before any work, then prepare."""
    if args.shard_mb is not None and args.shard_mb <= 0:
        raise ConfigError(f"Invalid usage: --shard-mb {args.shard_mb}: must be positive (MB of input per shard).")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"Invalid usage: --workers {args.workers}: must be at least 1.")
    max_doc_mb = DEFAULT_MAX_DOC_MB if args.max_doc_mb is None else args.max_doc_mb
    if max_doc_mb <= 0:
        raise ConfigError(f"Invalid usage: --max-doc-mb {args.max_doc_mb}: must be positive (M characters).")
    out = Path(args.out).expanduser()
    check_out(out)
    t0 = time.monotonic()
    shard_bytes = None if args.shard_mb is None else int(args.shard_mb * (1 << 20))
    units = units_for_inputs(args.inputs, args.field, shard_bytes)
    try:
        sc = prepare(units, out, args.tokenizer, workers=args.workers, strict=args.strict, max_doc_mb=max_doc_mb)
    except KeyboardInterrupt:
        kept = sum(finished(out, i) is not None for i in range(len(units)))
        print(f"loom data prepare: stopped (Ctrl-C); {kept}/{len(units)} shards kept in {out}: run the same "
              "command again to resume from them", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    dt = time.monotonic() - t0
    mb = sum(u.bytes for u in units) / 1e6
    skipped = f"; skipped {sc['empty_skipped']:,} empty and {sc['not_utf8']:,} non-UTF-8 document(s)" \
        if sc["empty_skipped"] or sc["not_utf8"] else ""
    print(f"wrote {out}: {sc['documents']:,} documents, {sc['tokens']:,} tokens ({sc['dtype']}, "
          f"tokenizer {sc['tokenizer'] or 'none: bytes'}) in {len(sc['shards'])} shard(s), "
          f"{mb:,.1f} MB in {dt:.1f} s ({mb / max(dt, 1e-9):.1f} MB/s){skipped}")
    return EXIT_OK


def inspect_command(args: argparse.Namespace) -> int:
    print(inspect_text(args.path))
    return EXIT_OK
