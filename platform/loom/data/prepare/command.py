"""The `loom data` verbs behind the CLI's parser (kept here so the CLI stays a dispatcher)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loom.data.prepare.pieces import DEFAULT_MAX_DOC_MB
from loom.data.prepare.run import StoreOut, prepare
from loom.data.prepare.show import inspect_text
from loom.data.prepare.units import units_for_inputs
from loom.data.store.remote.location import is_remote
from loom.data.store.remote.settings import StorageSettings
from loom.data.store.remote.transport import StorageUnavailable
from loom.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, ConfigError


def storage_settings(args: argparse.Namespace) -> StorageSettings:
    """The object store the flags name (credentials only ever from the environment and the
    provider's files; botocore also reads AWS_ENDPOINT_URL)."""
    return StorageSettings(endpoint_url=getattr(args, "endpoint_url", None), profile=getattr(args, "profile", None))


def _target(args: argparse.Namespace) -> StoreOut:
    """Where the store goes: a folder, or an object-store URL staged through a local folder
    (s3fs is imported only here, for a remote --out)."""
    stage = getattr(args, "stage", None)
    if is_remote(args.out):
        from loom.data.prepare.upload import RemoteOut

        return RemoteOut(args.out, storage_settings(args), Path(stage) if stage else None)
    if stage:
        raise ConfigError(f"Invalid usage: --stage {stage} is for an object-store --out (s3://...); "
                          f"--out {args.out} is a local folder, written in place.")
    return StoreOut(Path(args.out).expanduser())


def _unavailable(e: StorageUnavailable, where: str) -> int:
    print(f"loom data: {e}\n{where}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def prepare_command(args: argparse.Namespace) -> int:
    """`loom data prepare INPUT... --out DIR`: refuse bad input before any work, then prepare."""
    if args.shard_mb is not None and args.shard_mb <= 0:
        raise ConfigError(f"Invalid usage: --shard-mb {args.shard_mb}: must be positive (MB of input per shard).")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"Invalid usage: --workers {args.workers}: must be at least 1.")
    max_doc_mb = DEFAULT_MAX_DOC_MB if args.max_doc_mb is None else args.max_doc_mb
    if max_doc_mb <= 0:
        raise ConfigError(f"Invalid usage: --max-doc-mb {args.max_doc_mb}: must be positive (M characters).")
    target = _target(args)
    out = getattr(target, "url", target.stage)
    try:
        target.check()
        t0 = time.monotonic()
        shard_bytes = None if args.shard_mb is None else int(args.shard_mb * (1 << 20))
        units = units_for_inputs(args.inputs, args.field, shard_bytes)
        try:
            sc = prepare(units, target, args.tokenizer, workers=args.workers, strict=args.strict,
                         max_doc_mb=max_doc_mb)
        except KeyboardInterrupt:
            kept = target.kept_count(len(units))
            print(f"loom data prepare: stopped (Ctrl-C); {'?' if kept is None else kept}/{len(units)} shards kept "
                  f"in {out}: run the same command again to resume from them", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
    except StorageUnavailable as e:
        return _unavailable(e, f"Nothing is visible as a store at {out} until a prepare finishes; the shards "
                               "uploaded so far are kept: run the same command again to resume.")
    dt = time.monotonic() - t0
    mb = sum(u.bytes for u in units) / 1e6
    skipped = f"; skipped {sc['empty_skipped']:,} empty and {sc['not_utf8']:,} non-UTF-8 document(s)" \
        if sc["empty_skipped"] or sc["not_utf8"] else ""
    print(f"wrote {out}: {sc['documents']:,} documents, {sc['tokens']:,} tokens ({sc['dtype']}, "
          f"tokenizer {sc['tokenizer'] or 'none: bytes'}) in {len(sc['shards'])} shard(s), "
          f"{mb:,.1f} MB in {dt:.1f} s ({mb / max(dt, 1e-9):.1f} MB/s){skipped}")
    return EXIT_OK


def inspect_command(args: argparse.Namespace) -> int:
    try:
        print(inspect_text(args.path, storage_settings(args)))
    except StorageUnavailable as e:
        return _unavailable(e, f"{args.path} could not be read; nothing was changed.")
    return EXIT_OK
