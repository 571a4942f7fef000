"""The storage client: fsspec's filesystem for the URL's scheme (s3fs for s3://, gcsfs for gs://,
adlfs for az://), one per process and endpoint, and the one retry loop every remote call goes through.

fsspec rather than a client of our own: s3fs/gcsfs/adlfs are the maintained transports pandas,
Dask, Hugging Face datasets and PyTorch Lightning already read object storage with; they bring
ranged reads, multipart uploads and the providers' standard credential chains. Their own retries are
turned down to one attempt so that this module owns the budget: a read retries with backoff for
`retry_s` seconds in all, then stops the run with StorageUnavailable naming the object, the same
for every provider.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from loom.data.store.remote.location import SCHEMES, scheme_of
from loom.data.store.remote.settings import StorageSettings
from loom.errors import Unavailable

T = TypeVar("T")
_FILESYSTEMS: dict[tuple, Any] = {}
# errors a retry cannot mend: the object is not there, not ours to read, or the request is wrong
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError,
              KeyError, AttributeError, ImportError)
_PERMANENT_NAMES = ("Credential", "ParamValidation", "NoRegion", "ProfileNotFound", "InvalidAccessKeyId",
                    "SignatureDoesNotMatch")


# the environment a client reads at creation: a filesystem made under other values is not reused
_CLIENT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION",
               "AWS_REGION", "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_ACCOUNT_NAME")


class StorageUnavailable(Unavailable):
    """Object storage did not answer within the retry budget (an outage, not a bad store)."""


def _install_hint(scheme: str) -> str:
    pkg = SCHEMES[scheme]
    extra = " (pip install 'loom[storage]')" if pkg == "s3fs" else ""
    return f"{scheme}:// needs the {pkg} package{extra}"


def filesystem(url: str, settings: StorageSettings) -> Any:
    """The fsspec filesystem for `url` (this process's, made once per endpoint and profile)."""
    scheme = scheme_of(url)
    if scheme is None:
        raise ValueError(f"{url} is not an object-store URL")
    env = tuple(os.environ.get(k) for k in _CLIENT_ENV)  # what the client reads when the settings say nothing
    key = (os.getpid(), scheme, settings.endpoint_url, settings.profile, settings.region, settings.timeout_s, env)
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs = _FILESYSTEMS[key] = _make(scheme, settings)
    return fs


def _make(scheme: str, settings: StorageSettings) -> Any:
    try:
        import fsspec
    except ImportError:
        raise ImportError(_install_hint(scheme)) from None
    if scheme == "s3":
        try:
            import s3fs
        except ImportError:
            raise ImportError(_install_hint(scheme)) from None
        config = {"retries": {"total_max_attempts": 1, "mode": "standard"}, "connect_timeout": settings.timeout_s,
                  "read_timeout": settings.timeout_s}
        client = {"region_name": settings.region} if settings.region else {}
        fs = s3fs.S3FileSystem(endpoint_url=settings.endpoint_url, profile=settings.profile, config_kwargs=config,
                               client_kwargs=client, skip_instance_cache=True, use_listings_cache=False)
        fs.retries = 1  # s3fs's own retry loop (a class attribute): `retrying` owns the budget
        return fs
    try:
        return fsspec.filesystem(scheme, skip_instance_cache=True)
    except ImportError:
        raise ImportError(_install_hint(scheme)) from None


def transient(exc: BaseException) -> bool:
    """Whether a retry may succeed: throttling, 5xx, timeouts, dropped connections; not a missing
    object, refused credentials or a bad request."""
    if isinstance(exc, _PERMANENT) and not isinstance(exc, TimeoutError | ConnectionError):
        return False
    names = " ".join(c.__name__ for c in type(exc).__mro__)
    return isinstance(exc, Exception) and not any(n in names for n in _PERMANENT_NAMES)


def retrying(what: str, call: Callable[[], T], settings: StorageSettings,
             on_retry: Callable[[], None] | None = None) -> T:
    """`call()`, retried on transient errors with capped exponential backoff and jitter for
    `settings.retry_s` seconds in all; then StorageUnavailable naming `what` and the last error."""
    deadline = time.monotonic() + settings.retry_s
    delay, tries = 0.1, 0
    while True:
        tries += 1
        try:
            return call()
        except Exception as e:  # noqa: BLE001 (classified just below)
            if not transient(e):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageUnavailable(
                    f"{what}: object storage did not answer after {tries} tries in {settings.retry_s:g} s "
                    f"(last error: {type(e).__name__}: {e}). Check the endpoint and the network, then run the "
                    "same command again: it resumes from the last checkpoint; the retry budget is "
                    "dataset.storage.retry_s.") from e
            if on_retry is not None:
                on_retry()
            time.sleep(min(delay * (0.5 + random.random()), left))
            delay = min(delay * 2, 10.0)
