"""Kubernetes manifests: validated against the Kubernetes API schemas (kubernetes-validate),
the kustomize overlay rendered by kubectl, the PyTorchJob checked against the fields the
Kubeflow training operator documents, and the Indexed Job's container command run for
real as two local "pods" (torchrun, node rank = JOB_COMPLETION_INDEX, pod 0 rendezvous).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from engine.data import build_default_corpus
from tests.launch_util import ROOT, env_with_repo, free_port, losses, tiny_overrides

K8S = ROOT / "tools" / "launch" / "k8s"
K8S_VERSION = "1.30.0"  # a release every maintained cluster runs or has passed

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e .[dev]")


def validate_core(doc: dict) -> None:
    """Raise unless ``doc`` is a valid object of its core kind (unknown fields rejected)."""
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_base_manifests_are_valid_kubernetes_objects():
    kinds = {}
    for path in sorted((K8S / "base").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        doc = yaml.safe_load(path.read_text())
        validate_core(doc)
        kinds[doc["kind"]] = doc
    assert set(kinds) == {"Job", "Service", "PersistentVolumeClaim"}
    job, svc = kinds["Job"], kinds["Service"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    # A broken manifest is rejected (the validator can fail): a misspelled field.
    bad = {**job, "spec": {**job["spec"], "paralelism": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(bad)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_example_overlay_renders_consistent_valid_objects():
    """kubectl kustomize renders the overlay; every object validates, and the values that
    must agree do: NNODES = parallelism = completions, GPUS_PER_NODE = the GPU limit."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / "example")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(out.stdout)}
    for doc in docs.values():
        validate_core(doc)
    env, job = docs["ConfigMap"]["data"], docs["Job"]
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert int(env["NNODES"]) == job["spec"]["parallelism"] == job["spec"]["completions"] == 4
    assert int(env["GPUS_PER_NODE"]) == container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["image"] == "registry.example.com/ml/meshtron:0.1.0"
    assert container["envFrom"][0]["configMapRef"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert docs["PersistentVolumeClaim"]["spec"]["resources"]["requests"]["storage"] == "1Ti"


# The PyTorchJob (kubeflow.org/v1) fields this manifest uses, as the training operator's
# API reference documents them: replica types Master/Worker, each with replicas,
# restartPolicy (Always, OnFailure, Never, ExitCode) and a pod template.
REPLICA = {
    "type": "object",
    "required": ["replicas", "template"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object", "required": ["spec"]},
    },
}
PYTORCHJOB = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["pytorchReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "nprocPerNode": {"type": "string", "pattern": "^([0-9]+|auto|cpu|gpu)$"},
                "runPolicy": {
                    "type": "object",
                    "properties": {
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                    },
                },
                "elasticPolicy": {"type": "object"},
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "required": ["Master"],
                    "additionalProperties": False,
                    "properties": {"Master": REPLICA, "Worker": REPLICA},
                },
            },
        },
    },
}


def test_pytorchjob_matches_the_operator_fields_and_its_pods_are_valid():
    import jsonschema

    job = yaml.safe_load((K8S / "pytorchjob" / "pytorchjob.yaml").read_text())
    jsonschema.validate(job, PYTORCHJOB)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    for spec in specs.values():
        template = spec["template"]
        # The pod template is a core PodTemplateSpec: validate it as a Pod.
        validate_core(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": template["spec"]}
        )
        container = template["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the operator injects its env here
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert str(gpus) == job["spec"]["nprocPerNode"]
    with pytest.raises(jsonschema.ValidationError):  # the schema can fail: a typo'd replica type
        jsonschema.validate({**job, "spec": {"pytorchReplicaSpecs": {"Mastre": {}}}}, PYTORCHJOB)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    return build_default_corpus(
        tmp_path_factory.mktemp("corpus"), vocab_size=512, max_bytes=300_000, progress=False
    )


@pytest.mark.slow
def test_indexed_job_command_trains_as_two_local_pods(corpus, tmp_path):
    """The container command of base/job.yaml, run twice with JOB_COMPLETION_INDEX 0 and 1
    and the ConfigMap's variables (NNODES=2, one process per "node", TP 1, pod 0 = this
    host): torchrun joins both into one job of dp=2 that trains."""
    job = yaml.safe_load((K8S / "base" / "job.yaml").read_text())
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    script = script.replace("/checkpoints", str(tmp_path))  # where the volume is mounted
    overrides = [
        o
        for o in tiny_overrides(corpus, tmp_path)
        if not o.startswith(("checkpoint.dir", "hydra.run.dir"))
    ]
    env = env_with_repo(
        NNODES="2",
        GPUS_PER_NODE="1",
        TP_SIZE="1",
        MASTER_HOST="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RUN_NAME="run",
        EXTRA_ARGS=" ".join(overrides),
        OMP_NUM_THREADS="1",
    )
    pods = [
        subprocess.Popen(
            ["bash", "-c", script],
            cwd=tmp_path,
            env={**env, "JOB_COMPLETION_INDEX": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=240)[0] for p in pods]
    finally:
        for p in pods:
            p.kill()
    assert [p.returncode for p in pods] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    log = logs[0] + logs[1]
    assert "tp=1 dp=2" in log and "mesh: tp groups [[0], [1]]  dp groups [[0, 1]]" in log, log[
        -3000:
    ]
    seen = losses(log)
    assert sorted(seen) == list(range(1, 7)) and seen[6] < seen[1] - 0.1, seen
    assert (Path(tmp_path) / "run" / "step_00000006").is_dir()
