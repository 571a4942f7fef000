"""hardware=kubernetes: the run as a Kubeflow Trainer TrainJob, tested without a cluster.

In-process: the manifest `loom train ... kubernetes.submit=false` renders (every field the
issue names, read back through the installed kubeflow-trainer-api models), and each bad input
refused with exit 2 before anything is written. One pod simulation (it replaces test_multinode's
two-node loopback run): the rendered TrainJob's command started as two local "pods" with exactly
the PET_* environment the torch-distributed runtime injects (loopback, gloo); one pod is SIGKILLed
after the step-4 checkpoint, the other fails on its next collective, and the job is resubmitted
at one node (`loom train ... hardware.num_nodes=1`): its one pod resumes from the checkpoint at
world 1 (the global batch kept by trainer.global_batch_size) and ends on the single-process curve.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import PARITY, STEPS, refused
from launches import LEDGER

from loom import cli

BASE = ["hardware=kubernetes", "kubernetes.image=registry/loom:1.0", "kubernetes.pvc=shared-runs",
        "kubernetes.submit=false", "model=gpt_tiny"]


def _render(root: Path, *args: str) -> tuple[int, str, Path | None]:
    """`loom train <args>` in this process (render only: no ranks start); its run dir."""
    out = io.StringIO()
    with contextlib.chdir(root), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(["train", *args, f"kubernetes.mount={root}", f"run.root={root}/runs"])
    found = list((root / "runs").glob("*/*/trainjob.yaml"))
    return rc, out.getvalue(), found[0].parent if found else None


def test_the_trainjob_names_the_runtime_nodes_gpus_claim_secret_and_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no kube context: submit=null renders only
    rc, out, run_dir = _render(tmp_path, *[a for a in BASE if a != "kubernetes.submit=false"], "strategy=fsdp",
                               "hardware.num_nodes=4", "kubernetes.namespace=ml", "kubernetes.credentials_from=wandb",
                               "+kubernetes.env.NCCL_DEBUG=WARN", "kubernetes.memory=500Gi", "run.id=big")
    assert rc == 0 and run_dir is not None, out
    assert f"kubectl apply -f {run_dir / 'trainjob.yaml'}" in out
    job = yaml.safe_load((run_dir / "trainjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"], job["metadata"]["namespace"]) == (
        "trainer.kubeflow.org/v1alpha1", "TrainJob", "loom-big", "ml")
    spec, trainer = job["spec"], job["spec"]["trainer"]
    assert spec["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                  "name": "torch-distributed"}
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (4, 8, "registry/loom:1.0")
    assert trainer["command"] == ["python", "-m", "loom.launch.pod", str(run_dir)]
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8", "memory": "500Gi"}
    env = {e["name"]: e for e in trainer["env"]}
    assert env["NCCL_DEBUG"]["value"] == "WARN" and env["WANDB_MODE"]["value"] == "offline"
    assert env["WANDB_API_KEY"] == {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
        "key": "WANDB_API_KEY", "name": "wandb", "optional": False}}}  # from the Secret, never a value
    pod = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["name"] == "node"
    pod_spec = pod["template"]["spec"]["template"]["spec"]
    assert pod_spec["volumes"] == [{"name": "loom-runs", "persistentVolumeClaim": {"claimName": "shared-runs"}}]
    assert pod_spec["containers"] == [{"name": "node", "volumeMounts": [{"mountPath": str(tmp_path),
                                                                         "name": "loom-runs"}]}]
    from loom.launch.kubernetes import read_back

    assert read_back((run_dir / "trainjob.yaml").read_text()) == job  # the installed API models take it whole


@pytest.mark.parametrize("args, says", [
    (["~kubernetes.image"], "kubernetes.image=None"),
    (["kubernetes.pvc=null"], "PersistentVolumeClaim"),
    (["hardware.devices=16", "kubernetes.gpus_per_node=8"], "the nodes have 8"),
    (["kubernetes.credentials_from=wandb", "+kubernetes.env.WANDB_API_KEY=${oc.env:HOME}"],
     "also read from the Secret kubernetes.credentials_from=wandb"),
    (["+kubernetes.env.PET_NNODES=3"], "the rendezvous the runtime injects"),
    (["kubernetes.submit=true"], "no kube context is configured here"),
])
def test_bad_kubernetes_inputs_are_refused_before_anything_is_written(args, says, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    base = [a for a in BASE if not (args[0].startswith("~kubernetes.image") and a.startswith("kubernetes.image"))]
    base = [a for a in base if not (a == "kubernetes.submit=false" and "kubernetes.submit=true" in args)]
    err = refused(tmp_path, *base, *[a for a in args if not a.startswith("~")], f"kubernetes.mount={tmp_path}")
    assert says in err, err


def test_a_run_root_off_the_claim_is_refused(tmp_path):
    err = refused(tmp_path, *BASE, "kubernetes.mount=/mnt/claim")
    assert "must be on the claim, mounted at kubernetes.mount=/mnt/claim" in err and "run.root=/mnt/claim/" in err


def test_with_a_kube_context_it_submits_and_says_when_the_cluster_is_unreachable(tmp_path, monkeypatch):
    """A kubeconfig's current context makes submit=null submit, through the real Kubernetes client;
    an API server that refuses connections exits 1 naming the context and the manifest to apply."""
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": f"https://127.0.0.1:{_free_port()}"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "me"}}],
        "users": [{"name": "me", "user": {}}]}))
    monkeypatch.setenv("KUBECONFIG", str(config))
    rc, out, run_dir = _render(tmp_path, *[a for a in BASE if a != "kubernetes.submit=false"], "run.id=lab")
    assert rc == 1 and run_dir is not None, out
    assert "could not reach the cluster of kube context lab to create TrainJob loom-lab" in out, out
    assert f"kubectl apply -f {run_dir / 'trainjob.yaml'}" in out and not (run_dir / "kubernetes.json").exists()


# ----------------------------------------------------------------------------- pod simulation


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_pods(run_dir: Path) -> list[subprocess.Popen]:
    """The TrainJob's pods as local processes: its command, its env, and the PET_* rendezvous the
    torch-distributed runtime injects (node 0's address as master), each in its own session."""
    trainer = yaml.safe_load((run_dir / "trainjob.yaml").read_text())["spec"]["trainer"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **{e["name"]: e["value"] for e in trainer["env"] if "value" in e}}
    port, n = _free_port(), trainer["numNodes"]
    pods = []
    for node in range(n):
        pet = {"PET_NNODES": str(n), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]), "PET_NODE_RANK": str(node),
               "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
        LEDGER.record(1, args=tuple(trainer["command"]))
        pods.append(subprocess.Popen(trainer["command"], env={**env, **pet}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return pods


def _wait(pods: list[subprocess.Popen], timeout: float) -> list[str]:
    outs = []
    for p in pods:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in pods:
                os.killpg(q.pid, signal.SIGKILL)
            raise
    return outs


@pytest.mark.launch
@pytest.mark.slow
def test_pods_train_lose_one_and_resume_on_fewer_nodes(tmp_path, single_run):
    args = [*(a for a in PARITY if a != "hardware=cpu"), *BASE, "hardware.accelerator=cpu", "hardware.devices=1",
            "dataset.batch_size=4", "trainer.global_batch_size=8", "checkpoint.every_n_steps=4",
            "hardware.max_restarts=0", "hardware.timeout_train_s=60", "hardware.hang_timeout_s=0",
            f"kubernetes.python={sys.executable}", "run.id=pods"]
    rc, out, run_dir = _render(tmp_path, *args, "hardware.num_nodes=2")
    assert rc == 0 and run_dir is not None, out
    pods = _start_pods(run_dir)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "step-0000004.ckpt").exists():
        assert all(p.poll() is None for p in pods), "a pod exited early:\n" + "\n".join(_wait(pods, 60))
        assert time.monotonic() < deadline, "no step-4 checkpoint"
        time.sleep(0.05)
    os.killpg(pods[1].pid, signal.SIGKILL)  # the pod is gone: its agent and rank with it
    outs = _wait(pods, timeout=600)
    assert pods[0].returncode != 0, outs[0]  # the survivor's collective failed: the job failed
    assert "node rank 0 of 2 x 1 process(es); rendezvous at 127.0.0.1" in outs[0], outs[0]

    # the job resubmitted at one node: the same command re-freezes the run at world 1
    rc, out, again = _render(tmp_path, *args, "hardware.num_nodes=1")
    assert rc == 0 and again == run_dir, out
    assert yaml.safe_load((run_dir / "trainjob.yaml").read_text())["spec"]["trainer"]["numNodes"] == 1
    (pod,) = _start_pods(run_dir)
    (log,) = _wait([pod], timeout=300)
    assert pod.returncode == 0, log
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["global_step"] == STEPS and s["resumed_from_step"] >= 4
    assert [h["world_size"] for h in s["world_history"]][0] == 2 and s["world_history"][-1]["world_size"] == 1
    got, ref = _losses(run_dir), single_run.losses()
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = max(abs(got[k] - ref[k]) for k in ref)
    assert worst < 1e-4, (worst, got, ref)  # the same global batch each step, in another summation order


def _losses(run_dir: Path) -> dict[int, float]:
    import csv

    rows = csv.DictReader(open(run_dir / "metrics.csv"))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def test_an_inline_credential_is_refused_with_advice_that_is_accepted(tmp_path, monkeypatch):
    """A literal WANDB_API_KEY in kubernetes.env: the refusal names kubernetes.credentials_from (it
    used to suggest ${oc.env:...}, which the launcher then refused as inline too); following it renders."""
    monkeypatch.setenv("HOME", str(tmp_path))
    err = refused(tmp_path, *BASE, "+kubernetes.env.WANDB_API_KEY=0123456789abcdef0123456789abcdef",
                  f"kubernetes.mount={tmp_path}")
    assert "drop kubernetes.env.WANDB_API_KEY and set kubernetes.credentials_from=<Secret name>" in err, err
    assert "oc.env" not in err
    rc, out, run_dir = _render(tmp_path, *BASE, "kubernetes.credentials_from=wandb-secret")
    assert rc == 0 and run_dir is not None, out
