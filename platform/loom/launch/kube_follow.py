"""hardware.launcher=kubernetes's submit: render the TrainJob (loom.launch.kubernetes), then create
it with the Kubernetes client and follow it to the run's outcome, or print the kubectl command.

The run dir is on the claim this machine mounts too, so Loom follows the run as it follows any
launch: rank 0's log (`logs/rank-0.log`) is echoed as it grows, the TrainJob's conditions are
polled, and once it is Complete or Failed the exit code comes from summary.json (0 completed,
143 preempted, 1 otherwise). Ctrl-C (SIGINT) suspends the TrainJob: its pods get SIGTERM and the
ranks checkpoint within terminationGracePeriodSeconds; the same `loom train` command resubmits and
resumes. `<run>/kubernetes.json` names the job; a second `loom train` of the run while it is
active exits 2 (`active_job`). Not tried against a real cluster yet (docs/scaling-out.md).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, ConfigError
from loom.launch.kubernetes import GROUP, PLURAL, VERSION, job_name, kube_context, submits, write_manifest
from loom.rundir.paths import RunDir
from loom.rundir.summary import read_summary

POLL_S = 5.0
DONE = ("Complete", "Failed")


def submit(cfg: DictConfig, run_dir: Path, dry_run: bool = False) -> int:
    """Render, then create and follow the TrainJob (or print the kubectl command). A run whose
    TrainJob is still active is refused before its manifest is rewritten."""
    name, ns = job_name(str(cfg.run.id)), cfg.kubernetes.namespace
    submitting = not dry_run and submits(cfg)
    running = active_job(cfg, run_dir) if submitting else None
    if running:
        raise ConfigError(f"Invalid config: run {cfg.run.id} is running as TrainJob {running} in namespace {ns} "
                          f"({run_dir}); two jobs must not train one run dir. Wait for it, or stop it "
                          f"(`kubectl patch trainjob {running} -n {ns} --type merge -p '{{\"spec\":{{\"suspend\":true}}}}'`: "
                          "the ranks checkpoint) and run this command again to resume")
    path = write_manifest(cfg, run_dir)
    if not submitting:
        print(f"Rendered TrainJob {name} (namespace {ns}): {path}\nSubmit it with: kubectl apply -f {path}\n"
              f"Follow it with: kubectl get trainjob {name} -n {ns} -w", flush=True)
        return EXIT_OK
    return create_and_follow(cfg, run_dir, path)


def _apis():
    from kubernetes import client, config

    if kube_context() == "in-cluster":
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.CustomObjectsApi()


def _conditions(job: dict[str, Any]) -> dict[str, str]:
    return {c.get("type"): c.get("status") for c in (job.get("status") or {}).get("conditions") or []}


def active_job(cfg: DictConfig, run_dir: Path) -> str | None:
    """The TrainJob this run dir was submitted as, while it exists and has not finished."""
    record = RunDir(run_dir).kubernetes
    if not record.exists() or kube_context() is None:
        return None
    from kubernetes.client.exceptions import ApiException

    known = json.loads(record.read_text())
    try:
        job = _apis().get_namespaced_custom_object(GROUP, VERSION, known["namespace"], PLURAL, known["name"])
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    except Exception as e:  # noqa: BLE001 - unreachable: whether the job runs is unknown, so no second one
        raise ConfigError(f"Invalid config: this run was submitted as TrainJob {known['name']} (namespace "
                          f"{known['namespace']}, {record}), and the cluster of kube context {kube_context()} "
                          f"cannot be reached to tell whether it still runs ({type(e).__name__}); two jobs must "
                          "not train one run dir. Retry once it is reachable.") from None
    return None if any(_conditions(job).get(c) == "True" for c in DONE) else known["name"]


def create_and_follow(cfg: DictConfig, run_dir: Path, manifest: Path) -> int:
    import yaml
    from kubernetes.client.exceptions import ApiException

    name, ns = job_name(str(cfg.run.id)), str(cfg.kubernetes.namespace)
    api = _apis()
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, yaml.safe_load(manifest.read_text()))
    except ApiException as e:
        if e.status != 409:
            print(f"loom: the cluster refused TrainJob {name} ({e.status} {e.reason}): {e.body}", flush=True)
            return EXIT_FAILED
        print(f"loom: TrainJob {name} already exists in namespace {ns}: following it", flush=True)
    except Exception as e:  # noqa: BLE001 - the API server unreachable (urllib3's MaxRetryError, TLS, DNS)
        print(f"loom: could not reach the cluster of kube context {kube_context()} to create TrainJob {name}: "
              f"{type(e).__name__}: {e}\nThe manifest is {manifest}: `kubectl apply -f {manifest}` once the "
              "cluster is reachable, or the same `loom train` command again.", flush=True)
        return EXIT_FAILED
    RunDir(run_dir).kubernetes.write_text(json.dumps({"name": name, "namespace": ns}))
    print(f"loom: TrainJob {name} submitted to namespace {ns} ({manifest}); Ctrl-C stops it (the ranks "
          f"checkpoint)", flush=True)
    return _follow(api, name, ns, run_dir)


def _follow(api, name: str, ns: str, run_dir: Path) -> int:
    stop: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
    log, offset, seen = RunDir(run_dir).log(0), 0, {}
    try:
        while True:
            if stop and stop[0] > 0:
                api.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, {"spec": {"suspend": True}})
                print(f"loom: TrainJob {name} suspended: its pods stop and the ranks checkpoint", flush=True)
                stop[0] = -1
            if log.exists():
                with log.open() as f:
                    f.seek(offset)
                    print(f.read(), end="", flush=True)
                    offset = f.tell()
            conditions = _conditions(api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name))
            for kind, status in conditions.items():
                if seen.get(kind) != status:
                    print(f"loom: TrainJob {name}: {kind}={status}", flush=True)
            seen = conditions
            if any(conditions.get(c) == "True" for c in DONE) or (stop and conditions.get("Suspended") == "True"):
                break
            time.sleep(POLL_S)
    finally:
        signal.signal(signal.SIGINT, previous)
    status = (read_summary(run_dir) or {}).get("status")
    return EXIT_OK if status == "completed" else EXIT_PREEMPTED if status == "preempted" or stop else EXIT_FAILED
