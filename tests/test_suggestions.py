"""Every suggestion works: each override a refusal proposes ("set X=Y", "use X=Y", "or X=Y") is
applied here and the result is accepted. Table-driven, in this process, no training launch:
`loom plan` (validated and planned) or `loom train` stopped where it would launch (validated,
machine- and tracking-checked, planned and frozen). A row: the refused arguments, the advice the
refusal must contain, and the arguments after following it.

The sources of advice (grep "set \\|use \\|or " in platform/loom: validate, compose, plan and every
group's checks) each have a row; a message whose advice failed was fixed with its row.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from tests_helpers import make_hf_config, make_tokenizer


class Launched(Exception):
    """`loom train` reached the launch: everything before it accepted the config."""


def loom_cli(root: Path, verb: str, *args: str) -> tuple[int | str, str]:
    """(exit code, or "launched"; stderr) of `loom <verb> <args>` run in this process under `root`."""
    from loom import cli, pipeline

    def stop(*_a, **_k):
        raise Launched

    err, saved = io.StringIO(), pipeline.launch
    pipeline.launch = stop
    try:
        with contextlib.chdir(root), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc: int | str = cli.main([verb, *args, f"run.root={root / 'runs'}"])
    except Launched:
        rc = "launched"
    finally:
        pipeline.launch = saved
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """Local files the rows name: a tokenizer (300 tokens), a weightless GPT-2 config (vocabulary
    300), a GPT-2 with its safetensors (vocabulary 256, 64 positions), a Llama config (64
    positions) with and without its safetensors and a DeepSpeed JSON with an Adam optimizer block."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("suggestions")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64,
                               bos_token_id=1, eos_token_id=1)).save_pretrained(d / "gpt2w")
    llama = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    llama.save_pretrained(d / "llama")
    LlamaForCausalLM(llama).save_pretrained(d / "llamaw")
    (d / "adam.json").write_text(json.dumps({"optimizer": {"type": "Adam", "params": {}}}))
    return {"tok": str(make_tokenizer(d / "tok")), "cfg": str(make_hf_config(d / "cfg", vocab_size=300)),
            "gpt2w": str(d / "gpt2w"), "llama": str(d / "llama"), "llamaw": str(d / "llamaw"), "adam_json": str(d / "adam.json")}


HF = ["model=hf_causal_lm", "dataset=synthetic", "dataset.seq_len=32"]
HFW = [*HF, "model.config={gpt2w}", "dataset.vocab_size=256"]
H100 = ["hardware=h100x8"]  # planned only: this machine has no GPU for `loom train`
DIGITS = ["dataset=digits", "model=mlp"]

# (verb, refused args, the advice in the refusal, args after following it); "-X" drops X.
ROWS = {
    # models/checks.py, models/hf_checks.py
    "gpt-vocab": ("train", ["dataset=synthetic", "dataset.vocab_size=300"], "set model.vocab_size=300",
                  ["model.vocab_size=300"]),
    "hf-vocab": ("train", [*HF, "model.config={cfg}", "dataset.vocab_size=400"], "set model.vocab_size=400",
                 ["model.vocab_size=400"]),
    "hf-tokenizer-weights": ("train", ["model=hf_causal_lm", "dataset.seq_len=32", "model.config={gpt2w}",
                                       "dataset.tokenizer={tok}"],
                             "set model.vocab_size=300 model.random_init=true",
                             ["model.vocab_size=300", "model.random_init=true"]),
    "hf-vocab-weights": ("train", [*HFW, "model.vocab_size=300"], "Set model.random_init=true",
                         ["model.random_init=true"]),
    "hf-vocab-weights-unset": ("train", [*HFW, "model.vocab_size=300"], "leave model.vocab_size unset",
                               ["-model.vocab_size=300"]),
    "hf-width-weights": ("train", [*HFW, "model.overrides.n_embd=64"], "Set model.random_init=true",
                         ["model.random_init=true"]),
    "hf-width-weights-remove": ("train", [*HFW, "model.overrides.n_embd=64"], "remove model.overrides (n_embd)",
                                ["-model.overrides.n_embd=64"]),
    "hf-context-lower": ("train", [*HFW, "dataset.seq_len=128"], "lower dataset.seq_len to 64",
                         ["-dataset.seq_len=128", "dataset.seq_len=64"]),
    "hf-context-raise": ("train", [*HFW, "dataset.seq_len=128"],
                         "set model.overrides.n_positions=128 model.random_init=true",
                         ["model.overrides.n_positions=128", "model.random_init=true"]),
    "hf-context-rotary": ("train", [*HF, "model.config={llama}", "dataset.seq_len=128"],
                          "set model.overrides.max_position_embeddings=128",
                          ["model.overrides.max_position_embeddings=128"]),
    "llama-published-vocab": ("plan", [*H100, "model=llama3_1b", "dataset.tokenizer={tok}", "model.vocab_size=256"],
                              "set model.vocab_size=300", ["-model.vocab_size=256", "model.vocab_size=300"]),
    "llama-pp-tied": ("train", ["model=llama_tiny", "model.tie_embeddings=true", "strategy=pp"],
                      "set model.tie_embeddings=false", ["-model.tie_embeddings=true", "model.tie_embeddings=false"]),
    "llama-pp-tied-fsdp": ("train", ["model=llama_tiny", "model.tie_embeddings=true", "strategy=pp"],
                           "or strategy=fsdp", ["-strategy=pp", "strategy=fsdp"]),
    "llama-nd-tied": ("train", ["model=llama_tiny", "model.tie_embeddings=true", "strategy=nd", "strategy.pp=2"],
                      "or strategy.pp=1 strategy.dp_shard=-1", ["-strategy.pp=2", "strategy.pp=1", "strategy.dp_shard=-1"]),
    "mlp-features": ("train", [*DIGITS, "model.in_features=32"], "set it to 64 or null",
                     ["-model.in_features=32", "model.in_features=64"]),
    "mlp-features-null": ("train", [*DIGITS, "model.in_features=32"], "set it to 64 or null",
                          ["-model.in_features=32", "model.in_features=null"]),
    "mlp-classes": ("train", [*DIGITS, "model.num_classes=5"], "set it to 10 or null",
                    ["-model.num_classes=5", "model.num_classes=10"]),
    # strategies/checks.py, strategies/degrees.py, strategies/deepspeed_optim.py, optim/
    "async-ddp": ("train", ["checkpoint.async=true"], "set checkpoint.async=false",
                  ["-checkpoint.async=true", "checkpoint.async=false"]),
    "compile-zero3-fsdp": ("train", ["strategy=zero3", "trainer.compile=true"], "Use strategy=fsdp",
                           ["-strategy=zero3", "strategy=fsdp"]),
    "compile-zero3-zero2": ("train", ["strategy=zero3", "trainer.compile=true"], "or zero2",
                            ["-strategy=zero3", "strategy=zero2"]),
    "compile-zero3-off": ("train", ["strategy=zero3", "trainer.compile=true"], "set trainer.compile=false",
                          ["-trainer.compile=true", "trainer.compile=false"]),
    "single-devices": ("train", ["strategy=single", "hardware.devices=2"], "set hardware.devices=1",
                       ["-hardware.devices=2", "hardware.devices=1"]),
    "single-ddp": ("train", ["strategy=single", "hardware.devices=2"], "choose strategy=ddp",
                   ["-strategy=single", "strategy=ddp"]),
    "fsdp-fp16": ("plan", [*H100, "strategy=fsdp", "hardware.precision=16-mixed"], "Use hardware.precision=bf16-mixed",
                  ["-hardware.precision=16-mixed", "hardware.precision=bf16-mixed"]),
    "fsdp-fp16-ddp": ("plan", [*H100, "strategy=fsdp", "hardware.precision=16-mixed"], "or strategy=ddp or zero1",
                      ["-strategy=fsdp", "strategy=ddp"]),
    "tp-devices": ("plan", ["strategy=fsdp_tp", "strategy.tensor_parallel=4", "hardware.devices=6"],
                   "keep it and use hardware.devices=4, 8", ["-hardware.devices=6", "hardware.devices=4"]),
    "zero-cpu-fp16": ("train", ["strategy=zero2", "hardware.precision=16-mixed"],
                      "use hardware.precision=bf16-mixed or 32-true",
                      ["-hardware.precision=16-mixed", "hardware.precision=32-true"]),
    "zero-cpu-fp16-bf16": ("train", ["strategy=zero2", "hardware.precision=16-mixed"],
                           "use hardware.precision=bf16-mixed", ["-hardware.precision=16-mixed",
                                                                 "hardware.precision=bf16-mixed"]),
    "zero3-offload-off": ("train", ["strategy=zero3_offload", "strategy.offload_optimizer=false"],
                          "use strategy=zero3", ["-strategy=zero3_offload", "strategy=zero3"]),
    "nd-tp-mlp": ("train", [*DIGITS, "strategy=nd", "strategy.tp=2"], "use strategy.tp=1",
                  ["-strategy.tp=2", "strategy.tp=1"]),
    "nd-replicate-only": ("train", ["strategy=nd", "strategy.dp_replicate=2", "strategy.dp_shard=1"],
                          "or use strategy=ddp", ["-strategy=nd", "-strategy.dp_replicate=2", "-strategy.dp_shard=1",
                                                  "strategy=ddp"]),
    "pp-mlp-fsdp": ("train", [*DIGITS, "strategy=pp"], "use strategy=fsdp / ddp", ["-strategy=pp", "strategy=fsdp"]),
    "pp-mlp-ddp": ("train", [*DIGITS, "strategy=pp"], "use strategy=fsdp / ddp", ["-strategy=pp", "strategy=ddp"]),
    "nd-pp-mlp": ("train", [*DIGITS, "strategy=nd", "strategy.pp=2"], "use strategy.pp=1 strategy.dp_shard=-1",
                  ["-strategy.pp=2", "strategy.pp=1", "strategy.dp_shard=-1"]),
    "pp-interleaved-layers": ("train", ["strategy=pp", "strategy.pp_schedule=interleaved_1f1b"],
                              "use model.n_layer=4", ["model.n_layer=4"]),
    "pp-interleaved-1f1b": ("train", ["strategy=pp", "strategy.pp_schedule=interleaved_1f1b"],
                            "or strategy.pp_schedule=1f1b", ["-strategy.pp_schedule=interleaved_1f1b",
                                                             "strategy.pp_schedule=1f1b"]),
    "pp-accumulate": ("train", ["strategy=pp", "trainer.accumulate_grad_batches=2"],
                      "set trainer.accumulate_grad_batches=1",
                      ["-trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=1"]),
    "deepspeed-adam": ("train", ["optim=sgd", "strategy=zero2", "strategy.deepspeed_config={adam_json}"],
                       "set optim=adamw", ["-optim=sgd", "optim=adamw"]),
    "fused-fp16-clip": ("plan", [*H100, "optim.fused=true", "hardware.precision=16-mixed"], "use optim.fused=auto",
                        ["-optim.fused=true", "optim.fused=auto"]),
    "fused-fp16-bf16": ("plan", [*H100, "optim.fused=true", "hardware.precision=16-mixed"],
                        "hardware.precision=bf16-mixed", ["-hardware.precision=16-mixed", "hardware.precision=bf16-mixed"]),
    "fused-fp16-noclip": ("plan", [*H100, "optim.fused=true", "hardware.precision=16-mixed"],
                          "~trainer.gradient_clip_val", ["~trainer.gradient_clip_val"]),
    # hardware/checks.py, hardware/machine.py
    "nccl-on-cpu": ("train", ["hardware.backend=nccl"], "set hardware.backend=gloo",
                    ["-hardware.backend=nccl", "hardware.backend=gloo"]),
    "no-bf16": ("plan", [*H100, "hardware.bf16_supported=false", "hardware.precision=bf16-mixed"],
                "set hardware.precision=16-mixed", ["-hardware.precision=bf16-mixed", "hardware.precision=16-mixed"]),
    "no-bf16-fp32": ("plan", [*H100, "hardware.bf16_supported=false", "hardware.precision=bf16-mixed"],
                     "or hardware.precision=32-true", ["-hardware.precision=bf16-mixed", "hardware.precision=32-true"]),
    "nodes-rendezvous": ("plan", ["hardware.num_nodes=2"], "set hardware.rdzv_endpoint=<host of node 0>:29500",
                         ["hardware.rdzv_endpoint=node0:29500"]),
    "nodes-run-id": ("train", ["hardware.num_nodes=2", "hardware.rdzv_endpoint=localhost:29500"],
                     "(e.g. run.id=exp42)", ["run.id=exp42"]),
    "cpu-processes": ("train", ["hardware.devices=64"], "set hardware.devices<=",
                      ["-hardware.devices=64", "hardware.devices=2"]),
    # data/checks.py, compose/hydra_options.py
    "tokenizer-missing": ("train", ["dataset.tokenizer=/nonexistent/tok"], "or dataset.tokenizer=null",
                          ["-dataset.tokenizer=/nonexistent/tok", "dataset.tokenizer=null"]),
    "hydra-launcher": ("plan", ["hydra.launcher.n_jobs=2"], "use hardware.launcher=slurm (hardware=slurm)",
                       ["-hydra.launcher.n_jobs=2", "hardware=slurm"]),
    "hydra-sweep-dir": ("train", ["hydra.sweep.dir=/tmp/x"], "set run.root=DIR and experiment=NAME",
                        ["-hydra.sweep.dir=/tmp/x", "experiment=mine"]),
    "hydra-chdir": ("train", ["hydra.job.chdir=true"], "pass hydra.job.chdir=false",
                    ["-hydra.job.chdir=true", "hydra.job.chdir=false"]),
    # plan/ (exit 3: what would fit)
    "plan-checkpointing": ("plan", ["model=gpt_125m", "hardware=cpu", "dataset.batch_size=512"],
                           "trainer.activation_checkpointing=full would fit", ["trainer.activation_checkpointing=full"]),
    "plan-batch": ("plan", ["model=gpt_125m", "hardware=cpu", "dataset.batch_size=512"],
                   "With strategy=ddp, dataset.batch_size<=95 fits", ["-dataset.batch_size=512", "dataset.batch_size=95"]),
    "plan-strategy": ("plan", [*H100, "model=gpt_7b", "strategy=ddp"], "strategy=zero1 would fit",
                      ["-strategy=ddp", "strategy=zero1"]),
    "plan-strategy-checkpointing": ("plan", [*H100, "model=gpt_7b", "strategy=ddp", "dataset.batch_size=64",
                                             "dataset.seq_len=2048", "model.block_size=2048"],
                                    "strategy=fsdp trainer.activation_checkpointing=full would fit",
                                    ["-strategy=ddp", "strategy=fsdp", "trainer.activation_checkpointing=full"]),
    # models/init_from.py, models/llama_hf.py
    "init-from-gpt2-dir": ("train", ["dataset.seq_len=32", "model.init_from={gpt2w}"],
                           "use model=hf_causal_lm model.config={gpt2w} without model.init_from",
                           ["-model.init_from={gpt2w}", "model=hf_causal_lm", "model.config={gpt2w}"]),
    "init-from-llama-dir": ("train", ["dataset.seq_len=32", "model.init_from={llamaw}"], "use model=llama,",
                            ["model=llama"]),
    "llama-other-arch": ("train", ["dataset.seq_len=32", "model=llama", "model.init_from={gpt2w}"],
                         "use model=hf_causal_lm model.config={gpt2w}",
                         ["-model=llama", "-model.init_from={gpt2w}", "model=hf_causal_lm", "model.config={gpt2w}"]),
    "hydra-run-dir-clock": ("train", ["hydra.run.dir=outputs/${{now:%H}}"], "e.g. hydra.run.dir=runs/exp1",
                            ["-hydra.run.dir=outputs/${{now:%H}}", "hydra.run.dir=runs/exp1"]),
    "rendezvous-format": ("plan", ["hardware.rdzv_endpoint=node0"], "e.g. hardware.rdzv_endpoint=node0.cluster:29500",
                          ["-hardware.rdzv_endpoint=node0", "hardware.rdzv_endpoint=node0.cluster:29500"]),
    "synthetic-shape": ("train", ["dataset=synthetic", "dataset.kind=tensors", "model=mlp", "dataset.shape=[0,4]"],
                        "e.g. dataset.shape='[3,32,32]'", ["-dataset.shape=[0,4]", "dataset.shape=[3,32,32]"]),
    # validate.py (a sweep's trials each need their own run dir; the sweep stops at its first launch)
    "sweep-run-dir": ("train", ["-m", "optim.lr=0.1,0.01", "hydra.run.dir=/tmp/one-dir"], "set run.root=<dir>",
                      ["-hydra.run.dir=/tmp/one-dir"]),
    # tracking/checks.py (no key: the test clears WANDB_API_KEY and NETRC)
    "wandb-online-no-key": ("train", ["tracking=wandb"], "use tracking=offline", ["-tracking=wandb", "tracking=offline"]),
}


def _apply(args: list[str], fix: list[str]) -> list[str]:
    dropped = {f[1:] for f in fix if f.startswith("-")}
    return [a for a in args if a not in dropped] + [f for f in fix if not f.startswith("-")]


@pytest.mark.parametrize("row", list(ROWS))
def test_each_suggestion_when_applied_is_accepted(row, assets, tmp_path, monkeypatch):
    """Mutation caught: advice that names a value the checks then refuse (hf_causal_lm's
    model.vocab_size with its own weights, before model.random_init=true was added), or a
    message that stops proposing its fix."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    verb, bad, advice, fix = ROWS[row]
    advice = advice.format(**assets)
    bad = [a.format(**assets) for a in bad]
    rc, err = loom_cli(tmp_path, verb, *bad)
    assert rc in (2, 3), (rc, err)
    assert advice in err, (advice, err)
    assert "Traceback" not in err, err
    good = _apply(bad, [f.format(**assets) for f in fix])
    rc, err = loom_cli(tmp_path, verb, *good)
    assert rc == ("launched" if verb == "train" else 0), (good, err)


def test_each_new_run_id_suggestion_is_accepted(tmp_path):
    """"set run.id=<new id>" where a run dir already holds this id: a changed config (freeze), a
    lowered trainer.max_steps (extension), a completed run ("Nothing to do", exit 0) and a run
    another launcher holds (lock). Following it reaches the launch. Mutation caught: a suggested
    key the checks refuse, a message that stops naming run.id."""
    import socket
    import subprocess
    import sys

    base = ["dataset=synthetic", "trainer.max_steps=6", "hardware.devices=1", "strategy=single"]
    assert loom_cli(tmp_path, "train", *base, "run.id=r1")[0] == "launched"  # frozen, launch stopped
    run_dir = next((tmp_path / "runs").rglob("r1"))
    for changed in (["optim.lr=0.5"], ["-trainer.max_steps=6", "trainer.max_steps=3"]):
        rc, err = loom_cli(tmp_path, "train", *_apply(base, changed), "run.id=r1")
        assert rc == 2 and "et run.id=<new id>" in err, err
        assert loom_cli(tmp_path, "train", *_apply(base, changed), "run.id=r2" + changed[-1][-1])[0] == "launched"
    holder = subprocess.Popen(  # another launcher holds the run (a lock is per process)
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from loom.rundir.lock import run_lock\n"
         f"with run_lock(Path({str(run_dir)!r}), 'r1'):\n    print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, err = loom_cli(tmp_path, "train", *base, "run.id=r1")
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2 and "already running" in err and "set run.id=<new id>" in err and socket.gethostname() in err, err
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "global_step": 6}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        from loom import cli

        with contextlib.chdir(tmp_path):
            assert cli.main(["train", *base, "run.id=r1", f"run.root={tmp_path / 'runs'}"]) == 0
    assert "Nothing to do. Change an override or set run.id=<new id>" in out.getvalue()
    assert loom_cli(tmp_path, "train", *base, "run.id=r9")[0] == "launched"


def test_a_gpu_profile_on_a_machine_without_gpus_suggests_cpu(tmp_path):
    """`loom train hardware=h100x8` here: "Use hardware=cpu (or hardware=auto)"; both launch."""
    from loom.hardware.machine import visible_gpus

    if visible_gpus():
        pytest.skip("this machine has GPUs: the refusal does not happen")
    rc, err = loom_cli(tmp_path, "train", "hardware=h100x8")
    assert rc == 2 and "Use hardware=cpu (or hardware=auto)" in err, err
    for fix in ("hardware=cpu", "hardware=auto"):
        assert loom_cli(tmp_path, "train", fix)[0] == "launched"
