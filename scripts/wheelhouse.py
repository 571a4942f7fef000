"""Collect the wheels Loom needs beside a site's torch into one folder, for an air-gapped machine.

Called by scripts/wheelhouse.sh (which says how). pip already knows how to resolve and
download for another Python and platform (`--python-version`, `--platform`); what it cannot
do is leave out torch, whose CUDA build the site provides. So the resolution is pip's own
(`pip install --dry-run --report`, which reads wheel metadata only, not torch's GBs), and
this script walks the reported dependency graph to drop what the site's PyTorch stack
already holds, then `pip download --no-deps` fetches the rest. The two sdist-only packages
(antlr4-python3-runtime, deepspeed) are built into wheels first, deepspeed with
DS_BUILD_OPS=0 (its ops are built just in time on the GPU machine).

The site stack is torch and what it requires, numpy, and PyTorch Lightning with what it
requires: a CUDA PyTorch image ships them. `--with lightning` adds Lightning's stack and
numpy for a machine that has only torch.

The resolution runs against the torch the site serves (`--torch VERSION`, default this
interpreter's), as a metadata-only stub wheel of that version given to pip by path: so a site's
pip constraint (PIP_CONSTRAINT, or `constraint` in pip.conf) that allows that torch resolves, pip
picks releases that support it, and a package that needs a newer torch stops the build with one
paragraph naming the package, its requirement and the target torch (never packed to fail later).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
SDIST_ONLY = {"antlr4-python3-runtime": "4.9.3"}
DEEPSPEED_DEFAULT = "0.19.8"
BUILD = ["setuptools>=64", "wheel"]  # `pip install -e .` with no index builds Loom with these
SITE_ROOTS = ("torch", "numpy", "pytorch-lightning")
EXTRAS = ("tracking", "hf", "data", "sweeps", "lightning")


class WheelhouseError(Exception):
    """A build that cannot succeed as asked: one paragraph for the user, exit 2."""


def pip(py: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([py, "-m", "pip", "--disable-pip-version-check", *args], check=True, **kw)


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def target_torch(given: str | None) -> str:
    """The torch version to resolve against, checked against Loom's own torch range."""
    version = given or installed_version("torch")
    if version is None:
        raise WheelhouseError("this interpreter has no torch to take the version from: pass the site's with "
                              "--torch VERSION (e.g. --torch 2.13.0+cu128).")
    try:
        Version(version)
    except InvalidVersion:
        raise WheelhouseError(f"--torch {version} is not a version (e.g. --torch 2.13.0).") from None
    loom = next(Requirement(r) for r in project()["dependencies"] if canonicalize_name(Requirement(r).name) == "torch")
    if not loom.specifier.contains(version, prereleases=True):
        raise WheelhouseError(f"torch {version} is outside Loom's supported range ({loom}, pyproject.toml): "
                              "the site's torch must be in it; pass the site's version with --torch VERSION.")
    return version


def requirements(extras: list[str]) -> dict[str, list[str]]:
    """pyproject.toml's requirement strings by group: "core" and each chosen extra."""
    meta = project()
    optional = meta["optional-dependencies"]
    groups = {"core": [r for r in meta["dependencies"] if canonicalize_name(Requirement(r).name) != "torch"]}
    for extra in extras:
        if extra != "lightning":
            groups[extra] = [r for r in optional[extra] if not r.startswith("loom[")]
    return groups


def build_sdists(py: str, out: Path, deepspeed: str) -> None:
    """Wheels of the packages PyPI has only as sources (kept when already in `out`)."""
    pins = {**SDIST_ONLY, "deepspeed": deepspeed}
    for name, version in pins.items():
        stem = name.replace("-", "_")
        if list(out.glob(f"{stem}-{version}-*.whl")):
            continue
        print(f"[wheelhouse] building {name}=={version} from its sdist", file=sys.stderr)
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        pip(py, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), f"{name}=={version}", env=env)


def stub_torch(where: Path, version: str) -> Path:
    """A metadata-only `torch` wheel of the target's version with no requirements: the site
    provides torch, and resolving PyPI's would fetch the metadata of its CUDA libraries (17 s of
    the 21 s this script took)."""
    info = f"torch-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: loom-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = where / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return path


def resolve(py: str, links: Path, reqs: list[str], target: list[str], torch: str) -> list[dict]:
    """pip's own resolution for the target Python/platform, from wheel metadata only, with torch
    the stub of the target's version, named by path so that no index's torch can stand in for it
    (torch's own requirements are the site's, like torch). Site constraints apply as to any pip."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        stub = stub_torch(Path(tmp), torch)
        r = subprocess.run([py, "-m", "pip", "--disable-pip-version-check", "install", "--dry-run",
                            "--ignore-installed", "--report", str(report), "--only-binary=:all:", *target,
                            "--target", str(Path(tmp) / "t"), "--find-links", str(links), *reqs,
                            f"torch @ {stub.as_uri()}"], capture_output=True, text=True)
        if r.returncode != 0:
            raise WheelhouseError(explain(r.stdout + r.stderr, torch))
        return json.loads(report.read_text())["install"]


def explain(pip_output: str, torch: str) -> str:
    """pip's failed resolution as one paragraph: who needs another torch, or which constraint
    excludes the target's."""
    lines = pip_output.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("The conflict is caused by")), len(lines))
    caused = list(dict.fromkeys(line.strip() for line in itertools.takewhile(str.strip, lines[start:])))
    needs = [m.groups() for line in caused if (m := re.match(r"(\S+) (\S+) depends on (torch\b.*)", line))
             and not Requirement(m[3]).specifier.contains(torch, prereleases=True)]  # pip lists those it meets too
    constraints = [line.split("(constraint) ", 1)[1] for line in caused if "(constraint) " in line]
    target = f"torch {torch}, the torch this wheelhouse is built for (--torch; default: this interpreter's)"
    if needs:
        who = "; ".join(f"{name} {version} requires {spec}" for name, version, spec in needs)
        return (f"{who}: no release that fits {target}. Pick a release that supports it (deepspeed: --deepspeed "
                "VERSION; another package: pin it lower in pyproject.toml), or build for the site's newer torch "
                "with --torch VERSION.")
    if constraints:
        return (f"pip's constraints ({', '.join(constraints)}; from PIP_CONSTRAINT or `constraint` in pip.conf: "
                f"`pip config list` shows it) exclude {target}. Build for a torch they allow, the one the site "
                "serves: --torch VERSION.")
    if caused:
        return f"pip found no set of versions that fits {target}: " + "; ".join(caused) + "."
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR: ")]
    return f"pip could not resolve Loom's requirements for {target}: " + " ".join(errors or lines[-3:])


def marker_env(python: str, platform: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", implementation_name="cpython",
               platform_python_implementation="CPython")
    if "linux" in platform:
        env.update(sys_platform="linux", platform_system="Linux", os_name="posix")
    if platform.endswith("x86_64"):
        env["platform_machine"] = "x86_64"
    elif platform.endswith("aarch64"):
        env["platform_machine"] = "aarch64"
    return env


def closure(items: dict[str, dict], roots: list[Requirement], env: dict[str, str]) -> set[str]:
    """Names reached from `roots` through the report's requires_dist (markers and extras)."""
    seen: set[tuple[str, str]] = set()
    todo = [(canonicalize_name(r.name), frozenset(r.extras)) for r in roots]
    reached: set[str] = set()
    while todo:
        name, extras = todo.pop()
        for extra in {"", *extras}:
            if (name, extra) in seen or name not in items:
                continue
            seen.add((name, extra))
            reached.add(name)
            for spec in items[name]["metadata"].get("requires_dist") or []:
                req = Requirement(spec)
                if req.marker is None or req.marker.evaluate({**env, "extra": extra}):
                    if req.marker is not None or extra == "":
                        todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return reached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    ap.add_argument("--platform", default="manylinux2014_x86_64")
    ap.add_argument("--with", dest="extras", default="", help=f"comma-separated: {', '.join(EXTRAS)}, all")
    ap.add_argument("--torch", default=None, help="the site's torch version (default: this interpreter's)")
    ap.add_argument("--deepspeed", default=None, help="deepspeed version (default: this interpreter's)")
    args = ap.parse_args()
    extras = [e for e in args.extras.split(",") if e]
    extras = list(EXTRAS) if "all" in extras else extras
    unknown = sorted(set(extras) - set(EXTRAS))
    try:
        if unknown:
            raise WheelhouseError(f"unknown --with {','.join(unknown)}; valid: {', '.join(EXTRAS)}, all")
        args.torch = target_torch(args.torch)
        build(args, extras)
    except WheelhouseError as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 2
    return 0


def build(args: argparse.Namespace, extras: list[str]) -> None:
    """Resolve, sort into groups (what the site has, what each extra adds), download, list."""
    py, out = sys.executable, args.dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = ["--python-version", args.python, "--platform", args.platform]
    deepspeed = args.deepspeed or installed_version("deepspeed") or DEEPSPEED_DEFAULT
    build_sdists(py, out, deepspeed)
    groups = requirements(extras)
    all_reqs = [r for rs in groups.values() for r in rs] + BUILD + [f"deepspeed=={deepspeed}"]
    items = {canonicalize_name(i["metadata"]["name"]): i for i in resolve(py, out, all_reqs, target, args.torch)}
    env = marker_env(args.python, args.platform)
    site_roots = ["torch"] if "lightning" in extras else list(SITE_ROOTS)
    site = closure(items, [Requirement(r) for r in site_roots], env)
    group_of: dict[str, str] = {}
    for group, reqs in [("build", BUILD), *groups.items()]:
        for name in sorted(closure(items, [Requirement(r) for r in reqs], env) - site):
            group_of.setdefault(name, group)
    if "lightning" in extras:
        for name in sorted(closure(items, [Requirement(r) for r in SITE_ROOTS[1:]], env) - site):
            group_of[name] = "lightning" if group_of.get(name, "core") == "core" else group_of[name]
    download(py, out, items, group_of, target)
    write_manifest(out, items, group_of, site, args)


def installed_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def wheel_of(out: Path, name: str, version: str) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for path in out.glob("*.whl"):
        dist, ver = path.name.split("-")[:2]
        if re.sub(r"[-_.]+", "_", dist).lower() == stem and ver == version:
            return path
    return None


def download(py: str, out: Path, items: dict[str, dict], group_of: dict[str, str], target: list[str]) -> None:
    missing = [f"{n}=={items[n]['metadata']['version']}" for n in sorted(group_of)
               if wheel_of(out, n, items[n]["metadata"]["version"]) is None]
    if missing:
        print(f"[wheelhouse] downloading {len(missing)} wheels", file=sys.stderr)
        pip(py, "download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", str(out), *missing)


def write_manifest(out: Path, items: dict[str, dict], group_of: dict[str, str], site: set[str], args) -> None:
    """manifest.json (for scripts/setup.sh and the tests) and manifest.txt (for people)."""
    rows = []
    for name, group in sorted(group_of.items(), key=lambda kv: (kv[1], kv[0])):
        version = items[name]["metadata"]["version"]
        path = wheel_of(out, name, version)
        rows.append({"name": name, "version": version, "group": group, "file": path.name, "bytes": path.stat().st_size})
    totals: dict[str, int] = {}
    for r in rows:
        totals[r["group"]] = totals.get(r["group"], 0) + r["bytes"]
    manifest = {"python": args.python, "platform": args.platform, "torch": args.torch, "wheels": rows, "bytes_by_group": totals,
                "bytes": sum(totals.values()), "site_stack": sorted(site),
                "site_roots": ["torch"] if "lightning" in (args.extras or "") else list(SITE_ROOTS)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    lines = [f"# Loom wheelhouse for Python {args.python} on {args.platform}, resolved for torch {args.torch}",
             f"# left to the site (must be installed there): {', '.join(manifest['site_roots'])} and what they require",
             *(f"{r['group']:<10} {r['name']:<32} {r['version']:<14} {r['bytes'] / 2**20:7.2f} MiB" for r in rows),
             *(f"# {g}: {b / 2**20:.2f} MiB" for g, b in totals.items()),
             f"# total: {manifest['bytes'] / 2**20:.2f} MiB in {len(rows)} wheels"]
    (out / "manifest.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(totals) - 1:]))


if __name__ == "__main__":
    sys.exit(main())
