"""One object owns every path of a run dir (loom.rundir.paths: `RunDir`, `SweepDir`): no other
module of Loom spells a run-dir file name or joins a run-dir folder by hand, and the README's
"What a run writes" is generated from it. Docstrings, comments and prose in messages may name the
files; code that builds a path may not. Tests spell the names freely: they check the contract."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from ast_grep import docstring_ids

from loom.rundir.paths import Part, RunDir, SweepDir, rows, run_dir_table

ROOT = Path(__file__).resolve().parents[1] / "platform" / "loom"
OWNER = ROOT / "rundir" / "paths.py"
# Names a run dir shares with other folders, where other modules own them:
NOT_ONLY_OURS = {
    "model.safetensors",  # the weights file of any safetensors folder (Hugging Face's name), final/'s too
    "job.sbatch",         # also the bundled template's name (scripts/slurm/job.sbatch)
}
# (module, name): the same name for another thing
ELSEWHERE = {("data/prepare/run.py", "plan.json")}  # a prepared data set's plan, not a run's


def _norm(text: str) -> str:
    """A name or a pattern with its variable parts as `*`: "logs/rank-N.log" and the f-string
    f"rank-{rank}.log" (read as "rank-*.log") meet at "rank-*.log"."""
    text = re.sub(r"<[^>]*>|\[[^]]*\]|\bN+\b", "*", text.rstrip("/"))
    return re.sub(r"\*+", "*", text)


def owned() -> tuple[set[str], set[str]]:
    """(names flagged wherever a string spells them, folder names flagged where a path is joined)."""
    anywhere, folders = set(), {SweepDir.FOLDER}
    parts = [v for cls in (RunDir, SweepDir) for v in vars(cls).values() if isinstance(v, Part)]
    for part in parts:
        *dirs, leaf = part.rel.split("/")
        folders.update(dirs)
        anywhere.update([part.rel] if dirs else [])
        (anywhere if "." in leaf else folders).add(leaf)
    for cls in (RunDir, SweepDir):
        for shown, _ in rows(cls):
            leaf = _norm(shown.rstrip("/").split("/")[-1])
            anywhere.update([leaf] if "." in leaf or ("*" in leaf and leaf != "*") else [])
    return {n for n in anywhere if n not in NOT_ONLY_OURS}, folders


def _template(node: ast.AST) -> str | None:
    """A string constant as is; an f-string with `*` for each value; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    return None


def _joined(tree: ast.AST) -> set[int]:
    """ids of the strings that are parts of a path: an operand of `/`, an argument of Path(...),
    .joinpath(...) or os.path.join(...)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            out.update((id(node.left), id(node.right)))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("Path", "PurePath", "joinpath") or (name == "join" and "path" in ast.unparse(f)):
                out.update(id(a) for a in node.args)
    return out


def offences(source: str, module: str = "") -> list[str]:
    """Where a module's code spells a run-dir name (not its docstrings and comments)."""
    anywhere, folders = owned()
    tree = ast.parse(source)
    docs = docstring_ids(tree)
    joined = _joined(tree)
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        text = _template(node)
        if text is None or id(node) in docs or id(node) in inner:
            continue
        name = _norm(text)
        if (module, name) in ELSEWHERE:
            continue
        path_like = "/" in name and " " not in name   # e.g. f"{run_dir}/config.yaml"
        if (name in anywhere or (path_like and name.split("/")[-1] in anywhere)
                or (id(node) in joined and name.split("/")[0] in folders)):
            found.append(f"{module}:{node.lineno}: {text!r}")
    return found


def test_no_module_but_the_run_dirs_own_spells_a_run_dir_name():
    report = [bad for p in sorted(ROOT.rglob("*.py")) if p != OWNER
              for bad in offences(p.read_text(), str(p.relative_to(ROOT)))]
    assert not report, "ask loom.rundir.paths.RunDir for these paths:\n" + "\n".join(report)


@pytest.mark.parametrize("code, caught", [
    ('cfg = load_frozen(run_dir / "config.yaml")', True),
    ("p = Path(run_dir) / 'logs' / f'rank-{rank}.log'", True),
    ('for p in logs.glob("error-rank-*.json"): pass', True),
    ('out = os.path.join(run_dir, "plots")', True),
    ('w = run_dir / "export" / f"{fmt}-step-{step}"', True),
    ('last = ckpts / "last.ckpt"', True),
    ('RECORD = "kubernetes.json"', True),
    ('weights = "final/model.safetensors"', True),
    ('manifest = sweep / "manifest.json"', True),
    ('cfg = f"{run_dir}/config.yaml"', True),
    ('cfg = load_frozen(RunDir(run_dir).config)', False),
    ('kind = "final"  # a source kind, not a path', False),
    ('prof = cfg.trainer.get("profile")', False),
    ('weights = out / "model.safetensors"', False),
    ('path = data_dir / "rank-0.txt"', False),
    ('raise ValueError(f"see {rd.log(0)} for the traceback")', False),
    ('def f():\n    """Reads <run>/summary.json and logs/rank-N.log."""\n    return 1', False),
])
def test_the_grep_catches_hand_joined_run_dir_paths_but_not_prose(code, caught):
    assert bool(offences(code)) is caught


def test_every_path_of_a_run_dir_is_described_and_lies_inside_it():
    run = RunDir(Path("/r/e/abc"))
    for cls, obj in ((RunDir, run), (SweepDir, SweepDir.of("/r", "e", "s1"))):
        for attr, part in ((k, v) for k, v in vars(cls).items() if isinstance(v, Part)):
            assert part.what and getattr(obj, attr).is_relative_to(obj.path), attr
    assert run.checkpoint(5).name == "step-0000005.ckpt" and run.log(3).parent == run.logs
    assert run.export("hf", 10) != run.export("hf", 10, "bf16")
    assert SweepDir.of("/r", "e", "s1").trial("abc").config == RunDir.of("/r/e/sweeps", "s1", "abc").config
    shown = [s for s, _ in rows(RunDir)]
    assert len(shown) == len(set(shown)), shown


def test_the_readme_run_dir_table_is_the_run_dirs():
    readme = (ROOT.parents[1] / "README.md").read_text()
    table = readme.split("<!-- run-dir:begin -->\n")[1].split("\n<!-- run-dir:end -->")[0]
    assert table == run_dir_table(), "regenerate it: python -c 'import loom.rundir.paths as p; print(p.run_dir_table())'"
