"""`phalanx cluster k8s`: every manifest, for both vendors, against the official Kubernetes schemas
offline (kubernetes-validate, strict: an unknown field fails), and what the pods would run: `phalanx
train` with the rendezvous at pod 0's Service name, parsed by the real command line."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import typer
import yaml

from phalanx.config.loader import load_config
from phalanx.errors import EXIT_CODES
from tests.helpers import phalanx

ROOT = Path(__file__).resolve().parents[2]
# The oldest Kubernetes with podFailurePolicy generally available, and the newest the package knows.
VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
NODES, GPUS = 2, 4


def write_manifests(args, out: Path, vendor: str, *options: str) -> dict:
    proc = phalanx(
        "cluster",
        "k8s",
        *args,
        "--nodes",
        str(NODES),
        "--gpus-per-node",
        str(GPUS),
        "--image",
        "registry.example/phalanx:0.1",
        "--vendor",
        vendor,
        "--out",
        str(out),
        *options,
        "--json",
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["amd", "nvidia"])
def written(request, tmp_path_factory, corpus):
    from tests.conftest import TINY

    out = tmp_path_factory.mktemp(f"k8s-{request.param}")
    # 2 nodes x 4 GPUs: the 8 sequences of the global batch, one a rank.
    args = TINY + [f"data.sources=[{corpus}]", "run.name=K8s_Run.1", "train.micro_batch_size=null"]
    report = write_manifests(args, out, request.param)
    docs = {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}
    return request.param, out, report, docs, args


def kinds(docs):
    return {d["kind"]: d for d in docs.values()}


def test_every_manifest_is_valid_kubernetes(written):
    _, out, report, docs, _ = written
    assert set(report["files"]) == set(docs) | {"Dockerfile"}
    assert set(kinds(docs)) == {"ConfigMap", "Service", "PersistentVolumeClaim", "Job"}
    for doc in docs.values():
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error


def test_the_validator_does_fail_on_a_wrong_manifest(written):
    job = kinds(written[3])["Job"]
    broken = json.loads(json.dumps(job))
    broken["spec"]["template"]["spec"]["containers"][0]["gpus"] = GPUS
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


def test_the_pods_run_phalanx_train_rendezvousing_at_pod_zero(written):
    vendor, _, report, docs, _ = written
    k = kinds(docs)
    job, service = k["Job"], k["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert report["job"] == job["metadata"]["name"] == "k8s-run-1"  # run.name as a DNS label
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == NODES
    # Pod i is host NAME-i under the headless Service: pod 0's name is the rendezvous host.
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["publishNotReadyAddresses"] is True
    (agent,) = pod["containers"]
    command = agent["command"]
    assert command[:2] == ["phalanx", "train"]
    port = service["spec"]["ports"][0]["port"]
    assert agent["ports"][0]["containerPort"] == port
    head = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    # The node rank is the completion index, as Kubernetes expands $(NODE_RANK) from the pod's env.
    (rank_env,) = [e for e in agent["env"] if e["name"] == "NODE_RANK"]
    assert (
        rank_env["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert pod["initContainers"][0]["command"][-1].startswith(f"until getent hosts {head} ")

    from phalanx.cli import app  # the real command line parses what the pod would run

    train = typer.main.get_command(app).commands["train"]
    for index in range(NODES):
        argv = [a.replace("$(NODE_RANK)", str(index)) for a in command[2:]]
        params = train.make_context("train", argv).params
        assert params["nnodes"] == str(NODES) and params["nproc"] == GPUS and params["node_rank"] == index
        assert params["rdzv_endpoint"] == f"{head}:{port}"
        assert list(params["args"]) == ["/etc/phalanx/phalanx.yaml"]
    assert agent["resources"]["limits"] == {{"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu"}[vendor]: GPUS}


def test_volumes_config_and_shared_memory(written, tmp_path):
    _, _, _, docs, args = written
    k = kinds(docs)
    pod = k["Job"]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["dshm"] == "/dev/shm"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{2 * GPUS}Gi"}
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == k["PersistentVolumeClaim"]["metadata"]["name"]
    assert k["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volumes["config"]["configMap"]["name"] == k["ConfigMap"]["metadata"]["name"]
    # The ConfigMap's config is the one the command names, at the path it names, and loads as the
    # user's config with the runs root on the shared volume.
    config_path = Path(agent["command"][2])
    assert str(config_path.parent) == mounts["config"]
    shipped = tmp_path / config_path.name
    shipped.write_text(k["ConfigMap"]["data"][config_path.name])
    pod_config, own = load_config(shipped), load_config(None, args)
    assert pod_config.run_dir == Path(mounts["runs"]) / "K8s_Run.1"
    assert pod_config.model_dump(exclude={"run"}) == own.model_dump(exclude={"run"})


def test_the_failure_policy_follows_the_exit_code_table(written):
    job = kinds(written[3])["Job"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # the node agent restarts ranks; the Job policy the pod
    rules = job["spec"]["podFailurePolicy"]["rules"]
    (fail,) = [r for r in rules if r["action"] == "FailJob"]
    assert fail["onExitCodes"]["containerName"] == pod["containers"][0]["name"]
    never = {int(e.code) for e in EXIT_CODES if e.code.isdigit() and e.code != "0" and not e.requeue}
    again = {int(e.code) for e in EXIT_CODES if e.code.isdigit() and e.requeue}
    assert set(fail["onExitCodes"]["values"]) == never and {2, 3, 6} <= never and {4, 5} <= again
    assert fail["onExitCodes"]["operator"] == "In"
    # Preemption and eviction replace the pod without using up the job's retries.
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert job["spec"]["backoffLimit"] == 5 * NODES


def test_the_dockerfile_builds_from_the_source_tree_on_either_base(written):
    vendor, out, *_ = written
    text = (out / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert f"ARG VENDOR={vendor}" in lines
    assert any(line.startswith("ARG ROCM_BASE=rocm/") for line in lines)
    assert any(line.startswith("ARG CUDA_BASE=") for line in lines)
    assert "FROM ${ROCM_BASE} AS base-amd" in lines and "FROM ${CUDA_BASE} AS base-nvidia" in lines
    assert "FROM base-${VENDOR}" in lines
    for line in lines:  # everything it copies is in the repository it is built from
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source


@pytest.mark.parametrize(
    "options, message",
    [
        (["--vendor", "intel"], "--vendor must be amd or nvidia"),
        (["--shm-size", "lots"], "--shm-size must be a Kubernetes quantity"),
        (["--image", "my image"], "--image must be an image reference"),
        (["--nodes", "3"], "must be a multiple of the 12 data-parallel ranks"),
    ],
)
def test_bad_options_get_one_line_and_exit_2(tiny_args, tmp_path, options, message):
    argv = [
        "cluster",
        "k8s",
        *tiny_args,
        "train.micro_batch_size=null",
        "--gpus-per-node",
        "4",
        "--image",
        "registry.example/phalanx:0.1",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = phalanx(*argv, *options, check=False)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()
