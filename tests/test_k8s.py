"""deploy/k8s renders and validates offline: built-in kinds against the Kubernetes schemas
kubernetes-validate bundles, the ServiceMonitor (a CRD, no bundled schema) structurally,
and the pieces wired together the way docs/deploy.md says."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.k8s_render import render

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in render(K8S)}


@pytest.fixture(scope="module")
def validate():
    try:
        import kubernetes_validate
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is missing; it is in the [test] extra")
        pytest.skip("kubernetes-validate not installed")
    return lambda doc: kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_builtin_kinds_validate_against_the_kubernetes_schemas(docs, validate):
    builtin = [d for d in docs.values() if not d["apiVersion"].startswith("monitoring.coreos")]
    assert {d["kind"] for d in builtin} == {"ConfigMap", "Job", "Deployment", "Service",
                                            "Ingress"}
    for doc in builtin:
        validate(doc)  # raises ValidationError naming the field


def test_the_validator_refuses_a_broken_manifest(docs, validate):
    import kubernetes_validate
    broken = yaml.safe_load(yaml.safe_dump(docs[("Deployment", "tracetap")]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_kustomize_renders_the_same_where_installed(docs):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; the Python renderer is what the other tests use")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    assert theirs == docs


def _pod(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_replicas_are_ready_on_readyz_and_take_the_admin_token_from_a_secret(docs):
    deployment = docs[("Deployment", "tracetap")]
    assert deployment["spec"]["replicas"] >= 2
    (container,) = _pod(deployment)["containers"]
    assert container["args"] == ["serve"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = _env(container)
    assert env["TRACETAP_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "tracetap",
                                                             "key": "admin-token"}}
    assert env["TRACETAP_HOST"] == "0.0.0.0" and env["TRACETAP_DATA_DIR"] == "/data"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    # Long enough for the preStop sleep and tracetap's drain (30 s by default).
    assert _pod(deployment)["terminationGracePeriodSeconds"] >= 30 + 5


def test_migration_job_upgrades_the_database_the_replicas_use(docs):
    job = docs[("Job", "tracetap-migrate")]
    (container,) = _pod(job)["containers"]
    (replica,) = _pod(docs[("Deployment", "tracetap")])["containers"]
    assert container["args"] == ["db", "upgrade"]
    assert container["image"] == replica["image"] == "tracetap:latest"
    assert _env(container)["TRACETAP_DB"] == _env(replica)["TRACETAP_DB"]


def test_service_ingress_and_servicemonitor_reach_the_replicas(docs):
    pod_labels = docs[("Deployment", "tracetap")]["spec"]["template"]["metadata"]["labels"]
    service = docs[("Service", "tracetap")]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["sessionAffinity"] == "ClientIP"
    (port,) = service["spec"]["ports"]
    ingress = docs[("Ingress", "tracetap")]
    annotations = ingress["metadata"]["annotations"]
    assert "$http_x_tracetap_episode" in annotations["nginx.ingress.kubernetes.io/upstream-hash-by"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "tracetap", "port": {"name": port["name"]}}
    monitor = docs[("ServiceMonitor", "tracetap")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": port["name"], "path": "/metrics", "interval": "15s"}
    assert all(d["metadata"]["namespace"] == "tracetap" for d in docs.values())
