"""`loom data prepare ... --out s3://bucket/key`: the store is tokenized into a local staging
folder by the ordinary prepare, and each shard is uploaded as soon as its unit finishes, then
deleted here, so the staging disk holds only the shards in flight.

The remote prefix follows the local protocol: `.prepare/plan.json` first, each finished unit's
`.bin`, `.idx` and then its done record under `.prepare/done/`, the sidecar `loom.json` last and
then `.prepare/` deleted: a remote store is whole or absent (open_remote refuses a prefix with
`.prepare/` and no sidecar as an interrupted prepare). A rerun, here or on another machine,
compares the remote plan and keeps every unit whose done record and shard sizes are there.
Every call goes through `retrying`: an outage stops the prepare with StorageUnavailable, resumable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from loom.data.prepare.run import PLAN, StoreOut, finished, open_plan, refuse_other_plan
from loom.data.prepare.worker import DONE, done_path, shard_name
from loom.data.store import PREPARE_DIR, SIDECAR
from loom.data.store.remote.cache import STAGING
from loom.data.store.remote.location import join, key_of
from loom.data.store.remote.open import Listing
from loom.data.store.remote.settings import MB, StorageSettings
from loom.data.store.remote.transport import filesystem, retrying
from loom.errors import ConfigError

PART_BYTES = 64 * MB  # one part of a multipart upload (S3's minimum is 5 MiB); a shard over 2 parts goes multipart


def default_stage(url: str, settings: StorageSettings) -> Path:
    """The staging folder of a prepare to `url`: in the node's cache folder (outside its cap), one
    per URL (a rerun finds it)."""
    return settings.cache_root / STAGING / key_of(url.rstrip("/"))


class RemoteOut(StoreOut):
    """A store prepared into `stage` and uploaded, shard by shard, to `url`."""

    def __init__(self, url: str, settings: StorageSettings, stage: Path | None = None,
                 part_bytes: int = PART_BYTES) -> None:
        self.url, self.settings, self.part_bytes = url.rstrip("/"), settings, int(part_bytes)
        super().__init__(Path(stage).expanduser() if stage else default_stage(self.url, settings))
        self.objects: dict[str, int] = {}

    @property
    def fs(self) -> Any:
        return filesystem(self.url, self.settings)

    def _call(self, what: str, call: Any) -> Any:
        return retrying(what, call, self.settings)

    def list(self) -> dict[str, int]:
        """{key relative to the URL: size} of every object under it (one listing)."""
        try:
            found = Listing(self.url, self.settings).objects
        except FileNotFoundError:
            raise ConfigError(f"Invalid usage: --out {self.url}: its bucket does not exist (or is not visible to "
                              "these credentials). Create it, or fix the URL, --endpoint-url or --profile.") from None
        except Exception as e:  # noqa: BLE001 (only the credential errors are ours to explain)
            if not isinstance(e, PermissionError) and "Credential" not in type(e).__name__:
                raise
            raise ConfigError(f"Invalid usage: --out {self.url}: {type(e).__name__}: {e}. Credentials come from the "
                              "environment or the provider's files (--profile names one of their profiles).") from None
        return {rel: size for rel, (size, _) in found.items()}

    def check(self) -> None:
        """Refuse a complete store or a prefix holding something other than an interrupted prepare."""
        self.objects = objs = self.list()
        if SIDECAR in objs:
            raise ConfigError(
                f"Invalid usage: --out {self.url} is already a complete token store ({SIDECAR} is there). Use "
                f"another --out, or delete its objects to prepare it again (`loom data inspect {self.url}` "
                "describes it).")
        if objs and f"{PREPARE_DIR}/{PLAN}" not in objs:
            raise ConfigError(
                f"Invalid usage: --out {self.url} holds {len(objs):,} object(s) and is not an interrupted prepare: "
                "the store's shards would mix with them. Use a new, empty prefix for --out.")

    def begin(self, plan: dict[str, Any]) -> None:
        """Check a resumed prepare's remote plan (or upload the plan first); a stage left by another
        plan is dropped (the remote prefix, not the stage, says what is kept)."""
        remote_plan = join(self.url, PREPARE_DIR, PLAN)
        if f"{PREPARE_DIR}/{PLAN}" in self.objects:
            old = json.loads(self._call(f"reading {remote_plan}", lambda: self.fs.cat_file(remote_plan)))
            if old != plan:
                raise refuse_other_plan(self.url, old, plan)
        local = self.stage / PREPARE_DIR / PLAN
        if local.is_file() and json.loads(local.read_text()) != plan:
            shutil.rmtree(self.stage)
        open_plan(self.stage, plan)
        if f"{PREPARE_DIR}/{PLAN}" not in self.objects:
            self._put(local, remote_plan)

    def kept(self, i: int, itemsize: int) -> dict[str, Any] | None:
        """Unit i's record when its shard is uploaded whole (remote done record, .bin and .idx of the
        sizes it gives); one finished here but not yet uploaded is uploaded now."""
        name = shard_name(i)
        done = f"{PREPARE_DIR}/{DONE}/{name}.json"
        if done in self.objects:
            url = join(self.url, done)
            record = json.loads(self._call(f"reading {url}", lambda: self.fs.cat_file(url)))
            if (self.objects.get(f"{name}.bin") == record["tokens"] * itemsize
                    and self.objects.get(f"{name}.idx") == record.get("idx_bytes")):
                return record
        record = finished(self.stage, i)
        if record is not None:
            self.unit_done(record)
        return record

    def _put(self, local: Path, url: str) -> None:
        fs, part = self.fs, self.part_bytes
        self._call(f"uploading {local} to {url}", lambda: fs.put_file(str(local), url, chunksize=part))

    def unit_done(self, stats: dict[str, Any]) -> None:
        """Upload the shard (.bin, then .idx, then its done record), then delete it here."""
        i = stats["unit"]
        prefix = self.stage / shard_name(i)
        for ext in (".bin", ".idx"):
            self._put(Path(f"{prefix}{ext}"), join(self.url, f"{shard_name(i)}{ext}"))
        self._put(done_path(self.stage, PREPARE_DIR, i), join(self.url, PREPARE_DIR, DONE, f"{shard_name(i)}.json"))
        for ext in (".bin", ".idx"):
            Path(f"{prefix}{ext}").unlink(missing_ok=True)

    def publish(self, sidecar: dict[str, Any]) -> None:
        """The sidecar last (the store is whole from here on), then `.prepare/` there and the stage here."""
        text = json.dumps(sidecar, indent=2) + "\n"
        url = join(self.url, SIDECAR)
        self._call(f"uploading {url}", lambda: self.fs.pipe_file(url, text.encode()))
        self._rm([k for k in self.list() if k.startswith(PREPARE_DIR + "/")])
        shutil.rmtree(self.stage, ignore_errors=True)

    def _rm(self, keys: list[str]) -> None:
        if keys:
            urls = [join(self.url, k) for k in keys]
            self._call(f"deleting {len(urls)} object(s) under {self.url}", lambda: self.fs.rm(urls))

    def discard(self) -> None:
        """Delete what this prepare uploaded (its shards and `.prepare/`) and the stage."""
        ours = [k for k in self.list() if k.startswith((PREPARE_DIR + "/", "part-"))]
        self._rm(ours)
        shutil.rmtree(self.stage, ignore_errors=True)

    def kept_count(self, n: int) -> int | None:
        """Units whose done record is uploaded (None when storage does not answer)."""
        try:
            objs = self.list()
        except Exception:  # noqa: BLE001 (an outage: the count is only a courtesy)
            return None
        return sum(f"{PREPARE_DIR}/{DONE}/{shard_name(i)}.json" in objs for i in range(n))
