"""Write Loom's shipped local lm-eval tasks (platform/loom/eval/tasks/*.jsonl) from the tinycode
corpus (the Python standard library's sources, loom.data.options.tinycode): run once, commit the
JSONL. The draw is seeded and the corpus sorted, so one Python version rewrites the same files.

  tinycode_mc        which of four lines follows a snippet: the real next line, or one of three
                     lines drawn from other files (acc, acc_norm)
  tinycode_complete  the snippet's next line, generated greedily up to the newline (exact_match)
  tinycode_ppl       short snippets scored whole (loglikelihood_rolling: word/byte perplexity)

  PYTHONPATH=platform python scripts/make_eval_tasks.py [--docs 150]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from loom.data.options.tinycode import corpus_files
from loom.eval.registry import SHIPPED

CONTEXT_LINES, CONTEXT_CHARS = 3, 120
LINE_CHARS = (12, 40)


def _useful(line: str) -> bool:
    body = line.strip()
    return LINE_CHARS[0] <= len(line) <= LINE_CHARS[1] and not body.startswith("#") and line.isascii()


def snippets(files: list[Path], rng: random.Random, n: int) -> list[dict]:
    """`n` (context, next line, file) triples: a few lines of code and the line after them."""
    out: list[dict] = []
    while len(out) < n:
        path = rng.choice(files)
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        if len(lines) <= CONTEXT_LINES:
            continue
        i = rng.randrange(CONTEXT_LINES, len(lines))
        context = "\n".join(lines[i - CONTEXT_LINES:i]) + "\n"
        if _useful(lines[i]) and len(context) <= CONTEXT_CHARS and context.isascii() and context.strip():
            out.append({"context": context, "next": lines[i], "file": path.name})
    return out


def write(name: str, rows: list[dict]) -> None:
    path = SHIPPED / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{path}: {len(rows)} documents")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=150)
    parser.add_argument("--seed", type=int, default=52)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    files = corpus_files(16_000_000)
    picked = snippets(files, rng, 2 * args.docs)
    mc = []
    for s in picked[:args.docs]:
        others = [o["next"] for o in rng.sample(picked, 12) if o["file"] != s["file"] and o["next"] != s["next"]][:3]
        choices = [s["next"], *others]
        rng.shuffle(choices)
        mc.append({"context": s["context"], "choices": choices, "label": choices.index(s["next"])})
    write("tinycode_mc", mc)
    write("tinycode_complete", [{"context": s["context"], "target": s["next"]} for s in picked[args.docs:]])
    write("tinycode_ppl", [{"text": s["context"] + s["next"] + "\n"} for s in picked[: args.docs // 2]])


if __name__ == "__main__":
    main()
