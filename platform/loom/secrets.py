"""Keep secrets out of everything a run writes: config.yaml, the wandb config, reports.

Two rules, applied by `redact`:
  1. a value whose KEY looks secret (`is_secret_key`) is replaced, whatever it is;
  2. a string VALUE equal to the value of a secret-looking environment variable (at least
     8 characters, so `token: "1"` style noise is not matched) is replaced wherever it sits,
     e.g. a key that ended up in an innocently named override.
Hand-written because neither Hydra nor wandb redacts: wandb keys have leaked through
`wandb.init(config=...)` of full argv and through Hydra's overrides (docs/LESSONS.md).
No third-party imports: the CLI uses this before anything heavy is loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
ENV_REF = re.compile(r"^\$\{oc\.env:[^}]+\}$")  # `${oc.env:NAME}`: resolved by each process, never stored
MIN_ENV_SECRET_LEN = 8

# Counts and rates *per token* are not credentials.
_NOT_SECRET = re.compile(r".*(?:per|num|max|min|n)_tokens?$", re.IGNORECASE)
_SECRET_KEY = re.compile(
    r"""^(?:
        .*_api_key | api_key | apikey | .*_apikey
      | .*_token | token | .*_access_token
      | .*password.* | .*passwd.*
      | .*secret.*
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


def _scrub(s: str, secrets: set[str]) -> str:
    if s in secrets:
        return REDACTED
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


def redact_text(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every secret environment value replaced (for free text: argv, logs)."""
    return _scrub(text, secret_env_values(environ))


def _keep_ref(v: Any) -> Any:
    """A secret-keyed value: an unresolved env reference may stay (it holds no secret)."""
    return v if isinstance(v, str) and ENV_REF.match(v) else REDACTED


def secret_literals(obj: Any, path: str = "") -> list[str]:
    """Full keys of secret-looking keys holding a literal value (not `${oc.env:NAME}`)."""
    found: list[str] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            if is_secret_key(k) and v is not None and not (isinstance(v, str) and ENV_REF.match(v)):
                found.append(key)
            else:
                found += secret_literals(v, key)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += secret_literals(v, f"{path}[{i}]")
    return found


def split_env_refs(obj: Any) -> tuple[Any, dict[str, str]]:
    """(a copy with every secret-keyed env reference replaced by a placeholder, the references):
    the rest can then be resolved without reading (or needing) the secrets."""
    refs: dict[str, str] = {}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, Mapping):
            out = {}
            for k, v in o.items():
                key = f"{path}.{k}" if path else str(k)
                if is_secret_key(k) and isinstance(v, str) and ENV_REF.match(v):
                    refs[key] = v
                    out[k] = f"<env ref {key}>"
                else:
                    out[k] = walk(v, key)
            return out
        if isinstance(o, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(o)]
        return o

    return walk(obj, ""), refs


def restore_env_refs(obj: Any, refs: dict[str, str]) -> Any:
    for key, ref in refs.items():
        node = obj
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = ref
    return obj
