"""Keep secrets out of everything a run writes: config.yaml, the wandb config, reports.

Three rules, applied by `redact`:
  1. a value whose KEY looks secret (`is_secret_key`) is replaced, whatever it is;
  2. a string VALUE equal to the value of a secret-looking environment variable (at least
     8 characters, so `token: "1"` style noise is not matched) is replaced wherever it sits,
     e.g. a key that ended up in an innocently named override;
  3. the password of a URL's user part (`https://user:password@host`, an endpoint with its key in it).
Hand-written because neither Hydra nor wandb redacts: wandb keys have leaked through
`wandb.init(config=...)` of full argv and through Hydra's overrides (reported in Lightning's and wandb's issue trackers).
No third-party imports: the CLI uses this before anything heavy is loaded.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from typing import Any

from loom.tree import find_keys

REDACTED = "<redacted>"
ENV_REF = re.compile(r"^\$\{oc\.env:[^}]+\}$")  # `${oc.env:NAME}`: resolved by each process, never stored
MIN_ENV_SECRET_LEN = 8

# Counts and rates *per token* are not credentials.
_NOT_SECRET = re.compile(r"(?:.*_)?(?:per|num|max|min|n)_tokens?$", re.IGNORECASE)  # not AWS_SESSION_TOKEN
_SECRET_KEY = re.compile(
    r"""^(?:
        .*_api_key | api_key | apikey | .*_apikey
      | .*_token | token | .*_access_token
      | .*password.* | .*passwd.*
      | .*secret.*
      | .*access_key.* | .*account_key | .*connection_string | .*sas_token
    )$""",
    re.IGNORECASE | re.VERBOSE,
)


def is_secret_key(name: Any) -> bool:
    """True for names like WANDB_API_KEY, HF_TOKEN, db_password, client_secret, api_key, token."""
    if not isinstance(name, str):
        return False
    # Dotted/keyed paths (`tracking.api_key`): the last component names the value.
    leaf = re.split(r"[.\[\]/]", name.strip())
    leaf = [p for p in leaf if p]
    if not leaf:
        return False
    name = leaf[-1].lstrip("+~")
    return bool(_SECRET_KEY.match(name)) and not _NOT_SECRET.match(name)


def secret_env_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of the secret-looking environment variables (long enough to match safely)."""
    env = os.environ if environ is None else environ
    return {v for k, v in env.items() if is_secret_key(k) and len(v) >= MIN_ENV_SECRET_LEN}


_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^@/\s]+@", re.IGNORECASE)


def _scrub(s: str, secrets: set[str]) -> str:
    if s in secrets:
        return REDACTED
    s = _URL_PASSWORD.sub(rf"\1{REDACTED}@", s)
    for v in secrets:  # also inside a longer string, e.g. `--key=<value>` in an argv list
        if v in s:
            s = s.replace(v, REDACTED)
    return s


def redact(obj: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A deep copy of `obj` (dicts, lists, tuples, scalars) with secrets replaced by "<redacted>"."""
    secrets = secret_env_values(environ)

    def walk(o: Any) -> Any:
        if isinstance(o, Mapping):
            return {k: (_keep_ref(v) if is_secret_key(k) and v is not None else walk(v)) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        if isinstance(o, str):
            return _scrub(o, secrets)
        return o

    return walk(obj)


def _keep_ref(v: Any) -> Any:
    """A secret-keyed value: an unresolved env reference may stay (it holds no secret)."""
    return v if isinstance(v, str) and ENV_REF.match(v) else REDACTED


def _is_env_ref(v: Any) -> bool:
    return isinstance(v, str) and bool(ENV_REF.match(v))


def secret_literals(obj: Any) -> list[str]:
    """Full keys of secret-looking keys holding a literal value (not `${oc.env:NAME}`)."""
    found = find_keys(obj, lambda k, v: is_secret_key(k) and v is not None and not _is_env_ref(v))
    return [key for key, _ in found]


def split_env_refs(obj: Any) -> tuple[Any, dict[str, str]]:
    """(a copy with every secret-keyed env reference replaced by a placeholder, the references):
    the rest can then be resolved without reading (or needing) the secrets."""
    refs = dict(find_keys(obj, lambda k, v: is_secret_key(k) and _is_env_ref(v)))
    out = copy.deepcopy(obj)
    for key in refs:
        _set(out, key, f"<env ref {key}>")
    return out, refs


def restore_env_refs(obj: Any, refs: dict[str, str]) -> Any:
    for key, ref in refs.items():
        _set(obj, key, ref)
    return obj


def _set(obj: Any, full_key: str, value: Any) -> None:
    """Set `a.b[0].c`-style `full_key` (as `find_keys` names it) in nested dicts and lists."""
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", full_key)]
    node = obj
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value
