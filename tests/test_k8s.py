"""deploy/k8s renders and validates offline: built-in kinds against the Kubernetes schemas
kubernetes-validate bundles, the ServiceMonitor (a CRD, no bundled schema) structurally,
every pod template against Pod Security "restricted" (tests/helpers/pod_security.py), and
the pieces wired together the way docs/deploy.md says."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml
from helpers.k8s_render import render
from helpers.loop import free_port
from helpers.pod_security import pod_spec, violations

from tracetap import __version__

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
                                            "Ingress", "NetworkPolicy",
                                            "PodDisruptionBudget"}
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


def test_replicas_are_ready_on_the_admin_readiness_and_take_the_admin_token_from_a_secret(
        docs):
    deployment = docs[("Deployment", "tracetap")]
    assert deployment["spec"]["replicas"] >= 2
    (container,) = _pod(deployment)["containers"]
    assert container["args"] == ["serve"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8080, "admin": 8081}
    # A Pod has one readiness for every Service: the admin API's, which never asks the
    # engine, so an engine outage leaves the admin API up.
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz/admin", "port": "admin"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # schema waits
    env = _env(container)
    assert env["TRACETAP_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "tracetap",
                                                             "key": "admin-token"}}
    assert env["TRACETAP_HOST"] == "0.0.0.0" and env["TRACETAP_DATA_DIR"] == "/data"
    assert (env["TRACETAP_PORT"], env["TRACETAP_ADMIN_PORT"]) == ("8080", "8081")
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    # Long enough for the preStop sleep and tracetap's drain (30 s by default).
    assert _pod(deployment)["terminationGracePeriodSeconds"] >= 30 + 5


def test_every_pod_template_passes_pod_security_restricted(docs):
    workloads = [d for d in docs.values() if pod_spec(d) is not None]
    assert {d["kind"] for d in workloads} == {"Deployment", "Job"}
    for doc in workloads:
        assert violations(pod_spec(doc)) == [], doc["metadata"]["name"]
        for container in pod_spec(doc)["containers"]:
            # Beyond the profile: nothing written to the image's filesystem.
            assert container["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("breach", [
    ("allowPrivilegeEscalation", lambda c, p: c["securityContext"].pop(
        "allowPrivilegeEscalation")),
    ("capabilities.drop", lambda c, p: c["securityContext"]["capabilities"].update(
        drop=["NET_RAW"])),
    ("capabilities.add", lambda c, p: c["securityContext"]["capabilities"].update(
        add=["SYS_ADMIN"])),
    ("runAsNonRoot", lambda c, p: (c["securityContext"].pop("runAsNonRoot"),
                                   p["securityContext"].pop("runAsNonRoot"))),
    ("runAsUser", lambda c, p: c["securityContext"].update(runAsUser=0)),
    ("seccompProfile", lambda c, p: c["securityContext"].update(
        seccompProfile={"type": "Unconfined"})),
    ("privileged", lambda c, p: c["securityContext"].update(privileged=True)),
    ("hostPath", lambda c, p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}})),
    ("hostNetwork", lambda c, p: p.update(hostNetwork=True)),
    ("hostPort", lambda c, p: c["ports"][0].update(hostPort=8080)),
], ids=lambda breach: breach[0])
def test_the_pod_security_check_refuses_each_breach(docs, breach):
    """The checker can fail: each of the restricted profile's rules, broken once."""
    deployment = yaml.safe_load(yaml.safe_dump(docs[("Deployment", "tracetap")]))
    pod = _pod(deployment)
    breach[1](pod["containers"][0], pod)
    assert violations(pod), breach[0]


def test_the_journal_and_tmp_are_bounded_volumes_on_a_read_only_root(docs):
    pod = _pod(docs[("Deployment", "tracetap")])
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert set(mounts) == {"/data", "/tmp"}
    limits = {path: _bytes(volumes[name]["emptyDir"]["sizeLimit"])
              for path, name in mounts.items()}
    # The journal and its dead-letter file (each TRACETAP_JOURNAL_MAX_BYTES) fit in /data.
    journal = int(_env(container)["TRACETAP_JOURNAL_MAX_BYTES"])
    assert 2 * journal < limits["/data"]
    storage = container["resources"]
    assert _bytes(storage["limits"]["ephemeral-storage"]) >= sum(limits.values())
    assert "ephemeral-storage" in storage["requests"]


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_replicas_spread_and_leave_one_at_a_time(docs):
    pod = _pod(docs[("Deployment", "tracetap")])
    labels = docs[("Deployment", "tracetap")]["spec"]["template"]["metadata"]["labels"]
    spread = {c["topologyKey"]: c for c in pod["topologySpreadConstraints"]}
    assert set(spread) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert all(c["labelSelector"]["matchLabels"].items() <= labels.items()
               for c in spread.values())
    budget = docs[("PodDisruptionBudget", "tracetap")]
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_migration_job_is_one_per_version_on_the_pinned_image(docs):
    (job,) = [d for (kind, _), d in docs.items() if kind == "Job"]
    (container,) = _pod(job)["containers"]
    (replica,) = _pod(docs[("Deployment", "tracetap")])["containers"]
    assert container["args"] == ["db", "upgrade"]
    # Pinned, never `latest`; the Job's name carries the same version.
    assert container["image"] == replica["image"] == f"tracetap:{__version__}"
    assert job["metadata"]["name"] == f"tracetap-migrate-{__version__.replace('.', '-')}"
    assert _env(container)["TRACETAP_DB"] == _env(replica)["TRACETAP_DB"]
    assert _pod(job)["restartPolicy"] == "OnFailure"


def test_the_ingress_serves_the_model_api_only_with_affinity_by_episode(docs):
    service = docs[("Service", "tracetap")]
    assert "sessionAffinity" not in service["spec"]  # no client-IP affinity
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"http": 8080, "admin": 8081}
    ingress = docs[("Ingress", "tracetap")]
    annotations = ingress["metadata"]["annotations"]
    (rule,) = ingress["spec"]["rules"]
    paths = [p["path"] for p in rule["http"]["paths"]]
    assert all(p["backend"]["service"] == {"name": "tracetap", "port": {"name": "http"}}
               for p in rule["http"]["paths"])
    # Model paths only: no catch-all, nothing that matches the admin API or /metrics.
    for path in paths:
        assert path not in ("/", "") and not path.startswith(("/tracetap", "/metrics"))
    assert any(p.startswith("/v1") for p in paths)
    assert any(p.startswith("/episodes/") for p in paths)
    # The hash is on the episode (a capture of its path segment, its header, its key),
    # never on the URI (which differs per endpoint).
    hashed = annotations["nginx.ingress.kubernetes.io/upstream-hash-by"]
    assert "$tracetap_episode" in hashed and "$http_x_tracetap_episode" in hashed
    assert "uri" not in hashed
    (episode_path,) = [p for p in paths if p.startswith("/episodes/")]
    assert "(?<tracetap_episode>" in episode_path
    assert annotations["nginx.ingress.kubernetes.io/use-regex"] == "true"
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    # The controller's access log holds the URI, with an episode's capability secret.
    assert annotations["nginx.ingress.kubernetes.io/enable-access-log"] == "false"


def test_the_episode_capture_takes_the_id_without_its_secret(docs):
    """The Ingress path's regex (PCRE in nginx; the same here) on the base URLs agents use."""
    ingress = docs[("Ingress", "tracetap")]
    (path,) = [p["path"] for p in ingress["spec"]["rules"][0]["http"]["paths"]
               if p["path"].startswith("/episodes/")]
    pattern = re.compile("^" + path.replace("(?<", "(?P<"))
    for uri, episode in (("/episodes/ep-1~s3cr3t/v1/chat/completions", "ep-1"),
                         ("/episodes/ep.2/v1/responses", "ep.2")):
        assert pattern.match(uri)["tracetap_episode"] == episode
    assert pattern.match("/tracetap/episodes/x/finish") is None


def test_network_policy_keeps_the_admin_port_to_the_trainer_and_agents_to_the_model_port(
        docs):
    policy = docs[("NetworkPolicy", "tracetap")]
    labels = docs[("Deployment", "tracetap")]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {}
    for rule in policy["spec"]["ingress"]:
        (port,) = rule["ports"]
        by_port[port["port"]] = [peer["namespaceSelector"]["matchLabels"]
                                 for peer in rule["from"]]
    assert set(by_port) == {"http", "admin"}
    namespace = "kubernetes.io/metadata.name"
    assert {namespace: "trainer"} in by_port["admin"]
    assert {"tracetap.io/agents": "true"} in by_port["http"]
    # Agents are never let in on the admin port.
    assert {"tracetap.io/agents": "true"} not in by_port["admin"]
    assert all(peer.get(namespace) in ("trainer", "monitoring") for peer in by_port["admin"])


def test_servicemonitor_scrapes_every_replica_on_the_admin_port(docs):
    service = docs[("Service", "tracetap")]
    monitor = docs[("ServiceMonitor", "tracetap")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "admin", "path": "/metrics", "interval": "15s"}
    assert all(d["metadata"]["namespace"] == "tracetap" for d in docs.values())


def _under_tmp(*paths: Path) -> list[str]:
    """Read-only binds of those of ``paths`` under /tmp, which the sandbox replaces."""
    return [arg for path in dict.fromkeys(paths) if path.is_relative_to("/tmp")
            for arg in ("--ro-bind", str(path), str(path))]


def test_the_proxy_runs_on_a_read_only_root_with_only_its_volumes_writable(
        engine, tmp_path):
    """What readOnlyRootFilesystem plus the two emptyDirs give it: the root read-only (here
    bubblewrap's bind mounts), /tmp and the data dir writable. A call is journaled and
    stored, and SIGTERM drains to exit 0."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap not installed")
    (tmp_path / "tmp").mkdir()
    (tmp_path / "data").mkdir()
    port = free_port()
    command = [bwrap, "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev",
               "--proc", "/proc",
               "--bind", str(tmp_path / "tmp"), "/tmp",
               "--bind", str(tmp_path / "data"), "/tmp/data",
               # A checkout (and its venv) under /tmp stays visible, read-only, as the
               # image's installed code is.
               *_under_tmp(Path(__file__).resolve().parents[1], Path(sys.prefix).resolve()),
               sys.executable, "-m", "tracetap", "serve", "--upstream", engine.url,
               "--db", "sqlite:////tmp/data/tracetap.db", "--data-dir", "/tmp/data",
               "--port", str(port), "--admin-token", "r" * 40]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while b"listening on" not in log.read_bytes():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)  # polling for the start-up line
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/episodes/ro/v1", api_key="x",
                           max_retries=3) as client:
            client.chat.completions.create(model="mock-model", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
    finally:
        # To tracetap itself: bubblewrap does not pass signals on (it exits with the
        # status of the process it runs).
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
        for pid in (children.read_text().split() if process.poll() is None else ()):
            os.kill(int(pid), signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()
    assert (tmp_path / "data" / "tracetap.db").stat().st_size > 0
    assert "Read-only file system" not in log.read_text()
