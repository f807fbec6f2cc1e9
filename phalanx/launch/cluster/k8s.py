"""`phalanx cluster k8s`: Kubernetes manifests that run one phalanx node agent per pod.

The primary form is an Indexed Job with a headless Service, because it needs nothing installed in the
cluster beyond Kubernetes itself (1.31+, where podFailurePolicy is GA): a JobSet, a Kubeflow PyTorchJob
or a KubeRay RayJob each need their controller installed and kept at a matching version, and would add
their own restart logic on top of the node agent's. Here the pieces map one to one onto what phalanx
already does: the completion index is the node rank, pod 0's stable DNS name (`NAME-0.NAME`, from the
Service) is the rendezvous endpoint, the node agent restarts ranks inside its pod, and the Job's
podFailurePolicy, generated from phalanx/errors.py EXIT_CODES, decides which agent exits replace the
pod and which fail the job.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from phalanx.config.schema import Config
from phalanx.errors import PhalanxError
from phalanx.launch.cluster.exit_policy import exit_policy

VENDORS = {"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu"}  # each device plugin's resource name
RUNS_MOUNT = "/runs"  # the shared volume: run directories, checkpoints, the prepared-data cache
CONFIG_MOUNT = "/etc/phalanx"
CONFIG_KEY = "phalanx.yaml"
CONTAINER = "node-agent"
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
# The agent stops its ranks on SIGTERM and exits 143; this is how long Kubernetes waits for that.
GRACE_S = 120

MANIFESTS = ("configmap.yaml", "service.yaml", "pvc.yaml", "job.yaml")
DOCKERFILE = "Dockerfile"

DOCKERFILE_TEXT = """\
# The image for `phalanx cluster k8s`, built from the phalanx source tree (the repository root):
#   docker build -f {out}/Dockerfile --build-arg VENDOR={vendor} -t IMAGE .
# VENDOR picks the base: AMD (ROCm) or NVIDIA (CUDA), each a PyTorch image whose torch build phalanx
# keeps (pip adds only what is missing). Override the bases to pin versions:
#   --build-arg ROCM_BASE=rocm/pytorch:<tag>  --build-arg CUDA_BASE=pytorch/pytorch:<tag>
ARG VENDOR={vendor}
ARG ROCM_BASE=rocm/pytorch:latest
ARG CUDA_BASE=pytorch/pytorch:latest
FROM ${{ROCM_BASE}} AS base-amd
FROM ${{CUDA_BASE}} AS base-nvidia
FROM base-${{VENDOR}}
ENV PYTHONUNBUFFERED=1
WORKDIR /opt/phalanx
COPY pyproject.toml README.md ./
COPY phalanx ./phalanx
# Every extra that installs anywhere: the pods record to a run store (often PostgreSQL) and may serve.
RUN python -m pip install --no-cache-dir '.[all]' && phalanx --help >/dev/null
"""


def check_options(image: str, vendor: str, shm_size: str, volume_size: str, port: int) -> None:
    if not image or any(c.isspace() for c in image):
        raise PhalanxError(f"--image must be an image reference such as registry/phalanx:tag, not {image!r}")
    if vendor not in VENDORS:
        raise PhalanxError(f"--vendor must be {' or '.join(VENDORS)}, not {vendor!r}")
    for option, value in (("--shm-size", shm_size), ("--volume-size", volume_size)):
        if not QUANTITY.match(value):
            raise PhalanxError(f"{option} must be a Kubernetes quantity such as 16Gi, not {value!r}")
    if not 1024 <= port < 65536:
        raise PhalanxError(f"--port must be between 1024 and 65535, not {port}")


def pod_config(config: Config) -> Config:
    """The config as the pods see it: the runs root on the shared volume."""
    return config.model_copy(update={"run": config.run.model_copy(update={"dir": Path(RUNS_MOUNT)})})


def local_paths(config: Config) -> list[str]:
    """Paths in the config that name this machine's files, which the pods see only if they are in the
    image or on the shared volume at the same path."""
    paths = [s for s in config.data.sources if not s.startswith("builtin:")]
    paths += [config.data.tokenizer] if config.data.tokenizer else []
    return [p for p in paths if not p.startswith(RUNS_MOUNT + "/")]


def manifests(
    config: Config,
    config_yaml: str,
    name: str,
    nodes: int,
    gpus_per_node: int,
    image: str,
    vendor: str,
    shm_size: str,
    volume_size: str,
    storage_class: str | None,
    port: int,
    max_requeues: int,
) -> dict[str, dict[str, Any]]:
    """File name -> manifest. `config` is the pod config (pod_config) and `config_yaml` its text."""
    policy = exit_policy()
    labels = {"app.kubernetes.io/name": "phalanx", "app.kubernetes.io/instance": name}
    head = f"{name}-0.{name}"  # pod 0's hostname under the headless Service: the rendezvous host
    mounts = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "runs", "mountPath": RUNS_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    node_agent = {
        "name": CONTAINER,
        "image": image,
        "command": [
            "phalanx",
            "train",
            f"{CONFIG_MOUNT}/{CONFIG_KEY}",
            "--nnodes",
            str(nodes),
            "--nproc",
            str(gpus_per_node),
            "--node-rank",
            "$(NODE_RANK)",
            "--rdzv-endpoint",
            f"{head}:{port}",
        ],
        "env": [
            {
                "name": "NODE_RANK",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                },
            },
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "ports": [{"name": "rdzv", "containerPort": port}],
        "resources": {"limits": {VENDORS[vendor]: gpus_per_node}},
        "volumeMounts": mounts,
    }
    # Pod 0 is told apart from the others by resolving its own DNS name: wait until the Service
    # publishes it, or pod 0 would not know it hosts the rendezvous and fail to join it (exit 5).
    wait_dns = {
        "name": "wait-for-rendezvous-host",
        "image": image,
        "command": ["sh", "-c", f"until getent hosts {head} >/dev/null; do sleep 1; done"],
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            # One lost node usually takes every agent down with it (the others fail to re-form: exit 5),
            # so each requeue may cost a failed pod per node.
            "backoffLimit": max_requeues * nodes,
            "podFailurePolicy": {
                "rules": [
                    # Running again cannot fix these (bad input, a crash loop, a bad node): fail the Job.
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": list(policy.never)},
                    },
                    # Preemption, eviction, a drained node: replace the pod without counting it.
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    # Every other failure (the requeue codes of the table: a lost peer, the store, a signal)
                    # replaces the pod and counts against backoffLimit; the agents resume from the newest
                    # checkpoint on the shared volume.
                ]
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",  # the node agent restarts ranks; podFailurePolicy the pod
                    "subdomain": name,
                    "terminationGracePeriodSeconds": GRACE_S,
                    "initContainers": [wait_dns],
                    "containers": [node_agent],
                    "volumes": [
                        {"name": "config", "configMap": {"name": f"{name}-config"}},
                        {"name": "runs", "persistentVolumeClaim": {"claimName": f"{name}-runs"}},
                        # NCCL/RCCL move intra-node traffic through /dev/shm and the heartbeat board
                        # lives there; the data loader reads memory-mapped shards in each rank. The
                        # runtime's default 64 MiB is far too small for that.
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "clusterIP": "None",
            "selector": labels,
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rdzv", "port": port, "targetPort": port}],
        },
    }
    claim: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": volume_size}}}
    if storage_class:
        claim["storageClassName"] = storage_class
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{name}-runs", "labels": labels},
        "spec": claim,
    }
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "labels": labels},
        "data": {CONFIG_KEY: config_yaml},
    }
    return {"configmap.yaml": configmap, "service.yaml": service, "pvc.yaml": pvc, "job.yaml": job}


HEADERS = {
    "configmap.yaml": "The resolved run config every pod trains from (run.dir on the shared volume).",
    "service.yaml": "Headless Service: gives pod 0 a stable DNS name, the rendezvous host.",
    "pvc.yaml": "The shared volume (ReadWriteMany): run directories and checkpoints every node reads.",
    "job.yaml": "Indexed Job: pod i runs the node agent of node rank i; see phalanx/launch/cluster/k8s.py "
    "for why this form.",
}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config in the ConfigMap) as readable literal blocks, and every repeated
    value (the labels) written out rather than as a YAML alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None),
)


def write(out: Path, files: dict[str, dict[str, Any]], vendor: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, manifest in files.items():
        path = out / file_name
        header = f"# Written by `phalanx cluster k8s`. {HEADERS[file_name]}\n"
        path.write_text(header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=100))
        written.append(path)
    dockerfile = out / DOCKERFILE
    dockerfile.write_text(DOCKERFILE_TEXT.format(out=out, vendor=vendor))
    return written + [dockerfile]
