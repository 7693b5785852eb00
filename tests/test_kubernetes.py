"""The Kubernetes engine's rendering: compared to its expected text, validated against the published PyTorchJob
CRD schema (jsonschema) and, for the pod and the ConfigMap, against the official `kubernetes` client's models.
No cluster runs here; submission is checked only for its errors: without a kubeconfig, and with one
naming a server that does not answer."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, cli_command, run_cli, tiny_job, write_job
from jsonschema import Draft7Validator

from clusterfit.backends.kubernetes import job_status, manifests_text, render_manifests
from clusterfit.outputs.resolved_spec import resolved_spec_text
from clusterfit.spec import SpecError, validate_spec

DATA = REPO / "tests" / "data" / "kubernetes"


def _spec(**resources: Any) -> Any:
    job = tiny_job(Path("runs/tiny"))
    job["resources"] = {
        "instance_count": 2,
        "backend": "kubernetes",
        "gpus_per_instance": 1,
        "kubernetes": {"image": "registry.example.com/clusterfit:cuda", "data_claim": "imagenet", "cpu": "8"},
        **resources,
    }
    job["environment_variables"] = {"NCCL_DEBUG": "WARN"}
    return validate_spec(job)


def _closed(schema: Any) -> Any:
    """The schema as the API server applies it with strict field validation: an object schema with
    `properties` admits no other keys, unless it says `x-kubernetes-preserve-unknown-fields`."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        open_ended = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in schema and not open_ended:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


def _crd_validator() -> Draft7Validator:
    (crd,) = yaml.safe_load_all((DATA / "kubeflow.org_pytorchjobs.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return Draft7Validator(_closed(version["schema"]["openAPIV3Schema"]))


def _model_errors(data: Any, type_name: str, path: str = "") -> list[str]:
    """Keys and value types that the `kubernetes` client's model `type_name` (e.g. V1PodSpec) does not have."""
    import kubernetes.client.models as models

    # The client spells containers `List[V1Container]` and `Dict[str, str]` (older releases: list[...], dict(...)).
    if type_name.lower().startswith("list["):
        if not isinstance(data, list):
            return [f"{path}: not a list"]
        return [error for i, item in enumerate(data) for error in _model_errors(item, type_name[5:-1], f"{path}[{i}]")]
    if type_name.lower().startswith(("dict[", "dict(")):
        value_type = type_name[5:-1].split(", ", 1)[1]
        return [error for key, item in data.items() for error in _model_errors(item, value_type, f"{path}.{key}")]
    primitive = {"str": str, "int": int, "bool": bool, "float": (int, float)}.get(type_name)
    if primitive is not None:
        return [] if isinstance(data, primitive) else [f"{path}: {data!r} is not {type_name}"]
    if type_name == "object":
        return []
    model = getattr(models, type_name)
    json_to_attr = {json_key: attr for attr, json_key in model.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in json_to_attr:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            errors += _model_errors(value, model.openapi_types[json_to_attr[key]], f"{path}.{key}")
    return errors


def _deserializes(data: Any, type_name: str) -> Any:
    """Builds the client's model object, which refuses missing required fields and values of the wrong type."""
    from kubernetes.client import ApiClient

    return ApiClient().deserialize(json.dumps(data), type_name, "application/json")


def _rendered_for_comparison() -> str:
    """The manifests with the resolved spec left out of the ConfigMap: it lists every spec field, so it would
    change with each new field; it is compared to the launcher's resolved spec instead."""
    spec = _spec()
    config_map, job = render_manifests(spec)
    assert config_map["data"]["job.yaml"] == resolved_spec_text(spec)
    config_map["data"]["job.yaml"] = "(the resolved job spec)\n"
    return manifests_text([config_map, job])


def test_manifests_match_the_expected_text() -> None:
    assert _rendered_for_comparison() == (DATA / "tiny-2-nodes.k8s.yaml").read_text()


def test_pytorchjob_validates_against_the_published_crd_schema() -> None:
    config_map, job = render_manifests(_spec())
    validator = _crd_validator()
    assert list(validator.iter_errors(job)) == []
    # The check has teeth: a misspelt field and a wrong type are both refused.
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["elasticPolicy"]["nprocPerNode"] = 2
    assert any("nprocPerNode" in error.message for error in validator.iter_errors(misspelt))
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    assert list(validator.iter_errors(wrong_type))


def test_pod_template_and_config_map_are_valid_kubernetes_objects() -> None:
    config_map, job = render_manifests(_spec())
    pod_spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert _model_errors(pod_spec, "V1PodSpec") == []
    assert _model_errors(config_map, "V1ConfigMap") == []
    assert _deserializes(pod_spec, "V1PodSpec").containers[0].name == "pytorch"
    assert yaml.safe_load(config_map["data"]["job.yaml"])["name"] == "tiny"
    typo = copy.deepcopy(pod_spec)
    typo["containers"][0]["volumeMount"] = []
    assert _model_errors(typo, "V1PodSpec") == [".containers[0].volumeMount: not a field of V1Container"]


# The restricted Pod Security Standard (kubernetes.io/docs/concepts/security/pod-security-standards), as the
# PodSecurity admission controller applies it to a pod in a namespace labelled `enforce: restricted`.
_RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def _restricted_violations(pod: dict[str, Any]) -> list[str]:
    found = [f"{key}: true" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    pod_context = pod.get("securityContext", {})
    for container in pod["containers"]:
        context = {**pod_context, **container.get("securityContext", {})}
        name = container["name"]
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if context.get("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if context.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        if context.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: no RuntimeDefault or Localhost seccomp profile")
        capabilities = container.get("securityContext", {}).get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: a host port")
    return found


def _pod(spec: Any) -> dict[str, Any]:
    return render_manifests(spec)[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def test_pods_meet_the_restricted_pod_security_standard_and_mount_no_token_unless_asked() -> None:
    """A namespace enforcing the restricted standard admits the pods; a job's code gets no service account token
    (the namespace's default account) unless the spec names an account, e.g. for a workload identity."""
    pod = _pod(_spec())
    assert _restricted_violations(pod) == []
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == 1000
    env = {item["name"]: item["value"] for item in pod["containers"][0]["env"]}
    (home,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == env["HOME"]]
    assert {"name": home["name"], "emptyDir": {}} in pod["volumes"], "a uid the image may not know has a home"

    kubernetes = {"image": "clusterfit:cpu", "service_account": "trainer-identity", "run_as_user": 2000}
    named = _pod(_spec(kubernetes=kubernetes))
    assert named["serviceAccountName"] == "trainer-identity" and named["automountServiceAccountToken"] is True
    assert named["securityContext"]["runAsUser"] == 2000 and _restricted_violations(named) == []
    assert _model_errors(named, "V1PodSpec") == []

    # The check has teeth: root, an escalation and kept capabilities are each refused.
    as_root = copy.deepcopy(pod)
    as_root["securityContext"]["runAsUser"] = 0
    escalating = copy.deepcopy(pod)
    escalating["containers"][0]["securityContext"] = {"capabilities": {"drop": ["ALL"]}}
    assert _restricted_violations(as_root) == ["pytorch: runAsUser 0"]
    assert _restricted_violations(escalating) == ["pytorch: allowPrivilegeEscalation is not false"]
    with pytest.raises(SpecError, match=r"resources.kubernetes.run_as_user"):
        _spec(kubernetes={"image": "clusterfit:cpu", "run_as_user": 0})


def test_the_agent_command_and_resources_follow_the_spec() -> None:
    _, job = render_manifests(_spec())
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert "--nnodes=2" in container["command"] and "--nproc-per-node=2" in container["command"]
    assert "--rdzv-endpoint=tiny-worker-0:29400" in container["command"]
    assert container["command"][-2:] == ["--spec", "/etc/clusterfit/job.yaml"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "OMP_NUM_THREADS", "value": "4"} in container["env"]  # 8 cores / 2 processes
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts["outputs"] == "/workspace/runs/tiny" and mounts["data"] == "/data"


def test_outputs_at_a_url_give_each_pod_a_folder_of_its_own_that_the_store_fills_and_keeps() -> None:
    """No claim: each pod's emptyDir, its agent under the node copy (run for real in test_outputs_mirror.py)."""
    raw = _spec().model_dump(mode="json")
    raw["outputs"] = {"dir": "az://runs/tiny", "upload_every_s": 5}
    raw["storage"] = {"account_name": "myaccount"}
    config_map, job = render_manifests(validate_spec(raw))
    pod_spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = pod_spec["containers"][0]
    assert container["command"][:12] == [
        "python", "-m", "clusterfit.backends.node_copy", "--url", "az://runs/tiny", "--folder",
        "/clusterfit/outputs", "--every", "5", "--account-name", "myaccount", "--",
    ]  # fmt: skip
    assert container["command"][12:15] == ["python", "-m", "clusterfit.backends.agent"]
    assert "--log-dir=/clusterfit/outputs/logs" in container["command"]
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    assert volumes["outputs"] == {"name": "outputs", "emptyDir": {}}
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts["outputs"] == "/clusterfit/outputs"
    assert yaml.safe_load(config_map["data"]["job.yaml"])["outputs"]["dir"] == "/clusterfit/outputs"
    assert _model_errors(pod_spec, "V1PodSpec") == [] and _restricted_violations(pod_spec) == []
    assert list(_crd_validator().iter_errors(job)) == []
    # The job service's launcher passes the URL beside its local copy: the pods get the same.
    local = raw | {"outputs": {"dir": "/home/me/.cache/clusterfit/outputs/runs_tiny-1234", "upload_every_s": 5}}
    assert render_manifests(validate_spec(local), "az://runs/tiny")[1] == job


def test_an_elastic_job_asks_for_max_pods_starts_with_min_and_recreates_a_lost_one() -> None:
    raw = _spec().model_dump(mode="json")
    raw["resources"]["instance_count"], raw["distribution"]["max_restarts"] = "1:3", 3
    _, job = render_manifests(validate_spec(raw))
    assert list(_crd_validator().iter_errors(job)) == []
    policy, worker = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (1, 3, 3)
    assert (worker["replicas"], worker["restartPolicy"], job["spec"]["runPolicy"]["backoffLimit"]) == (
        3,
        "OnFailure",
        3,
    )
    command = worker["template"]["spec"]["containers"][0]["command"]
    assert "--nnodes=1:3" in command
    assert "--rdzv-conf=last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=4" in command
    _, fixed = render_manifests(_spec())
    assert fixed["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "Never"


@pytest.mark.parametrize(
    ("conditions", "state", "code"),
    [
        ([], "running", None),
        ([{"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}], "running", None),
        ([{"type": "Running", "status": "False"}, {"type": "Succeeded", "status": "True"}], "exited", 0),
        ([{"type": "Running", "status": "False"}, {"type": "Failed", "status": "True"}], "exited", 1),
    ],
)
def test_job_status_from_the_operator_conditions(conditions: list[dict[str, str]], state: str, code: int) -> None:
    status = job_status({"status": {"conditions": conditions}})
    assert (status.state, status.exit_code) == (state, code)


def test_dry_run_prints_the_manifests_and_submit_without_kubeconfig_is_refused_in_words(tmp_path: Path) -> None:
    job = tiny_job(tmp_path / "out")
    path = write_job(tmp_path / "job.yaml", job)
    dry = run_cli("run", str(path), "--backend", "kubernetes", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "kind: PyTorchJob" in dry.stdout and "kubectl apply -f tiny.k8s.yaml" in dry.stdout
    no_config = {**os.environ, "KUBECONFIG": str(tmp_path / "no-such-kubeconfig"), "HOME": str(tmp_path)}
    result = subprocess.run(
        cli_command("run", str(path), "--backend", "kubernetes"), env=no_config, capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "no usable kubeconfig" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_an_api_server_that_does_not_answer_is_unavailable_and_retried_after_a_pause(tmp_path: Path) -> None:
    """A real connection refused (a kubeconfig naming a closed port): the job waits and tries once more."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        server = f"https://127.0.0.1:{closed.getsockname()[1]}"
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "gone", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "me", "user": {"token": "t"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "me"}}],
        "current-context": "gone",
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    job = tiny_job(tmp_path / "out")
    job["resources"]["backend"] = "kubernetes"
    job["limits"] = {"max_retries": 1}
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")}
    result = subprocess.run(
        cli_command("run", str(write_job(tmp_path / "job.yaml", job))), env=env, capture_output=True, text=True
    )
    assert result.returncode == 1, result.stderr
    unreachable = (
        f"kubernetes: cannot reach the Kubernetes API server at {server} ([Errno 111] Connection refused); check "
        "the cluster in your kubeconfig; with limits.max_retries the job is submitted again after a pause"
    )
    assert f"{unreachable}. attempt 1 of 2 failed; retrying from the last checkpoint in 5 s" in result.stdout
    first, *rest = result.stderr.strip().splitlines()
    assert first.endswith("failed: the engine or data store was unavailable") and rest == [f"error: {unreachable}"]


def test_a_scoring_job_renders_as_a_pytorchjob_whose_ranks_read_the_model_and_images_from_the_data_claim() -> None:
    """`clusterfit score`'s job on Kubernetes: the same worker entry as training (the spec's scorer: section decides),
    the model and images on the read-only data claim, predictions into the outputs volume."""
    raw = {
        "name": "score",
        "scorer": {"model_dir": "/data/models/resnet18", "input": "/data/imagenet/val", "batch_size": 64},
        "distribution": {"type": "pytorch", "process_count_per_instance": 2},
        "resources": {
            "instance_count": 2,
            "backend": "kubernetes",
            "kubernetes": {"image": "registry.example.com/clusterfit:cpu", "data_claim": "imagenet", "cpu": "8"},
        },
        "outputs": {"dir": "runs/score"},
    }
    config_map, job = render_manifests(validate_spec(raw))
    assert list(_crd_validator().iter_errors(job)) == []
    pod_spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert _model_errors(pod_spec, "V1PodSpec") == [] and _restricted_violations(pod_spec) == []
    container = pod_spec["containers"][0]
    assert container["command"][-4:] == ["-m", "clusterfit.worker", "--spec", "/etc/clusterfit/job.yaml"]
    assert "--nnodes=2" in container["command"] and "--nproc-per-node=2" in container["command"]
    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    assert mounts["data"]["mountPath"] == "/data" and mounts["data"]["readOnly"] is True
    assert mounts["outputs"]["mountPath"] == "/workspace/runs/score"
    scorer = yaml.safe_load(config_map["data"]["job.yaml"])["scorer"]
    assert (scorer["model_dir"], scorer["input"]) == ("/data/models/resnet18", "/data/imagenet/val")
