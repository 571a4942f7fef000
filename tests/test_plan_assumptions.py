"""Plans state their assumptions: `loom plan`'s header names seq_len, the micro and the global
batch with where each came from (plan.json `assumptions`), and `strategy=auto` says what it
chose, out of how many layouts, and why (plan.json `auto_choice`). In-process, no launch."""

from __future__ import annotations

import json
import re

import pytest

from loom.cli import main
from loom.compose import compose
from loom.plan.compare import compare


def _plan(capsys, monkeypatch, tmp_path, *overrides: str) -> tuple[str, dict]:
    """`loom plan OVERRIDES --json`: (the table, one line per row, at 200 columns; plan.json)."""
    monkeypatch.setenv("COLUMNS", "200")  # rich: fewer wrapped lines
    path = tmp_path / "plan.json"
    assert main(["plan", "--json", str(path), *overrides]) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def _row(out: str, name: str) -> str:
    """The text of the table row `name` (its wrapped lines joined)."""
    rows: list[list[str]] = []
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if len(cells) == 2 and cells[0]:
            rows.append(cells)
        elif len(cells) == 2 and rows:  # a wrapped line of the row above
            rows[-1][1] += " " + cells[1]
    found = [text for key, text in rows if key == name]
    assert found, f"no row {name!r} in:\n{out}"
    return found[0]


def test_defaults_are_named_as_defaults(capsys, monkeypatch, tmp_path):
    """The issue's case: llama3_8b planned at tinycode's seq_len 128 says so."""
    out, plan = _plan(capsys, monkeypatch, tmp_path, "model=llama3_8b", "strategy=fsdp", "hardware=h100x8")
    assert "loom plan: fsdp on h100x8" in out and "chosen by strategy=auto" not in out
    assert _row(out, "seq_len") == "128 (dataset default, conf/dataset/tinycode.yaml)"
    assert _row(out, "micro batch") == "16 per device (dataset default, conf/dataset/tinycode.yaml)"
    assert _row(out, "global batch") == ("128 = micro 16 x accum 1 x dp 8, 16,384 tokens/step "
                                         "(derived, trainer.global_batch_size unset)")
    a = plan["assumptions"]
    assert a["seq_len"] == {"value": 128, "key": "dataset.seq_len", "source": "dataset default",
                            "detail": "conf/dataset/tinycode.yaml"}
    assert (a["micro_batch"]["value"], a["micro_batch"]["source"]) == (16, "dataset default")
    assert a["accumulate_grad_batches"] == {"value": 1, "key": "trainer.accumulate_grad_batches",
                                            "source": "default", "detail": "conf/train.yaml"}
    assert (a["global_batch"]["value"], a["global_batch"]["source"]) == (plan["global_batch"], "derived") == (128,
                                                                                                               "derived")
    assert plan["auto_choice"] is None


def test_overrides_and_a_recipe_are_named_and_accumulation_is_derived(capsys, monkeypatch, tmp_path):
    """zero3-big-model sets seq_len 128 and micro batch 2 (recipes/zero3-big-model.yaml); the
    command sets the global batch, so the accumulation is derived from it (8 / (2 x 2 ranks))."""
    out, plan = _plan(capsys, monkeypatch, tmp_path, "recipe=zero3-big-model", "hardware=cpu",
                      "trainer.global_batch_size=8")
    assert _row(out, "seq_len") == "128 (recipe=zero3-big-model)"
    assert _row(out, "micro batch") == "2 per device (recipe=zero3-big-model)"
    assert _row(out, "global batch") == (
        "8 = micro 2 x accum 2 x dp 2, 1,024 tokens/step (your override trainer.global_batch_size=8; "
        "accum: derived from trainer.global_batch_size, 8 / (micro 2 x dp 2))")
    a = plan["assumptions"]
    assert a["global_batch"] == {"value": 8, "key": "trainer.global_batch_size", "source": "override",
                                 "detail": "trainer.global_batch_size=8"}
    assert a["accumulate_grad_batches"]["value"] == plan["accumulate_grad_batches"] == 2
    assert a["accumulate_grad_batches"]["source"] == "derived"

    out, plan = _plan(capsys, monkeypatch, tmp_path, "recipe=zero3-big-model", "hardware=cpu",
                      "dataset.seq_len=64", "++dataset.batch_size=1", "trainer.accumulate_grad_batches=3")
    assert _row(out, "seq_len") == "64 (your override dataset.seq_len=64)"  # the command wins over the recipe
    assert _row(out, "micro batch") == "1 per device (your override dataset.batch_size=1)"
    assert _row(out, "global batch") == ("6 = micro 1 x accum 3 x dp 2, 384 tokens/step (derived, "
                                         "trainer.global_batch_size unset; accum: your override "
                                         "trainer.accumulate_grad_batches=3)")


def test_a_classifier_has_no_sequence_length(capsys, monkeypatch, tmp_path):
    out, plan = _plan(capsys, monkeypatch, tmp_path, "dataset=digits", "model=mlp", "hardware=cpu")
    assert _row(out, "seq_len") == "dataset=digits has no sequences"
    assert _row(out, "micro batch") == "32 per device (dataset default, conf/dataset/digits.yaml)"
    assert plan["assumptions"]["seq_len"]["value"] is None


def test_old_plan_json_without_assumptions_renders_its_batch_row(capsys, monkeypatch, tmp_path):
    from loom.plan.render import render

    _, plan = _plan(capsys, monkeypatch, tmp_path, "hardware=cpu")
    plan.pop("assumptions")
    render(plan)
    out = capsys.readouterr().out
    assert _row(out, "batch") == "micro 16 x accum 1 x dp 2 = global 32 (4,096 tokens/step)"


# ------------------------------------------------------------------ strategy=auto says why

AUTO_TP = ("model=gpt_125m", "hardware=cpu", "hardware.devices=2", "dataset.batch_size=1", "dataset.seq_len=64")


def test_auto_names_its_choice_the_count_and_the_next_layout(capsys, monkeypatch, tmp_path):
    """gpt_125m on 2 CPU ranks at micro batch 1: auto picks tensor parallelism, whose replica
    spans both ranks, so its micro batch is the user's x 2 (the same global batch). The reason's
    figures are those of `loom plan --compare`'s own ranking of the same config."""
    ranked = compare(compose(list(AUTO_TP))).candidates
    fitting = [c for c in ranked if c.fits]
    best, runner = fitting[0], fitting[1]
    assert (best.strategy, best.degrees["tp"], runner.strategy) == ("fsdp_tp", 2, "ddp")
    assert f"{runner.predicted_step_s:.3g}" != f"{best.predicted_step_s:.3g}"  # no tie here
    slower = runner.predicted_step_s / best.predicted_step_s - 1

    out, plan = _plan(capsys, monkeypatch, tmp_path, "strategy=auto", *AUTO_TP)
    reason = (f"fastest estimated step ({best.predicted_step_s:.3g} s) among {len(fitting)} layout(s) that fit, "
              f"of {len(ranked)} valid; the next, ddp, {slower:.1%} slower")
    assert "loom plan: fsdp_tp (chosen by strategy=auto) on cpu" in out
    assert _row(out, "strategy") == f"fsdp_tp, chosen by strategy=auto: {reason}"
    choice = plan["auto_choice"]
    assert (choice["reason"], choice["runner_up"], choice["tied_with"]) == (reason, "ddp", [])
    assert choice["runner_up_slower_by"] == pytest.approx(slower)
    assert (choice["candidates_considered"], choice["candidates_fitting"]) == (len(ranked), len(fitting))
    assert _row(out, "micro batch") == ("2 per device (strategy=auto's layout: 1 (your override dataset.batch_size=1)"
                                        " x 2 (tp x pp), the same global batch on fewer data-parallel ranks)")
    assert plan["assumptions"]["micro_batch"]["source"] == "auto" and plan["micro_batch"] == 2
    assert _row(out, "global batch").startswith("2 = micro 2 x accum 1 x dp 1, ")  # as ddp's 1 x 2 ranks


def test_auto_names_the_layouts_it_tied_with(capsys, monkeypatch, tmp_path):
    """llama3_8b on h100x8: fsdp, zero3 and the 2 x 4 and 4 x 2 hybrid shards predict the same step
    (to 3 significant figures); fsdp leads by the preset order, and the next distinct one is named.
    (4 x 2 fits since the plan counts the larger of gradients and activations, not their sum.)"""
    ranked = compare(compose(["model=llama3_8b", "hardware=h100x8"])).candidates
    fitting = [c for c in ranked if c.fits]
    same = [c for c in fitting if f"{c.predicted_step_s:.3g}" == f"{fitting[0].predicted_step_s:.3g}"]
    nxt = fitting[len(same)]
    assert [c.strategy for c in same] == ["fsdp", "zero3", "nd", "nd"]
    assert [c.degrees["dp_replicate"] for c in same[2:]] == [2, 4]
    assert (nxt.strategy, nxt.degrees["tp"]) == ("fsdp_tp", 2)

    out, plan = _plan(capsys, monkeypatch, tmp_path, "model=llama3_8b", "strategy=auto", "hardware=h100x8")
    choice = plan["auto_choice"]
    assert choice["tied_with"] == ["zero3", "nd dp_replicate=2 dp_shard=4", "nd dp_replicate=4 dp_shard=2"]
    assert choice["runner_up"] == "fsdp_tp tp=2"
    assert choice["runner_up_slower_by"] == pytest.approx(nxt.predicted_step_s / fitting[0].predicted_step_s - 1)
    assert _row(out, "strategy") == (
        f"fsdp, chosen by strategy=auto: fastest estimated step ({fitting[0].predicted_step_s:.3g} s) among "
        f"{len(fitting)} layout(s) that fit, of {len(ranked)} valid; tied with zero3, nd dp_replicate=2 dp_shard=4, "
        f"nd dp_replicate=4 dp_shard=2 (listed first: fewer moving parts); the next, fsdp_tp tp=2, {choice['runner_up_slower_by']:.1%} slower")
