"""Models as config groups: sizes vs spec, validation of custom targets, real 2-rank runs.

(gpt_tiny trains in test_e2e / test_data, gpt_small and the custom LightningModule in
test_data; gpt_125m/1b/7b are too big to train here: their sizes are checked on the meta
device.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT, refused, run_loom
from omegaconf import OmegaConf
from safetensors.torch import load_file
from tests_helpers import cache_hub_dataset, helpers_env, make_hf_config, make_tokenizer, write_json_corpus

from loom.errors import ConfigError
from loom.models import model_spec
from loom.pipeline import resolve

BASE = [a for a in FAST if not a.startswith("dataset.")]


@pytest.mark.parametrize("name", ["gpt_tiny", "gpt_small", "gpt_125m", "gpt_1b", "gpt_7b"])
def test_gpt_sizes_match_the_spec_on_the_meta_device(name):
    from loom.models import build_module

    cfg = resolve([f"model={name}"])
    with torch.device("meta"):
        model = build_module(cfg).build_model()
    spec = model_spec(cfg)
    assert sum(p.numel() for p in model.parameters()) == spec.params
    assert spec.items_per_sample == cfg.dataset.seq_len and spec.flops_per_token > 6 * spec.non_embedding_params
    expected = {"gpt_125m": 86e6, "gpt_1b": 1.2e9, "gpt_7b": 6.4e9}.get(name)
    if expected:
        assert abs(spec.params - expected) / expected < 0.05


def test_the_default_experiment_is_the_models_family(tmp_path):
    """Every run was under runs/gpt/ (Llama, MoE and Kubernetes ones too): a null `experiment` is
    the model's family, in the validated config and the run dir; a given name wins."""
    from loom.freeze import run_dir_of

    cases = {("model=llama_tiny",): "llama", ("model=moe_tiny",): "moe", (): "gpt",
             ("dataset=digits", "model=mlp"): "mlp", ("model=llama_tiny", "experiment=mine"): "mine"}
    for overrides, name in cases.items():
        cfg = resolve([*overrides, f"run.root={tmp_path}", "run.id=x"])
        assert cfg.experiment == name and run_dir_of(cfg, "x") == (tmp_path / name / "x").resolve(), overrides


def test_mlp_spec_matches_the_module_and_fills_sizes_from_the_dataset():
    from loom.models import build_module

    cfg = resolve(["dataset=digits", "model=mlp", "model.hidden=[32,16]"])
    assert cfg.model.in_features == 64 and cfg.model.num_classes == 10
    module = build_module(cfg)
    module.configure_model()
    spec = model_spec(cfg)
    assert sum(p.numel() for p in module.model.parameters()) == spec.params
    assert spec.items_per_sample == 1 and spec.flops_per_token == 6 * (64 * 32 + 32 * 16 + 16 * 10)
    assert module.model(torch.zeros(3, 64)).shape == (3, 10)
    cfg = resolve(["dataset=synthetic", "dataset.kind=tensors", "dataset.shape=[3,4,4]", "model=mlp"])
    assert cfg.model.in_features == 48


@pytest.fixture(scope="module")
def hf_assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_assets")
    tok = make_tokenizer(d / "tok")
    return {"tok": tok, "config": make_hf_config(d / "cfg", vocab_size=300, n_positions=64),
            "data": write_json_corpus(d / "docs.jsonl", 300), "dir": d}


def test_hf_causal_lm_spec_counts_the_built_model(hf_assets):
    from loom.models import build_module

    cfg = resolve(["dataset=synthetic", "dataset.seq_len=32", "dataset.vocab_size=300", "model=hf_causal_lm",
                   f"model.config={hf_assets['config']}"])
    spec = model_spec(cfg)
    module = build_module(cfg)
    module.configure_model()  # built on the meta device, materialized on the CPU, buffers kept
    assert sum(p.numel() for p in module.model.parameters()) == spec.params
    assert not any(t.is_meta for t in [*module.model.parameters(), *module.model.buffers()])
    assert spec.flops_per_token and spec.items_per_sample == 32
    assert [c.__name__ for c in module.sharding_units] == ["GPT2Block"]


def test_hf_causal_lm_pretrained_safetensors_are_read_by_name_into_the_meta_built_model(tmp_path, caplog):
    """Pretrained weights of model=hf_causal_lm are no longer loaded whole by from_pretrained on
    every rank: the model is built on the meta device and each rank reads what it holds of the
    safetensors by name (models.init.FileInit, shard by shard under fsdp and zero3: the llama
    runs of tests/test_llama_runs.py check the part read). Here, whole: transformers' logits."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from loom.models import build_module

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=300, n_positions=64)).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    cfg = resolve(["dataset=synthetic", "dataset.seq_len=32", "dataset.vocab_size=300", "model=hf_causal_lm",
                   f"model.config={tmp_path / 'gpt2'}"])
    module = build_module(cfg)
    with caplog.at_level("INFO", logger="loom"):
        module.configure_model()
    assert "built on the meta device, materialized shard by shard" in caplog.text
    assert "(100% of its elements read on this rank)" in caplog.text
    module.model.eval()  # GPT-2's dropout
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert (module.forward(x) - hf(x).logits).abs().max().item() < 1e-5
    assert module.model.lm_head.weight is module.model.transformer.wte.weight  # still tied


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["model=custom"], ["model.module._target_", "my_pkg"]),
        (["model=custom", "model.module._target_=os.getcwd"], ["os.getcwd", "not allowed", "allow_targets"]),
        (["model=custom", "model.module._target_=loom_no_such_pkg.Net", "security.allow_targets=[loom_no_such_pkg.]"],
         ["model.module._target_", "loom_no_such_pkg.Net", "cannot be imported"]),
        (["model=custom", "model.module._target_=tests_helpers.NotAModule", "security.allow_targets=[tests_helpers.]"],
         ["model.module._target_", "NotAModule", "not a LightningModule or a torch.nn.Module"]),
        (["model=custom", "model.module._target_=tests_helpers.TinyTokenNet", "model.loss._target_=torch.nn.NoSuchLoss",
          "security.allow_targets=[tests_helpers.]"], ["model.loss._target_", "cannot be imported"]),
        (["model=hf_causal_lm"], ["model.config", "config.json"]),
        (["model=hf_causal_lm", "model.config=/nonexistent/model"], ["model.config", "/nonexistent/model", "does not download"]),
        (["model=hf_causal_lm", "model.config=CFG", "dataset.seq_len=128"], ["dataset.seq_len", "128", "64"]),
        (["model=hf_causal_lm", "model.config=CFG", "model.vocab_size=200", "dataset.seq_len=32"],
         ["model.vocab_size", "200", "256"]),
        (["model=hf_causal_lm", "model.config=CFG", "dataset.tokenizer=TOK", "dataset.seq_len=32", "model.vocab_size=100"],
         ["model.vocab_size", "100", "300 tokens"]),
        (["model=llama3_1b", "dataset.tokenizer=TOK", "model.vocab_size=256"], ["model.vocab_size", "256",
                                                                                 "set model.vocab_size=300"]),
    ],
)
def test_bad_model_input_names_the_key_and_the_fix(overrides, needles, hf_assets):
    overrides = [o.replace("CFG", str(hf_assets["config"])).replace("TOK", str(hf_assets["tok"])) for o in overrides]
    with pytest.raises(ConfigError) as e:
        resolve(overrides)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert len(msg.splitlines()) <= 2


WIDENS = "security:\n  allow_targets: [os.]\n"
EVIL = "model:\n  module:\n    _target_: os.getcwd\n"


def _conf_copy(tmp_path: Path) -> Path:
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    return conf


@pytest.mark.parametrize("way", ["recipe", "interpolation", "recipe_defaults", "group_file"])
def test_only_the_command_line_widens_the_target_allow_list(tmp_path, monkeypatch, way):
    """A config file that sets security.allow_targets, by any route, cannot widen it. A recipe
    (builtin or through hydra.searchpath; a literal or an interpolated value) is refused (exit 2)
    naming the file and the command-line form. A group file, chosen on the command line or
    pulled in by a recipe's defaults, is overridden by conf/train.yaml's own value (its `_self_`
    comes last): its `os.` target is still refused as not allowed. The same prefixes on the
    command line pass the allow-list check."""
    recipes = tmp_path / "shared-recipes"
    recipes.mkdir()
    args = [f"hydra.searchpath=[file://{recipes}]", "recipe=team"]
    head = "# @package _global_\n# team: a shared template\ndefaults:\n  - override /model: custom\n"
    culprit = recipes / "team.yaml"
    if way == "recipe":
        culprit.write_text(head + WIDENS + EVIL)
    elif way == "interpolation":  # the value comes from the environment, the key from the file
        monkeypatch.setenv("LOOM_TEST_PREFIXES", "[os.]")
        culprit.write_text(head + "security:\n  allow_targets: ${oc.decode:${oc.env:LOOM_TEST_PREFIXES}}\n" + EVIL)
    else:
        conf = _conf_copy(tmp_path)
        culprit = conf / "tracking" / "team_tracking.yaml"
        culprit.write_text("# @package _global_\ntracking:\n  name: csv\n  wandb: false\n  csv: true\n"
                           "  mode: disabled\n" + WIDENS)
        monkeypatch.setenv("LOOM_CONF_DIR", str(conf))
        if way == "recipe_defaults":
            (recipes / "team.yaml").write_text(head.replace("custom\n", "custom\n  - override /tracking: team_tracking\n")
                                               + EVIL)
        else:
            args = ["tracking=team_tracking", "model=custom", "model.module._target_=os.getcwd"]
    err = refused(tmp_path, *args)
    if way in ("recipe", "interpolation"):
        assert "security.allow_targets" in err and str(culprit) in err, err
        assert "may only come from the command line" in err and "security.allow_targets='[os.]'" in err
    else:
        assert "os.getcwd is not allowed" in err, err
    # the same prefixes from the command line pass the allow-list (a later check refuses os.getcwd)
    with pytest.raises(AssertionError) as later:
        refused(tmp_path, *args, "security.allow_targets=[os.]")
    assert "only come from the command line" not in str(later.value)
    assert "is not allowed" not in str(later.value)


def test_custom_target_validation_does_not_import_torch_for_loom(tmp_path):
    """Validation imports the user's module (here one without torch) and nothing heavier."""
    import subprocess
    import sys

    (tmp_path / "plainmod.py").write_text("class Thing:\n    pass\n")
    code = ("import sys\nfrom loom.pipeline import resolve\nfrom loom.errors import ConfigError\n"
            "try:\n    resolve(['model=custom', 'model.module._target_=plainmod.Thing', "
            "'security.allow_targets=[plainmod.]', 'hardware=cpu'])\nexcept ConfigError as e:\n    print(e)\n"
            "print('torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert "not a LightningModule" in p.stdout and p.stdout.strip().endswith("False"), p.stdout + p.stderr


# ----------------------------------------------------------------------------- real runs


@pytest.mark.launch
def test_finetune_hf_recipe_trains_an_hf_causal_lm_on_a_hub_dataset_from_the_local_cache(tmp_path, hf_assets):
    """The finetune-hf recipe (gpt2 + wikitext from the hub) on local stand-ins: a tiny GPT-2
    config and tokenizer, and README's `dataset.hub=<id>` read from the local HF cache (offline),
    a cache entry the `datasets` library built from hf_assets' corpus. Tests never reach the network."""
    cache = tmp_path / "cache"
    hub = cache_hub_dataset(tmp_path / "hf_home", "loom-tests/tiny-docs", hf_assets["data"])
    r = run_loom("train", "recipe=finetune-hf", *BASE, f"dataset.hub={hub}", "dataset.config=null",
                 "dataset.text_column=content",
                 f"dataset.tokenizer={hf_assets['tok']}", "dataset.seq_len=32", "dataset.batch_size=4",
                 f"dataset.cache_dir={cache}", f"model.config={hf_assets['config']}",
                 "trainer.max_steps=4", root=tmp_path, env=helpers_env(tmp_path))
    assert r.rc == 0, r.out + r.err
    s = r.summary()
    assert s["status"] == "completed" and s["tokens"] == 4 * 2 * 4 * 32
    assert s["throughput"]["tflops_per_device"] > 0
    stores = sorted(cache.glob("hf-*/train/loom.json"))  # the hub dataset, prepared into a token store
    assert len(stores) == 1 and json.loads(stores[0].read_text())["dtype"] == "uint16"  # tokenizer vocab: 16-bit ids
    frozen = OmegaConf.load(r.run_dir / "config.yaml")
    assert (frozen.experiment, frozen.model.name, frozen.strategy.name, frozen.optim.lr) == (
        "finetune-hf", "hf_causal_lm", "ddp", 1e-4)  # the recipe's, with its model and data swapped
    assert (frozen.dataset.hub, frozen.dataset.path) == (hub, None)
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(hf_assets["config"])))
    missing, unexpected = model.load_state_dict(load_file(str(r.run_dir / "final" / "model.safetensors")), strict=False)
    assert not unexpected and not [k for k in missing if "lm_head" not in k]


@pytest.mark.launch
def test_mlp_trains_on_synthetic_tensors(tmp_path):
    r = run_loom("train", *BASE, "dataset=synthetic", "dataset.kind=tensors", "dataset.shape=[8,4]",
                 "dataset.num_samples=2048", "model=mlp", "trainer.max_steps=20", root=tmp_path)
    assert r.rc == 0, r.out + r.err
    s = r.summary()
    assert s["status"] == "completed" and s["samples"] == s["tokens"] == 20 * 2 * 16
    assert s["throughput"]["tflops_per_device"] > 0
    losses = r.losses()
    assert losses[20] < losses[1]
    state = load_file(str(r.run_dir / "final" / "model.safetensors"))
    assert state["layers.1.weight"].shape == (128, 32)


@pytest.mark.launch
def test_custom_nn_module_with_a_loss_trains_on_synthetic_tokens(tmp_path):
    r = run_loom("train", *BASE, "dataset=synthetic", "dataset.seq_len=16", "model=custom",
                 "model.module._target_=tests_helpers.TinyTokenNet", "+model.module.width=16",
                 "security.allow_targets=[tests_helpers.]", "trainer.max_steps=4", root=tmp_path,
                 env=helpers_env(tmp_path))
    assert r.rc == 0, r.out + r.err
    s = r.summary()
    assert s["status"] == "completed" and s["tokens"] == 4 * 2 * 16 * 16
    assert s["throughput"]["tflops_per_device"] is None  # a custom model's FLOPs are unknown
    assert set(load_file(str(r.run_dir / "final" / "model.safetensors"))) == {
        "emb.weight", "out.weight", "out.bias"}
    plan = json.loads((r.run_dir / "plan.json").read_text())
    assert plan["params"] == 256 * 16 + 16 * 256 + 256  # counted on the meta device


@pytest.mark.launch
@pytest.mark.slow
def test_gpt_125m_trains_for_real(loom):
    """The largest GPT this 24 GiB machine can train (87M params; gpt_1b/gpt_7b states alone need
    19 / 103 GB in fp32 Adam, so those two are checked on the meta device above)."""
    from loom.models.gpt import spec as gpt_spec

    r = loom("train", "model=gpt_125m", "strategy=single", *FAST, "dataset.batch_size=1", "dataset.seq_len=32",
             "trainer.max_steps=2", "trainer.limit_val_batches=1", timeout=400)
    assert r.rc == 0, r.out + r.err
    s = r.summary()
    m = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / "gpt_125m.yaml")
    assert s["status"] == "completed" and s["global_step"] == 2
    assert s["memory"]["param_bytes_per_rank"] == [4 * gpt_spec(m, 32).params]


# ---------------------------------------------------------------- fused q/k/v (loom.models.gpt)
def _attention_by_parts(x: torch.Tensor, q, k, v, proj, head_dim: int) -> torch.Tensor:
    """Causal attention from separate q/k/v Linears: what the fused projection must compute."""
    import torch.nn.functional as F

    B, T, _ = x.shape
    heads = [lin(x).view(B, T, -1, head_dim).transpose(1, 2) for lin in (q, k, v)]
    y = F.scaled_dot_product_attention(*heads, is_causal=True)
    return proj(y.transpose(1, 2).reshape(B, T, -1))


def test_fused_qkv_computes_the_separate_projections_and_loads_their_weights():
    from loom.models.gpt.network import CausalSelfAttention, split_qkv

    torch.manual_seed(0)
    d, H = 32, 4
    q, k, v, proj = (torch.nn.Linear(d, d) for _ in range(4))
    fused = CausalSelfAttention(d, H, 0.0)
    assert [n for n, _ in fused.named_parameters()] == ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias"]
    # weights saved with separate q/k/v (older Loom) load into the fused layout
    old = {f"{n}.{a}": getattr(lin, a).detach() for n, lin in zip("qkv", (q, k, v), strict=True) for a in ("weight", "bias")}
    fused.load_state_dict({**old, "proj.weight": proj.weight.detach(), "proj.bias": proj.bias.detach()})
    x = torch.randn(2, 8, d)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), _attention_by_parts(x, q, k, v, proj, d // H))
    parts = split_qkv(fused.qkv.weight.detach(), d // H)
    assert all(torch.equal(p, lin.weight) for p, lin in zip(parts, (q, k, v), strict=True))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_colwise_split_of_the_fused_qkv_holds_whole_heads(tp):
    """Each tensor-parallel rank's contiguous rows of qkv (ColwiseParallel) and columns of proj
    (RowwiseParallel) compute its heads; the sum over ranks (the all-reduce) is the full output."""
    from loom.models.gpt.network import CausalSelfAttention

    torch.manual_seed(1)
    d, H = 32, 4
    full = CausalSelfAttention(d, H, 0.0)
    x = torch.randn(2, 8, d)
    total = torch.zeros(2, 8, d)
    with torch.no_grad():
        for r in range(tp):
            rank = CausalSelfAttention(d, H, 0.0)  # local heads: -1 in the view picks H / tp
            rows, cols = slice(r * 3 * d // tp, (r + 1) * 3 * d // tp), slice(r * d // tp, (r + 1) * d // tp)
            rank.qkv, rank.proj = torch.nn.Linear(d, 3 * d // tp), torch.nn.Linear(d // tp, d)
            rank.qkv.weight.copy_(full.qkv.weight[rows])
            rank.qkv.bias.copy_(full.qkv.bias[rows])
            rank.proj.weight.copy_(full.proj.weight[:, cols])
            rank.proj.bias.copy_(full.proj.bias / tp)
            total += rank(x)
        torch.testing.assert_close(total, full(x))


def test_attention_runs_on_the_flash_kernel_up_to_the_block_size():
    """SDPA's flash kernel accepts the q/k/v views (it refuses a last dim that is not
    contiguous); on CPU this is its CPU flash kernel, on GPU the same checks pick flash/cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from loom.models.gpt.network import GPT

    model = GPT(n_layer=1, n_head=4, d_model=64, vocab_size=64, block_size=128)
    idx = torch.randint(0, 64, (2, 128))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        model(idx).sum().backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None
