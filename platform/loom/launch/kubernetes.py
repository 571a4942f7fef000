"""hardware.launcher=kubernetes: the frozen run as one Kubeflow Trainer v2 `TrainJob`.

`loom train` freezes the run dir on shared storage (the PersistentVolumeClaim `kubernetes.pvc`,
mounted at `kubernetes.mount` here and in every pod), then builds the TrainJob with the
`kubeflow-trainer-api` models: it references `kubernetes.runtime` (the stock torch-distributed
ClusterTrainingRuntime, which starts `numNodes` pods and injects the PET_* rendezvous torchrun
reads), asks each pod for `hardware.devices` GPUs, mounts the claim through a runtime patch of the
runtime's `node` container, takes credentials from a Secret by name (never inlined), and runs
`python -m loom.launch.pod <run dir>` (loom.launch.pod: Loom's torchrun agent on that rendezvous).
The manifest is written to `<run>/trainjob.yaml` and read back through the same models before
anything is submitted. With a kube context (or `kubernetes.submit=true`) the Kubernetes client
creates it and Loom follows it (`loom.launch.kube_follow.submit`); otherwise it prints the kubectl
command.

Every check here exits 2 before anything is written or submitted (`check`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.redaction import is_secret_key
from loom.rundir.paths import RunDir

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
NODE = "node"        # the torch-distributed runtime's replicated job and container
VOLUME = "loom-runs"
MANIFEST = RunDir.trainjob.rel
# What the runtime injects for torchrun (and torchrun's own variables): a pod env may not set them.
PET_KEYS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
RESERVED = (*PET_KEYS, "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def kube_context() -> str | None:
    """The kube context `submit` would use: in-cluster, or kubeconfig's current-context (None: none).
    Read without the Kubernetes client (the first second of the CLI imports nothing heavy)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
        return "in-cluster"
    import yaml

    for path in (os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")).split(os.pathsep):
        try:
            current = (yaml.safe_load(Path(path).read_text()) or {}).get("current-context")
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if current:
            return str(current)
    return None


def submits(cfg: DictConfig) -> bool:
    """kubernetes.submit, or (null) whether a kube context is configured."""
    want = cfg.kubernetes.submit
    return bool(kube_context()) if want is None else bool(want)


def _refuse(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"Invalid config: {key}={value} (hardware.launcher=kubernetes): {why}.")


def check(cfg: DictConfig, dry_run: bool = False) -> None:
    """The TrainJob's inputs, before anything is frozen or submitted (exit 2)."""
    k, hw = cfg.kubernetes, cfg.hardware
    if not k.image:
        _refuse("kubernetes.image", None, "the pods need a container image with Loom installed; set "
                "kubernetes.image=<registry>/<image>:<tag>")
    if not k.pvc:
        _refuse("kubernetes.pvc", None, "the run dir lives on a PersistentVolumeClaim every pod mounts; set "
                "kubernetes.pvc=<claim name> (and kubernetes.mount, where it is mounted)")
    mount, root = Path(str(k.mount)), Path(str(cfg.run.root)).absolute()
    if not mount.is_absolute() or not root.is_relative_to(mount):
        _refuse("run.root", cfg.run.root, f"the run dir must be on the claim, mounted at kubernetes.mount={k.mount} "
                f"in every pod and here, but run.root is {root}; set run.root={mount}/<dir>")
    per_node = k.gpus_per_node or hw.devices
    if hw.accelerator == "gpu" and hw.devices > per_node:
        _refuse("hardware.devices", hw.devices, f"a pod would ask {hw.devices} {k.gpu_resource} but the nodes "
                f"have {per_node} (kubernetes.gpus_per_node); set hardware.devices<={per_node}")
    clash = sorted(key for key in k.env if key in RESERVED)
    if clash:
        _refuse(f"kubernetes.env.{clash[0]}", k.env[clash[0]], f"{', '.join(clash)} are the rendezvous the "
                f"runtime injects ({', '.join(PET_KEYS)}) or torchrun's own; set hardware.num_nodes and "
                "hardware.devices instead")
    inline = sorted(key for key in k.env if key in k.credential_keys or is_secret_key(key))
    if inline:
        also = (f"it is also read from the Secret kubernetes.credentials_from={k.credentials_from}"
                if k.credentials_from and inline[0] in k.credential_keys else "it would be written into the manifest")
        _refuse(f"kubernetes.env.{inline[0]}", "<hidden>", f"{also}; credentials reach the pods from a Secret "
                "only: kubernetes.credentials_from=<Secret name> with kubernetes.credential_keys=[...] naming its "
                "keys, and remove it from kubernetes.env")
    if k.submit is True and not dry_run and kube_context() is None:
        _refuse("kubernetes.submit", True, "no kube context is configured here (no KUBECONFIG or ~/.kube/config "
                "current-context, not in a pod); configure one, or set kubernetes.submit=false to only render "
                f"<run>/{MANIFEST} for `kubectl apply -f`")


def job_name(run_id: str) -> str:
    """A DNS-1123 label from the run id: lower case, `-`, at most 40 characters (JobSet adds suffixes)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"loom-{run_id}".lower()).strip("-")
    return name[:40].rstrip("-")


def _env(cfg: DictConfig) -> list:
    from kubeflow_trainer_api import models as m

    k = cfg.kubernetes
    plain = {"PYTHONUNBUFFERED": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), **k.env}
    env = [m.IoK8sApiCoreV1EnvVar(name=key, value=str(value)) for key, value in plain.items()]
    if k.credentials_from:
        env += [m.IoK8sApiCoreV1EnvVar(name=key, value_from=m.IoK8sApiCoreV1EnvVarSource(
            secret_key_ref=m.IoK8sApiCoreV1SecretKeySelector(name=k.credentials_from, key=key, optional=False)))
            for key in k.credential_keys]
    return env


def _resources(cfg: DictConfig):
    from kubeflow_trainer_api import models as m

    k, hw = cfg.kubernetes, cfg.hardware
    asked = {k.gpu_resource: hw.devices} if hw.accelerator == "gpu" else {}
    asked.update({name: value for name, value in (("cpu", k.cpu), ("memory", k.memory)) if value})
    quantities = {name: m.IoK8sApimachineryPkgApiResourceQuantity(actual_instance=str(v)) for name, v in asked.items()}
    return m.IoK8sApiCoreV1ResourceRequirements(limits=quantities or None, requests=quantities or None)


def _mount_patch(cfg: DictConfig):
    """The claim mounted at kubernetes.mount in the runtime's `node` pods (a runtime patch)."""
    from kubeflow_trainer_api import models as m

    k = cfg.kubernetes
    pod = m.TrainerV1alpha1PodSpecPatch(
        volumes=[m.IoK8sApiCoreV1Volume(name=VOLUME, persistent_volume_claim=m.IoK8sApiCoreV1PersistentVolumeClaimVolumeSource(
            claim_name=k.pvc))],
        containers=[m.TrainerV1alpha1ContainerPatch(name=NODE, volume_mounts=[
            m.IoK8sApiCoreV1VolumeMount(name=VOLUME, mount_path=str(k.mount))])],
        termination_grace_period_seconds=int(k.termination_grace_s))
    job = m.TrainerV1alpha1JobTemplatePatch(spec=m.TrainerV1alpha1JobSpecPatch(
        template=m.TrainerV1alpha1PodTemplatePatch(spec=pod)))
    return m.TrainerV1alpha1RuntimePatch(manager="loom", training_runtime_spec=m.TrainerV1alpha1TrainingRuntimeSpecPatch(
        template=m.TrainerV1alpha1JobSetTemplatePatch(spec=m.TrainerV1alpha1JobSetSpecPatch(
            replicated_jobs=[m.TrainerV1alpha1ReplicatedJobPatch(name=NODE, template=job)]))))


def pod_command(cfg: DictConfig, run_dir: Path | str) -> list[str]:
    """What every pod runs: Loom's pod entry on the frozen run dir (loom.launch.pod)."""
    return [str(cfg.kubernetes.python), "-m", "loom.launch.pod", str(run_dir)]


def trainjob(cfg: DictConfig, run_dir: Path):
    """The TrainJob of the frozen run in `run_dir`, as the kubeflow-trainer-api models."""
    from kubeflow_trainer_api import models as m

    k, hw = cfg.kubernetes, cfg.hardware
    meta = m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
        name=job_name(str(cfg.run.id)), namespace=str(k.namespace),
        labels={"app.kubernetes.io/managed-by": "loom"}, annotations={"loom/run-dir": str(run_dir)})
    trainer = m.TrainerV1alpha1Trainer(image=str(k.image), command=pod_command(cfg, run_dir), num_nodes=int(hw.num_nodes),
                                       num_proc_per_node=int(hw.devices), resources_per_node=_resources(cfg),
                                       env=_env(cfg))
    spec = m.TrainerV1alpha1TrainJobSpec(runtime_ref=m.TrainerV1alpha1RuntimeRef(
        name=str(k.runtime), api_group=GROUP, kind="ClusterTrainingRuntime"), trainer=trainer,
        runtime_patches=[_mount_patch(cfg)])
    return m.TrainerV1alpha1TrainJob(api_version=f"{GROUP}/{VERSION}", kind="TrainJob", metadata=meta, spec=spec)


def render(job) -> str:
    import yaml

    return yaml.safe_dump(job.to_dict(), sort_keys=False)


def read_back(text: str) -> dict[str, Any]:
    """The manifest parsed through the installed API models; what they drop or change is an error."""
    import yaml
    from kubeflow_trainer_api import models as m

    data = yaml.safe_load(text)
    parsed = m.TrainerV1alpha1TrainJob.from_dict(data).to_dict()
    if json.dumps(parsed, sort_keys=True) != json.dumps(data, sort_keys=True):
        raise ConfigError(f"Invalid config: the rendered {MANIFEST} does not read back through the installed "
                          "kubeflow-trainer-api models unchanged (a field this API version does not have)")
    return parsed


def write_manifest(cfg: DictConfig, run_dir: Path) -> Path:
    """<run>/trainjob.yaml, validated against the API models before it is written."""
    from loom.atomic import atomic_write_text

    text = render(trainjob(cfg, run_dir))
    read_back(text)
    path = RunDir(run_dir).trainjob
    atomic_write_text(path, text)
    return path
