"""Kubernetes: a Kubeflow `PyTorchJob` (kubeflow.org/v1, training operator) with an elastic policy, so the
operator runs one pod per node whose container is torchrun's agent, rendezvousing over c10d at the first pod.

Rendered as two manifests: a ConfigMap holding the resolved job.yaml (mounted at /etc/clusterfit) and the
PyTorchJob. outputs.dir is a ReadWriteMany PersistentVolumeClaim mounted on every pod (logs, checkpoints and
the model land there), or a URL: then each pod works in a folder of its own that the store fills and keeps. A
command job's `code` must be in the image or on a mounted claim.

The pods meet the restricted Pod Security Standard (so they run in namespaces that enforce it): a non-root user
and group (`run_as_user`, also the claim's group through fsGroup), no privilege escalation, every capability
dropped, the runtime's default seccomp profile. No service account token is mounted unless the spec names a
service account: a job's code cannot call the cluster's API with the namespace's default account."""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath
from typing import Any

import yaml

from clusterfit.backends.base import EngineRef, EngineStatus, Rendered
from clusterfit.backends.node_copy import node_copy_command
from clusterfit.backends.polled import PolledRun
from clusterfit.backends.torchrun import RDZV_PORT, torchrun_command, worker_env
from clusterfit.errors import EngineError, SpecError
from clusterfit.outputs.layout import RESOLVED_SPEC
from clusterfit.outputs.resolved_spec import resolved_spec_text
from clusterfit.spec.model import JobSpec, is_url
from clusterfit.storage.filesystems import Credentials

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
WORKDIR = "/workspace"  # the image's WORKDIR: relative paths in the spec resolve here, as on a laptop
SPEC_DIR = "/etc/clusterfit"
DATA_MOUNT = "/data"
HOME = "/home/clusterfit"  # an emptyDir: caches (~/.cache) must be writable by a uid the image may not know
POD_OUTPUTS = "/clusterfit/outputs"  # with outputs at a URL: each pod's own folder of them, an emptyDir
_CONTAINER = "pytorch"  # the training operator finds the training container by this name
_POLL_EVERY_S = 2.0
_RETRY_NOTE = "with limits.max_retries the job is submitted again after a pause"


def resource_name(job_name: str) -> str:
    """A DNS-1123 name (lower case, digits, '-') from the job's name."""
    return re.sub(r"[^a-z0-9-]+", "-", job_name.lower()).strip("-")[:50] or "clusterfit"


def _in_pod(path: str) -> str:
    return str(PurePosixPath(path) if PurePosixPath(path).is_absolute() else PurePosixPath(WORKDIR, path))


def _cores(cpu: str) -> int:
    """Whole cores in a Kubernetes CPU quantity ("4", "500m", "1.5")."""
    return int(cpu[:-1]) // 1000 if cpu.endswith("m") else int(float(cpu))


def render_manifests(spec: JobSpec, outputs_store: str | None = None) -> list[dict[str, Any]]:
    """The ConfigMap (job.yaml) and the PyTorchJob. With outputs at a URL (`outputs_store`, or a URL
    outputs.dir), each pod works in an emptyDir of its own and its agent runs under the node copy
    (backends/node_copy.py), which fills it from the store and copies it back; no claim is mounted."""
    store = outputs_store or (spec.outputs.dir if is_url(spec.outputs.dir) else None)
    if store is not None:
        spec = spec.model_copy(update={"outputs": spec.outputs.model_copy(update={"dir": POD_OUTPUTS})})
    if spec.storage.sas_token is not None:
        raise SpecError(
            "storage.sas_token cannot be handed to Kubernetes pods yet; put the token in a Secret and set "
            "AZURE_STORAGE_SAS_TOKEN from it in your image, or use a workload identity"
        )
    k8s, res = spec.resources.kubernetes, spec.resources
    name = resource_name(spec.name)
    nproc = spec.distribution.process_count_per_instance
    labels = {"app.kubernetes.io/managed-by": "clusterfit", "clusterfit/job": name}
    spec_path = f"{SPEC_DIR}/{RESOLVED_SPEC}"
    # NOTE: the operator names the first worker's pod and its Service `<job>-worker-0`.
    command = torchrun_command(
        spec, python="python", rdzv_endpoint=f"{name}-worker-0:{RDZV_PORT}", run_id=name, spec_path=spec_path
    )
    if store is not None:
        creds = Credentials(spec.storage.account_name, spec.storage.endpoint)  # a SAS token is refused above
        command = node_copy_command(store, POD_OUTPUTS, spec.outputs.upload_every_s, creds, command)
    threads = max(1, _cores(k8s.cpu) // nproc)
    env = {**worker_env(threads), "HOME": HOME, **spec.environment_variables}
    quantities = {"cpu": k8s.cpu, "memory": k8s.memory}
    if res.gpus_per_instance:
        quantities["nvidia.com/gpu"] = str(res.gpus_per_instance)
    mounts = [
        {"name": "job-spec", "mountPath": SPEC_DIR, "readOnly": True},
        {"name": "outputs", "mountPath": _in_pod(spec.outputs.dir)},
        {"name": "dshm", "mountPath": "/dev/shm"},  # DataLoader workers pass batches through shared memory
        {"name": "home", "mountPath": HOME},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "job-spec", "configMap": {"name": f"{name}-spec"}},
        {"name": "outputs", "emptyDir": {}}
        if store is not None
        else {"name": "outputs", "persistentVolumeClaim": {"claimName": k8s.outputs_claim}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "home", "emptyDir": {}},
    ]
    if k8s.data_claim:
        mounts.append({"name": "data", "mountPath": DATA_MOUNT, "readOnly": True})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": k8s.data_claim, "readOnly": True}})
    container = {
        "name": _CONTAINER,
        "image": k8s.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": WORKDIR,
        "command": command,
        "env": [{"name": key, "value": value} for key, value in sorted(env.items())],
        "ports": [{"name": "c10d", "containerPort": RDZV_PORT}],
        "resources": {"requests": quantities, "limits": quantities},
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": k8s.run_as_user,
            "runAsGroup": k8s.run_as_user,
            "fsGroup": k8s.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": k8s.service_account is not None,
        **({"serviceAccountName": k8s.service_account} if k8s.service_account else {}),
        "containers": [container],
        "volumes": volumes,
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-spec", "namespace": k8s.namespace, "labels": labels},
        "data": {RESOLVED_SPEC: resolved_spec_text(spec)},
    }
    job = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "rdzvPort": RDZV_PORT,
                "minReplicas": res.min_nodes,
                "maxReplicas": res.max_nodes,
                "maxRestarts": spec.distribution.max_restarts,
                "nProcPerNode": nproc,
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    # An elastic job asks for MAX pods and starts once MIN run; torchrun restarts its workers
                    # itself (max_restarts). A failed pod fails a fixed job; an elastic job's is recreated and
                    # rejoins, up to runPolicy.backoffLimit times.
                    "replicas": res.max_nodes,
                    "restartPolicy": "OnFailure" if res.elastic else "Never",
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": pod_spec,
                    },
                }
            },
            "runPolicy": {
                "cleanPodPolicy": "Running",
                "backoffLimit": spec.distribution.max_restarts if res.elastic else 0,
            },
        },
    }
    return [config_map, job]


class _ManifestDumper(yaml.SafeDumper):
    """Plain YAML as people write manifests: no &anchors for repeated values, multi-line strings as blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text_block(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _text_block)


def manifests_text(manifests: list[dict[str, Any]]) -> str:
    return yaml.dump_all(manifests, Dumper=_ManifestDumper, sort_keys=False, default_flow_style=False, width=120)


class KubernetesBackend:
    name = "kubernetes"

    def dry_run(self, spec: JobSpec) -> Rendered:
        manifests_file = f"{resource_name(spec.name)}.k8s.yaml"
        return Rendered(
            backend=self.name,
            # What `submit` does through the API, as the command a user would type with the manifests saved.
            command=["kubectl", "apply", "-f", manifests_file],
            files={manifests_file: manifests_text(render_manifests(spec))},
        )

    def submit(self, spec: JobSpec, outputs_store: str | None = None) -> PolledRun:
        """`outputs_store`: the URL of the job's outputs, whose local copy (the launcher's) `spec.outputs.dir` is."""
        config_map, job = render_manifests(spec, outputs_store)
        core, custom = _clients()
        namespace = spec.resources.kubernetes.namespace
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            core.create_namespaced_config_map(namespace, config_map)
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
        except ApiException as exc:
            name = job["metadata"]["name"]
            raise api_refusal(exc.status or 0, exc.reason or "", exc.body or "", name, namespace) from None
        except HTTPError as exc:  # the client's transport: no answer at all (refused, timed out, DNS)
            reason = str(getattr(exc, "reason", None) or exc).rsplit(": ", 1)[-1]
            raise EngineError(
                f"cannot reach the Kubernetes API server at {core.api_client.configuration.host} ({reason}); "
                f"check the cluster in your kubeconfig; {_RETRY_NOTE}",
                retryable=True,
            ) from None
        return PolledRun(EngineRef(self.name, job["metadata"]["name"], {"namespace": namespace}), self, _POLL_EVERY_S)

    def status(self, ref: EngineRef) -> EngineStatus:
        from kubernetes.client.exceptions import ApiException

        _, custom = _clients()
        try:
            job = custom.get_namespaced_custom_object(GROUP, VERSION, ref.extra["namespace"], PLURAL, ref.id)
        except ApiException as exc:
            if exc.status == 404:
                return EngineStatus("gone")
            raise
        return job_status(job)

    def cancel(self, ref: EngineRef) -> None:
        from kubernetes.client.exceptions import ApiException

        core, custom = _clients()
        namespace = ref.extra["namespace"]
        for delete in (
            lambda: custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, ref.id, propagation_policy="Foreground"
            ),
            lambda: core.delete_namespaced_config_map(f"{ref.id}-spec", namespace),
        ):
            try:
                delete()
            except ApiException as exc:
                if exc.status != 404:
                    raise


def api_refusal(status: int, reason: str, body: str, name: str, namespace: str) -> EngineError:
    """An API server's answer to a submission, as one line with its fix. 429 and 5xx (overloaded, restarting,
    a webhook timing out) may pass a little later; any other refusal is about this job and would be repeated."""
    said = " ".join(f"{status} {reason}: {_status_message(body)}".rstrip(": ").split())[:300]
    if status == 429 or status >= 500:
        return EngineError(f"the Kubernetes API could not take the job now ({said}); {_RETRY_NOTE}", retryable=True)
    fixes = {
        403: f"your kubeconfig's user may not create ConfigMaps and PyTorchJobs in namespace {namespace!r} "
        "(resources.kubernetes.namespace); ask for that role",
        404: f"the namespace {namespace!r} or the PyTorchJob kind (Kubeflow's training operator) is missing; "
        "create the namespace or install the operator",
        409: f"a job named {name!r} exists in namespace {namespace!r}; delete it (kubectl delete "
        f"pytorchjob,configmap -n {namespace} -l clusterfit/job={name}) or rename the job",
    }
    fix = fixes.get(status, "check resources.kubernetes against the manifests `clusterfit run --dry-run` prints")
    return EngineError(f"the Kubernetes API refused the job ({said}); {fix}", retryable=False)


def _status_message(body: str) -> str:
    """The `message` of the Status object an API server answers with; empty if the body is not one."""
    try:
        return str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        return ""


def job_status(job: dict[str, Any]) -> EngineStatus:
    """The PyTorchJob's last condition: Succeeded or Failed end it; anything else is still running."""
    conditions = (job.get("status") or {}).get("conditions") or []
    done = {c["type"]: c for c in conditions if c.get("status") == "True" and c["type"] in ("Succeeded", "Failed")}
    if "Succeeded" in done:
        return EngineStatus("exited", 0)
    if "Failed" in done:
        return EngineStatus("exited", 1)
    return EngineStatus("running")


def _clients() -> tuple[Any, Any]:
    try:
        from kubernetes import client, config
    except ImportError:
        raise EngineError(
            "the kubernetes backend needs the kubernetes client: pip install 'clusterfit[kubernetes]'", retryable=False
        ) from None
    try:
        config.load_kube_config()
    except Exception as exc:  # the client raises ConfigException, FileNotFoundError, TypeError ...
        raise EngineError(
            f"no usable kubeconfig ({exc}); point KUBECONFIG at your cluster's config, or use --dry-run to print "
            "the manifests for kubectl apply",
            retryable=False,
        ) from None
    return client.CoreV1Api(), client.CustomObjectsApi()
