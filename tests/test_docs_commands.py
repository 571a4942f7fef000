"""Every `loom train` / `loom plan` command in the fenced shell blocks of README.md and docs/*.md is
composed and validated in this process, as the CLI does it, with nothing launched:

- `loom train ARGS`: `loom train --cfg job ARGS` (compose + validate, print the config, exit 0); a
  `-m` grid sweep: the base and every trial of the grid (an Optuna interval: the base);
- `loom plan ARGS`: the plan itself, exit 0, or the code a `# exit N` comment names (`--rehearse`,
  which builds ranks for tens of seconds, is left out: tests/test_rehearse.py covers it);
- a `# refused` comment: exit 2 expected.

A line `loom train X ... Y` means the command above it with Y changed ("..."). Paths a command names
(a corpus, a tokenizer, a checkpoint) are placeholders: PLACEHOLDERS maps each to a maker of a tiny
local stand-in (made once per session), and a command naming an unknown absolute path fails here,
so a new doc command gets its fixture. No subprocess, no training run.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:^|\s)(?:\.venv/bin/)?loom (train|plan)\b(.*)")
SHELL = ("bash", "sh", "shell", "console")


def doc_commands() -> list[tuple[str, str, list[str], str]]:
    """(page:line, verb, args, comment) of each command in a shell block; `\\` continues a line."""
    found, prev = [], {}
    for page in PAGES:
        fence, buf = None, ""
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                fence = None if fence is not None else line.strip()[3:]
                continue
            if fence not in SHELL:
                continue
            cont = line.rstrip().endswith("\\")
            buf += line.rstrip()[:-1] + " " if cont else line
            if cont:
                continue
            m = COMMAND.search(buf)
            buf = ""
            if not m:
                continue
            verb, rest = m.groups()
            code, _, comment = rest.partition(" #")
            args = shlex.split(code)
            if "..." in args:  # the command above, with these arguments changed
                mine = {a.split("=", 1)[0] for a in args if "=" in a}
                args = [a for a in prev[verb] if a.split("=", 1)[0] not in mine] + [a for a in args if a != "..."]
            prev[verb] = args
            found.append((f"{page.name}:{n}", verb, args, comment.strip()))
    return found


# ------------------------------------------------------------------ placeholders and their makers

def _corpus(d: Path, r: Resolver) -> None:
    from tests_helpers import CORPUS

    d.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (d / f"part{i}.txt").write_text("\n".join(CORPUS) * 4)


def _tokenizer(d: Path, r: Resolver) -> None:
    from tests_helpers import make_tokenizer

    make_tokenizer(d)


def _prepared(source: str, tokenizer: str | None) -> Callable[[Path, Resolver], None]:
    def make(d: Path, r: Resolver) -> None:
        from loom import cli

        tok = ["--tokenizer", str(r.path(tokenizer))] if tokenizer else []
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(["data", "prepare", str(r.path(source)), *tok, "--out", str(d), "--workers", "1"]) == 0
    return make


def _megatron_prefix(d: Path, r: Resolver) -> None:
    """A Megatron `.bin`/`.idx` pair without Loom's sidecar, as another tool writes it."""
    store = r.path("/data/tok/bytes")
    d.parent.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copy(next(store.glob(f"part-*{ext}")), d.with_suffix(ext))


def _flat_uint16(f: Path, r: Resolver) -> None:
    import numpy as np

    f.parent.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16).tofile(f)


def _chats(f: Path, r: Resolver) -> None:
    from chat_helpers import write_chats

    f.parent.mkdir(parents=True, exist_ok=True)
    write_chats(f, 24)


def _pairs(f: Path, r: Resolver) -> None:
    f.write_text("".join(json.dumps({"prompt": f"Q{i}: what is {i} + {i}?", "completion": f" {2 * i}."}) + "\n"
                         for i in range(24)))


def _prefs(f: Path, r: Resolver) -> None:
    from test_preference_step import write_pairs

    write_pairs(f, 24)


def _hub_cache(d: Path, r: Resolver) -> None:
    """`dataset.hub=wikitext dataset.config=wikitext-2-raw-v1` as the `datasets` library's cache holds
    it once downloaded (built by the library from a local corpus; no network)."""
    import datasets
    from tests_helpers import CORPUS

    corpus = d / "corpus.jsonl"
    d.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in CORPUS * 4))
    built_ds = datasets.load_dataset("json", data_files=[str(corpus)], split="train", cache_dir=str(d / "build"))
    built = Path(built_ds.cache_files[0]["filename"]).parent
    dest = d / "wikitext" / "wikitext-2-raw-v1" / "0.0.0" / built.name
    dest.mkdir(parents=True)
    info = json.loads((built / "dataset_info.json").read_text())
    (dest / "dataset_info.json").write_text(json.dumps({**info, "config_name": "wikitext-2-raw-v1",
                                                        "dataset_name": "wikitext"}))
    shutil.copy(built / "json-train.arrow", dest / "wikitext-train.arrow")


def _saved_dataset(d: Path, r: Resolver) -> None:
    import datasets
    from tests_helpers import CORPUS

    datasets.Dataset.from_dict({"body": CORPUS * 4}).save_to_disk(str(d))


def _hf_llama_chat(d: Path, r: Resolver) -> None:
    """A tiny Llama checkpoint, its context raised to the sft recipe's seq_len (rotary: the same
    weights), with a ChatML tokenizer: an instruct model's stand-in."""
    from chat_helpers import CHATML, make_chat_tokenizer
    from lora_helpers import make_hf_llama

    make_hf_llama(d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    make_chat_tokenizer(d, CHATML, bos="<|im_start|>", eos="<|im_end|>", vocab_size=300)


def _hf_llama(d: Path, r: Resolver) -> None:
    from lora_helpers import make_hf_llama

    make_hf_llama(d)


def _gpt2_dir(d: Path, r: Resolver) -> None:
    from tests_helpers import make_hf_config, make_tokenizer

    make_tokenizer(d)
    make_hf_config(d, vocab_size=300, n_positions=256)


def _hf_config(arch: str) -> Callable[[Path, Resolver], None]:
    def make(d: Path, r: Resolver) -> None:
        import transformers

        getattr(transformers, f"{arch}Config")(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256).save_pretrained(str(d))
    return make


def _published(option: str) -> Callable[[Path, Resolver], None]:
    """A Hugging Face dir shaped like the published checkpoint of `model=option`: its config.json
    and a safetensors file holding only the header (names, dtypes and shapes: what validation reads)."""
    def make(d: Path, r: Resolver) -> None:
        from loom.compose import compose
        from loom.models import hf_export_config
        from loom.models.registry import MODELS

        cfg = compose([f"model={option}"])
        header = {name: {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, 0]}
                  for name, shape in MODELS[option].shapes(cfg).items()}
        raw = json.dumps(header).encode()
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
        (d / "config.json").write_text(json.dumps(hf_export_config(cfg)))
    return make


def _user_module(f: Path, r: Resolver) -> None:
    f.write_text("from tests_helpers import DigitsLit as MyLitModule  # a user's LightningModule\n")


def _eval_task(d: Path, r: Resolver) -> None:
    """docs/evaluation.md's own task YAML over a local JSONL (data_files absolute, as the page says)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "my_mcq.jsonl").write_text("".join(json.dumps({"question": f"{i} + 1 =", "choices": [f" {i + 1}", f" {i}"],
                                                        "label": 0}) + "\n" for i in range(8)))
    page = (ROOT / "docs" / "evaluation.md").read_text()
    yaml = page.split("# /data/evals/my_mcq.yaml\n", 1)[1].split("```", 1)[0]
    (d / "my_mcq.yaml").write_text(yaml.replace("/data/evals", str(d)))


def _my_recipes(d: Path, r: Resolver) -> None:
    d.mkdir()
    shutil.copy(ROOT / "recipes" / "gpt-pretrain.yaml", d / "my-pretrain.yaml")


# What each path a command names stands for. Relative ones are made in the working directory.
PLACEHOLDERS: dict[str, Callable[[Path, Resolver], None]] = {
    "/data/corpus": _corpus,
    "/data/chats.jsonl": _chats,
    "/data/evals": _eval_task,
    "/data/my_dataset": _saved_dataset,
    "/data/pairs.jsonl": _pairs,
    "/data/prefs.jsonl": _prefs,
    "/data/owt/train.bin": _flat_uint16,
    "/data/tok/web": _prepared("/data/corpus/*.txt", "/models/Llama-3.2-1B"),
    "/data/tok/code": _prepared("/data/corpus/*.txt", "/models/Llama-3.2-1B"),
    "/data/tok/bytes": _prepared("/data/corpus/*.txt", None),
    "/local/code": _prepared("/data/corpus/*.txt", "/models/Llama-3.2-1B"),
    "/nvme/loom-cache": lambda d, r: d.mkdir(parents=True, exist_ok=True),
    "/megatron/out/my_text_document": _megatron_prefix,
    "/models/Llama-3.2-1B": _tokenizer,
    "/models/Qwen2.5-0.5B-Instruct": _hf_llama_chat,
    "/models/sft-hf": _hf_llama_chat,
    "/models/Qwen2.5-0.5B": _hf_llama,
    "/models/Meta-Llama-3-8B": _published("llama3_8b"),
    "/models/Qwen3-30B-A3B": _published("qwen3_moe_30b_a3b"),
    "/models/tiny-gpt2": _gpt2_dir,
    "/models/Qwen3-0.6B": _hf_config("Qwen3"),
    "/models/gemma-2-2b": _hf_config("Gemma2"),
    "hf-cache": _hub_cache,
    "my_pkg.py": _user_module,
    "my-recipes": _my_recipes,
}
# Paths that name no input: where runs go, a Kubernetes volume, a rendezvous host.
NOT_INPUTS = ("/shared/runs", "/runs", "/runs/exp")


class Resolver:
    """Makes each placeholder's stand-in once, under `root` (the commands' working directory)."""

    def __init__(self, root: Path) -> None:
        self.root, self.made = root, {}
        self.s3 = None  # the local S3 server behind s3://corpora/ (started by the first command naming it)
        self.env = pytest.MonkeyPatch()

    def remote(self) -> None:
        """s3://corpora/tok/web: the /data/tok/web stand-in uploaded to a local S3 API (moto's server)."""
        if self.s3 is None:
            from s3_helpers import LocalS3

            self.s3 = LocalS3()
            for k, v in self.s3.env().items():
                self.env.setenv(k, v)
            self.s3.bucket("corpora")
            self.s3.upload_dir(self.path("/data/tok/web"), "s3://corpora/tok/web")

    def close(self) -> None:
        if self.s3 is not None:
            self.s3.stop()
        self.env.undo()

    def path(self, placeholder: str) -> Path:
        key = next(k for k in sorted(PLACEHOLDERS, key=len, reverse=True) if placeholder.startswith(k))
        if key not in self.made:
            target = self.root / key.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            PLACEHOLDERS[key](target, self)
            self.made[key] = target
        return self.root / placeholder.lstrip("/")

    def substitute(self, arg: str) -> str:
        keys = sorted((k for k in PLACEHOLDERS if k.startswith("/")), key=len, reverse=True)
        pattern = r"(?<![\w./])(" + "|".join(map(re.escape, keys)) + r")(?![\w.-])"
        arg = re.sub(pattern, lambda m: (self.path(m.group(1)), str(self.root / m.group(1).lstrip("/")))[1], arg)
        if "s3://corpora/" in arg:
            self.remote()
        if "my_pkg." in arg:
            self.path("my_pkg.py")
        if "file://./my-recipes" in arg:
            self.path("my-recipes")
        unknown = [p for p in re.findall(r"(?<![\w:./])/[\w.-]+(?:/[\w.*-]+)*", arg)
                   if not p.startswith(str(self.root)) and p not in NOT_INPUTS]
        assert not unknown, f"{arg}: no fixture for {unknown}; add it to PLACEHOLDERS"
        return arg


@pytest.fixture(scope="module")
def resolver(tmp_path_factory):
    r = Resolver(tmp_path_factory.mktemp("docs"))
    yield r
    r.close()


def _cli(root: Path, argv: list[str]) -> tuple[int, str]:
    """`loom ARGV` through the CLI's own main, in `root`, with the launch made impossible."""
    from loom import cli, pipeline

    def no_launch(*_a, **_k):
        raise AssertionError(f"`loom {' '.join(argv)}` reached the launch")

    out = io.StringIO()
    saved, pipeline.launch = pipeline.launch, no_launch
    sys.path.insert(0, str(root))
    try:
        with contextlib.chdir(root), contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    finally:
        pipeline.launch = saved
        sys.path.remove(str(root))
        sys.modules.pop("my_pkg", None)
    return rc, out.getvalue()


def _trials(args: list[str]) -> list[list[str]]:
    """The base and every trial of a `-m` grid (an Optuna interval: the base alone)."""
    from loom.sweep import grid, split_sweep, translate

    fixed, sweeps = split_sweep(translate([a for a in args if a not in ("-m", "--multirun")]))
    if any("optuna" in a for a in args):
        return [fixed]
    return [fixed, *([*fixed, *trial] for trial in grid(sweeps))]


ALL_COMMANDS = doc_commands()
COMMANDS = [c for i, c in enumerate(ALL_COMMANDS)  # a command repeated on another page is checked once
            if (c[1], c[2], c[3]) not in [(d[1], d[2], d[3]) for d in ALL_COMMANDS[:i]]]


def test_the_readme_stays_a_front_door():
    """README.md is the front door (issue 51): at most 200 lines, the rest in docs/ pages."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_docs_hold_commands_of_both_verbs():
    verbs = {verb for _, verb, _, _ in ALL_COMMANDS}
    assert verbs == {"train", "plan"} and len(COMMANDS) > 40, ALL_COMMANDS


@pytest.mark.parametrize(("where", "verb", "args", "comment"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_doc_command_composes_and_validates(resolver, monkeypatch, where, verb, args, comment):
    args = [resolver.substitute(a) for a in args]
    if any(a.startswith("dataset.hub=") for a in args):  # the datasets library's cache, as after a download
        import datasets

        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", resolver.path("hf-cache"))
    expected = 2 if comment.startswith("refused") else int(m.group(1)) if (m := re.match(r"exit (\d+)", comment)) else 0
    root = resolver.root
    if verb == "plan":
        args = [a for a in args if a != "--rehearse"]
        if "--rank" in args:
            i = args.index("--rank")
            del args[i:i + 2]
        rc, out = _cli(root, ["plan", *args])
        assert rc == expected, f"{where}: loom plan {' '.join(args)}\n{out}"
        return
    runs = _trials(args) if {"-m", "--multirun"} & set(args) else [args]
    for trial in runs:
        rc, out = _cli(root, ["train", "--cfg", "job", *trial])
        assert rc == expected, f"{where}: loom train {' '.join(trial)}\n{out}"
    assert not any((root / "runs").rglob("config.yaml")), "a run dir was frozen"
