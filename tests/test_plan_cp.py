"""Context parallelism in `loom plan` (torch-free, in-process): memory, the wire, plan.json, and the
layouts `loom plan --compare` and `strategy=auto` offer."""

from __future__ import annotations

import pytest

from loom.compose import compose
from loom.pipeline import plan_run, resolve
from loom.plan import make_plan
from loom.plan.compare import MESH_KEYS, compare, predict
from loom.plan.context import CP_MIN_SEQ_LEN
from loom.plan.memory import GB
from loom.validate import validate

LONG = ["model=llama3_8b", "hardware=h100x8", "dataset.seq_len=131072", "dataset.batch_size=1"]
# llama3_8b: 32 layers, 32 query heads, 8 key/value heads of 128, width 4096


def _plan(*overrides: str):
    return make_plan(validate(compose(list(overrides))))


@pytest.fixture(scope="module")
def by_cp():
    """fsdp on 8 H100s at 131072 tokens, full recompute, cp = 1, 2, 4, 8."""
    return {cp: _plan(*LONG, "strategy=fsdp", f"strategy.cp={cp}", "trainer.activation_checkpointing=full")
            for cp in (1, 2, 4, 8)}


def test_activations_per_device_divide_by_cp(by_cp):
    act = {cp: p.memory_per_device_bytes["activations"] for cp, p in by_cp.items()}
    for cp in (2, 4, 8):
        assert act[cp] == pytest.approx(act[1] / cp, rel=1e-9)
    assert by_cp[8].fits and not by_cp[1].fits  # 195 GB -> 24 GB: what makes 131072 tokens fit
    for p in by_cp.values():  # the global batch shrinks with dp; tokens and FLOPs count the full sequence
        assert p.tokens_per_step == p.global_batch * 131072 == p.data_parallel * 131072
        assert p.flops_per_token == by_cp[1].flops_per_token
        assert p.flops_per_step == pytest.approx(p.flops_per_token * p.tokens_per_step)


def test_states_shard_over_dp_shard_times_cp():
    """nd dp_shard=2 cp=4 (tp 1, 8 ranks): FSDP2 shards over the 8 ranks of dp_shard x cp (bf16-mixed:
    4 / 4 / 8 bytes per parameter), gathers and reduce-scatters over them too; no replicas, no all-reduce.
    (HSDP beside cp is refused at validation: not built yet.)"""
    p = _plan(*LONG, "strategy=nd", "strategy.dp_shard=2", "strategy.cp=4", "model.n_kv_heads=8")
    assert (p.parallel["dp_shard"], p.parallel["cp"], p.data_parallel) == (2, 4, 2)  # 2 batches, 8 shards
    n = p.params
    mem = p.memory_per_device_bytes
    assert mem["params"] == pytest.approx(4 * n / 8) and mem["optimizer"] == pytest.approx(8 * n / 8)
    assert p.comm_bytes_by_collective["reduce_scatter"] == pytest.approx(4 * n * 7 / 8)  # fp32 grads, ring of 8
    assert not p.comm_bytes_by_collective.get("all_reduce")
    # fsdp at cp=8 on one node: dp = 1, yet the states are sharded 8 ways and gathered every step
    q = _plan(*LONG, "strategy=fsdp", "strategy.cp=8")
    assert q.data_parallel == 1 and q.memory_per_device_bytes["params"] == pytest.approx(4 * n / 8)
    assert q.comm_bytes_by_collective["all_gather"] > 0 and q.comm_messages_per_step["data_parallel"] > 0


def test_ulysses_all_to_all_bytes_with_grouped_query_heads():
    """Per layer and micro batch, forward: q (32 heads), k and v (8 each), out (32) of 1 x 131072/8
    tokens x 128 head dims in bf16, 7/8 leaving the rank; backward the same; x 32 layers."""
    p = _plan(*LONG, "strategy=fsdp", "strategy.cp=8")
    per_layer = (2 * 32 + 2 * 8) * 1 * (131072 // 8) * 128 * 2 * 7 / 8
    ctx = p.context_parallel
    assert ctx["bytes_per_layer"] == {"forward": pytest.approx(per_layer), "backward": pytest.approx(per_layer)}
    assert p.comm_bytes_by_collective["cp_all_to_all"] == pytest.approx(32 * 2 * per_layer)
    assert p.comm_bytes_by_dimension["context_parallel"] == pytest.approx(32 * 2 * per_layer)
    assert p.comm_messages_per_step["context_parallel"] == 32 * 8  # 4 forward + 4 backward per layer
    # gpt_7b has the same width and heads but 32 key/value heads: q, k, v and out all of 32 heads
    mha = _plan("model=gpt_7b", "model.block_size=131072", *LONG[1:], "strategy=fsdp", "strategy.cp=8")
    assert mha.context_parallel["bytes_per_layer"]["forward"] == pytest.approx(per_layer * 128 / 80)
    # tensor parallelism 2 beside cp 4: heads / 2, tokens / 4; full recompute repeats forward's exchanges
    t = _plan(*LONG, "strategy=fsdp_tp", "strategy.tensor_parallel=2", "strategy.cp=4",
              "trainer.activation_checkpointing=full")
    tp_layer = (2 * 32 + 2 * 8) * (131072 // 4) * 128 / 2 * 2 * 3 / 4
    assert t.context_parallel["bytes_per_layer"]["forward"] == pytest.approx(tp_layer)
    assert t.comm_bytes_by_collective["cp_all_to_all"] == pytest.approx(32 * 3 * tp_layer)
    assert t.comm_messages_per_step["context_parallel"] == 32 * 12


def test_ring_sends_k_and_v_around_the_ring():
    p = _plan(*LONG, "strategy=fsdp", "strategy.cp=4", "strategy.cp_style=ring")
    fwd = 3 * 2 * (131072 // 4) * 8 * 128 * 2  # cp - 1 steps of k and v (8 kv heads), bf16
    assert p.context_parallel["bytes_per_layer"] == {"forward": pytest.approx(fwd), "backward": pytest.approx(2 * fwd)}
    assert p.comm_bytes_by_collective["cp_ring_send"] == pytest.approx(32 * 3 * fwd)
    assert p.comm_messages_per_step["context_parallel"] == 32 * (2 * 3 + 4 * 3)


def test_plan_json_fields_and_table(capsys):
    d = plan_run(validate(compose([*LONG, "strategy=fsdp", "strategy.cp=8", "trainer.activation_checkpointing=full"])),
                 show=True).to_dict()
    ctx = d["context_parallel"]
    assert {"cp", "style", "tokens_per_rank", "state_shards", "bytes_per_layer", "calls_per_layer",
            "bytes_per_step_per_device", "calls_per_step", "collective"} <= set(ctx)
    assert (ctx["cp"], ctx["style"], ctx["tokens_per_rank"], ctx["state_shards"]) == (8, "ulysses", 16384, 8)
    assert d["parallel"]["cp"] == 8 and d["comm_messages_per_step"]["context_parallel"] == ctx["calls_per_step"]
    assert d["comm_bytes_by_collective"]["cp_all_to_all"] == ctx["bytes_per_step_per_device"]
    out = capsys.readouterr().out
    assert "context parallel" in out and "cp=8 (ulysses)" in out and "context-parallel" in out
    assert _plan(*LONG, "strategy=fsdp").context_parallel is None


def test_step_estimate_counts_the_exchanges():
    cfg = validate(compose([*LONG, "strategy=fsdp", "strategy.cp=8", "trainer.activation_checkpointing=full"]))
    plan = make_plan(cfg)
    _, wire, exposed, _, step = predict(cfg, plan)
    expected = plan.comm_bytes_by_dimension["context_parallel"] / (900 * GB) \
        + plan.comm_messages_per_step["context_parallel"] * 2e-5  # nvlink4-900GB/s, NCCL's latency per call
    assert wire.context == pytest.approx(expected) and exposed >= wire.context > 0


@pytest.fixture(scope="module")
def long_compare():
    return compare(compose([*LONG, "trainer.activation_checkpointing=full"]))


def test_compare_offers_cp_on_long_sequences_and_ranks_one_that_fits(long_compare):
    assert "cp" in MESH_KEYS
    cands = long_compare.candidates
    cps = [c for c in cands if c.cp > 1]
    assert {c.strategy for c in cps} >= {"fsdp", "fsdp_tp"} and {c.cp for c in cps} >= {2, 4, 8}
    assert cands[0].fits and cands[0].cp > 1  # nothing without cp fits 131072 tokens of llama3_8b
    assert all(not c.fits for c in cands if c.cp == 1)
    assert "what makes it fit" in cands[0].note and f"activations / {cands[0].cp}" in cands[0].note
    keys = [tuple([c.strategy, *c.degrees.values(), c.ep, c.cp]) for c in cands]
    assert len(keys) == len(set(keys))


def test_every_cp_layout_validates_from_its_overrides(long_compare):
    """A cp row's overrides give its degrees, its memory and the same global batch (cp x the accumulation)."""
    rows = [c for c in long_compare.candidates if c.cp > 1]
    for c in rows[::2]:
        p = _plan(*LONG, "trainer.activation_checkpointing=full", *c.overrides)
        assert p.parallel["cp"] == c.cp and p.memory_per_device_bytes["total"] == pytest.approx(c.memory_per_device_bytes)
        assert p.global_batch == 8 and p.accumulate_grad_batches == c.cp


def test_compare_leaves_cp_out_of_short_sequences_that_fit():
    result = compare(compose(["model=llama3_8b", "hardware=h100x8", "dataset.seq_len=2048", "dataset.batch_size=1"]))
    assert 2048 < CP_MIN_SEQ_LEN and any(c.fits for c in result.candidates)
    assert all(c.cp == 1 for c in result.candidates)


def test_auto_picks_cp_where_only_it_fits():
    """4096 tokens (below CP_MIN_SEQ_LEN) x micro batch 4: no layout without cp fits, so cp is offered
    and strategy=auto chooses it, saying why."""
    over = ["model=llama3_8b", "hardware=h100x8", "dataset.seq_len=4096", "dataset.batch_size=4"]
    result = compare(compose(over))
    assert not any(c.fits for c in result.candidates if c.cp == 1)
    assert any(c.fits for c in result.candidates if c.cp > 1)
    cfg = resolve([*over, "strategy=auto"])
    assert int(cfg.strategy.cp) > 1 and cfg.strategy.name in ("fsdp", "fsdp_tp", "nd")
    plan = plan_run(cfg, show=False)
    assert plan.fits and plan.context_parallel["cp"] == int(cfg.strategy.cp)
    assert "what makes it fit" in plan.auto_choice["reason"] and f"cp={cfg.strategy.cp}" in plan.auto_choice["reason"]


def test_a_run_that_does_not_fit_is_told_the_cp_that_would():
    """fsdp at 131072 tokens: no checkpointing alone fits; cp (with its accumulation) and full does."""
    p = _plan(*LONG, "strategy=fsdp")
    assert not p.fits and p.suggestion == "fsdp"
    over = p.suggestion_overrides
    assert over[0].startswith("strategy.cp=") and "trainer.activation_checkpointing=full" in over
    fixed = _plan(*LONG, "strategy=fsdp", *over)
    assert fixed.fits and fixed.global_batch == p.global_batch
