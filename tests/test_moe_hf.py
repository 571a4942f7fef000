"""The MoE family (loom.models.moe, model=moe*) against transformers: Qwen3-MoE and Mixtral
checkpoints made here with `save_pretrained` go into Loom with transformers' logits, in both
layouts of the routed experts, and Loom's weights go out as a directory transformers loads,
again with the same logits. Refusals (a tensor that maps to nothing, a missing expert, another
expert count) are checked where `loom train` checks them, before launch (`resolve`: validate ->
models.check -> init_from.check).

transformers 5.24 holds the experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, d],
`down_proj` [E, d, I]) but `save_pretrained` writes them per expert (Qwen3-MoE:
`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`; Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`
and `block_sparse_moe.gate`). The other layout is written here from the same tensors, and
transformers itself loads it with the same logits, so both layouts are known right independently
of Loom's reader. In-process only: no launch, no network.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loom.errors import ConfigError
from loom.models import build_module, hf_export_config
from loom.models.moe.hf_config import moe_shapes
from loom.pipeline import resolve
from loom.rundir.hf_export import write_hf_dir
from loom.rundir.safetensors_stream import dtype_name

ONE_CPU = ["hardware=cpu", "hardware.devices=1", "strategy=single"]
VOCAB, E = 512, 8
COMMON = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
ROPE = {"rope_type": "default", "rope_theta": 1e6}
# model=moe_tiny's sizes are the Qwen3-MoE checkpoint's; for Mixtral's: no q/k norms, its epsilon
MIXTRAL_TINY = ["model.qk_norm=false", "model.rms_norm_eps=1e-5"]
FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def _rewrite(src: Path, dst: Path, state: dict[str, torch.Tensor]) -> Path:
    """`src`'s config.json beside `state` as one model.safetensors."""
    dst.mkdir()
    shutil.copyfile(src / "config.json", dst / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _layout(state: dict[str, torch.Tensor]) -> str:
    fused = any(FUSED.match(k) for k in state)
    per_expert = any(PER_EXPERT.match(k) for k in state)
    assert fused != per_expert, sorted(state)
    return "fused" if fused else "per_expert"


def _to_fused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> transformers 5's names: gate_up_proj [E, 2I, d] = every expert's gate
    rows, then its up rows; down_proj [E, d, I]; Mixtral's block_sparse_moe.gate -> mlp.gate."""
    out, parts = {}, {}
    for k, v in state.items():
        hit = PER_EXPERT.match(k)
        if hit is None:
            out[k.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = v
            continue
        part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(hit[4], hit[4])
        parts.setdefault((hit[1], part), {})[int(hit[3])] = v
    for layer in sorted({k[0] for k in parts}, key=int):
        stack = {p: torch.stack([parts[(layer, p)][e] for e in range(E)]) for p in ("gate_proj", "up_proj", "down_proj")}
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], 1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = stack["down_proj"]
    return out


def _to_per_expert(state: dict[str, torch.Tensor], mixtral: bool) -> dict[str, torch.Tensor]:
    """The inverse, with the names transformers 4 wrote (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2)."""
    block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    out = {}
    for k, v in state.items():
        hit = FUSED.match(k)
        if hit is None:
            out[k.replace(".mlp.gate.", f".{block}.gate.")] = v
            continue
        pre = f"model.layers.{hit[1]}.{block}.experts."
        for e in range(v.shape[0]):
            if hit[2] == "down_proj":
                out[f"{pre}{e}.{names[2]}.weight"] = v[e]
            else:
                gate, up = v[e].chunk(2, dim=0)
                out[f"{pre}{e}.{names[0]}.weight"], out[f"{pre}{e}.{names[1]}.weight"] = gate, up
    return out


def _save(model, path: Path, sharded: bool) -> Path:
    """Random weights (norms too, so none is at its init value), then save_pretrained in float32."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.eval().save_pretrained(path, max_shard_size="300KB" if sharded else "1GB")
    return path


def _both_layouts(written: Path, mixtral: bool) -> dict[str, Path]:
    """The dir save_pretrained wrote and the other layout of the same tensors."""
    state = _tensors(written)
    layout = _layout(state)
    other = _to_per_expert(state, mixtral) if layout == "fused" else _to_fused(state)
    name = "per_expert" if layout == "fused" else "fused"
    return {layout: written, name: _rewrite(written, written.parent / f"{written.name}_{name}", other)}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{"qwen3_moe" | "mixtral": {"per_expert" | "fused": dir}} (Qwen3-MoE's save sharded)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("moe_hf")
    qwen = Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=E, moe_intermediate_size=32, norm_topk_prob=True,
                          rope_parameters=dict(ROPE), dtype="float32")
    mixtral = MixtralConfig(**COMMON, num_local_experts=E, intermediate_size=32, sliding_window=None,
                            rope_parameters=dict(ROPE), dtype="float32")
    return {"qwen3_moe": _both_layouts(_save(Qwen3MoeForCausalLM(qwen), root / "qwen3_moe", sharded=True), False),
            "mixtral": _both_layouts(_save(MixtralForCausalLM(mixtral), root / "mixtral", sharded=False), True)}


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _loom_from(path: Path, *overrides: str, option: str = "moe"):
    """The run's config and its model, weights loaded as the worker loads model.init_from
    (FileInit with the family's weight adapter, through construct: meta device, then materialized)."""
    cfg = resolve([f"model={option}", f"model.init_from={path}", *ONE_CPU, *overrides])
    module = build_module(cfg)
    module.init_source = cfg.model.init_from
    module.configure_model()
    return cfg, module.model.eval()


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5, (got - want).abs().max().item()


def test_save_pretrained_writes_experts_per_expert_and_transformers_reads_both_layouts(hf_dirs):
    """What transformers 5.24 writes (the docstring says it), and the rewritten layout is the
    same model to transformers: the reference both imports below compare against."""
    qwen, mixtral = _tensors(hf_dirs["qwen3_moe"]["per_expert"]), _tensors(hf_dirs["mixtral"]["per_expert"])
    assert qwen["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert qwen["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.7.w3.weight"} <= set(mixtral)
    assert (hf_dirs["qwen3_moe"]["per_expert"] / "model.safetensors.index.json").is_file()  # sharded
    for family in ("qwen3_moe", "mixtral"):
        fused = _tensors(hf_dirs[family]["fused"])
        assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 64, 64)
        x = _batch()
        _close(_logits(_hf(hf_dirs[family]["fused"]), x), _logits(_hf(hf_dirs[family]["per_expert"]), x))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_a_checkpoint_imports_with_transformers_logits(hf_dirs, family, layout):
    """model=moe: every field from config.json; model=moe_tiny: its own sizes, the same as the file's."""
    path = hf_dirs[family][layout]
    x = _batch()
    want = _logits(_hf(hf_dirs[family]["per_expert"]), x)
    cfg, loom = _loom_from(path)
    m = cfg.model
    assert (m.num_experts, m.experts_per_token, m.moe_intermediate_size, m.head_dim) == (E, 2, 32, 16)
    assert (m.qk_norm, m.norm_topk_prob, m.rope_theta, m.block_size) == (family == "qwen3_moe", True, 1e6, 256)
    assert m.rms_norm_eps == (1e-6 if family == "qwen3_moe" else 1e-5)
    assert {k: tuple(v.shape) for k, v in loom.state_dict().items()} == moe_shapes(m)
    _close(_logits(loom, x), want)
    tiny = MIXTRAL_TINY if family == "mixtral" else []
    _, loom = _loom_from(path, *tiny, option="moe_tiny")
    _close(_logits(loom, x), want)


@pytest.mark.parametrize("qk_norm,arch", [(True, "Qwen3MoeForCausalLM"), (False, "MixtralForCausalLM")])
def test_loom_weights_export_as_a_dir_transformers_loads_with_the_same_logits(tmp_path, qk_norm, arch):
    """The writer and config of `checkpoint.export_format=hf` (worker.results: hf_export_config
    + torch_dtype, write_hf_dir), on moe_tiny's own weights moved off their init values; the
    exported dir (fused experts) goes back into Loom with the same logits."""
    cfg = resolve(["model=moe_tiny", f"model.qk_norm={str(qk_norm).lower()}", "checkpoint.export_format=hf",
                   *ONE_CPU])
    module = build_module(cfg)
    module.configure_model()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = module.model.eval()
    state = model.state_dict()
    specs = [(k, tuple(t.shape), dtype_name(t.dtype)) for k, t in state.items()]
    config = {**hf_export_config(cfg), "torch_dtype": "float32"}
    write_hf_dir(tmp_path / "final", config, specs, iter(state.items()), {"run_id": "test"}, 300_000)
    assert json.loads((tmp_path / "final" / "config.json").read_text())["architectures"] == [arch]
    assert (tmp_path / "final" / "model.safetensors.index.json").is_file()  # sharded at 300 kB
    x = _batch()
    want = _logits(model, x)
    hf = _hf(tmp_path / "final")
    assert hf.config.num_local_experts == E and hf.config.num_experts_per_tok == 2
    _close(_logits(hf, x), want)
    _, back = _loom_from(tmp_path / "final")
    _close(_logits(back, x), want)


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        resolve([*overrides, *ONE_CPU])
    return str(e.value)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_a_tensor_that_maps_to_nothing_is_refused_before_launch_by_name(hf_dirs, tmp_path, layout):
    src = hf_dirs["qwen3_moe"][layout]
    state = _tensors(src) | {"model.layers.1.mlp.shared_expert_gate.weight": torch.zeros(1, 64)}
    path = _rewrite(src, tmp_path / "extra", state)
    for option in ("moe", "moe_tiny"):
        msg = _refusal(f"model={option}", f"model.init_from={path}")
        assert f"does not fit model={option}" in msg
        assert "1 tensor(s) the model does not have: model.layers.1.mlp.shared_expert_gate.weight" in msg


@pytest.mark.parametrize("family,gone", [("qwen3_moe", "model.layers.1.mlp.experts.5.up_proj.weight"),
                                         ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w2.weight")])
def test_a_missing_expert_is_refused_before_launch_naming_the_tensor(hf_dirs, tmp_path, family, gone):
    src = hf_dirs[family]["per_expert"]
    state = _tensors(src)
    del state[gone]
    path = _rewrite(src, tmp_path / "gone", state)
    msg = _refusal("model=moe", f"model.init_from={path}")
    assert "does not fit model=moe" in msg and gone in msg, msg


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_another_expert_count_is_refused_before_launch_naming_the_shapes(hf_dirs, layout):
    msg = _refusal("model=moe_tiny", "model.num_experts=4", f"model.init_from={hf_dirs['qwen3_moe'][layout]}")
    assert "does not fit model=moe_tiny" in msg
    assert "model.layers.0.mlp.gate.weight [8, 64] in the file, [4, 64] in the model" in msg
    assert "model.layers.0.mlp.experts.gate_up_proj [8, 64, 64] in the file, [4, 64, 64] in the model" in msg
    assert "model.layers.1.mlp.experts.down_proj [8, 64, 32] in the file, [4, 64, 32] in the model" in msg


def test_a_sized_option_must_agree_with_config_json_beyond_shapes(hf_dirs):
    """Mixtral's checkpoint has moe_tiny's shapes once q/k norms are off, but another epsilon."""
    path = hf_dirs["mixtral"]["fused"]
    msg = _refusal("model=moe_tiny", "model.qk_norm=false", f"model.init_from={path}")
    assert "model.rms_norm_eps=1e-06 but config.json has 1e-05" in msg
    msg = _refusal("model=moe_tiny", f"model.init_from={path}")  # q/k norms Mixtral has not
    assert "4 tensor(s) missing from the file: model.layers.0.self_attn.q_norm.weight" in msg
