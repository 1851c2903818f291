"""The deployment files: the compose stack validates and is wired the way docs/deploy.md says."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tracetap.proxy.runtime.settings import Settings

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
PROMETHEUS_FILE = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DIR = REPO / "deploy" / "grafana"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
DEPLOY_DOC = REPO / "docs" / "deploy.md"

# Variables the compose file reads; cleared so the caller's shell cannot change the result.
COMPOSE_INPUTS = ("MODEL", "VLLM_IMAGE", "HF_TOKEN")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def docker_compose() -> str:
    """Debian's docker-compose (v1): validates offline, no engine needed."""
    found = shutil.which("docker-compose")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing; .ci/run installs Debian's package")
        pytest.skip("docker-compose not installed (apt-get install docker-compose)")
    return found


def run_config(binary: str, *args: str, admin_token: str | None = "test-token"):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRACETAP_", "POSTGRES_", "COMPOSE_")) and k not in COMPOSE_INPUTS
    }
    if admin_token is not None:
        env["TRACETAP_ADMIN_TOKEN"] = admin_token
    return subprocess.run(
        [binary, "--project-directory", str(REPO), "-f", str(COMPOSE_FILE), *args, "config", "-q"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("profiles", [(), ("vllm",), ("mock",), ("vllm", "mock"),
                                      ("mock", "grafana"), ("mock", "replicas")])
def test_compose_file_validates(docker_compose, profiles):
    flags = [arg for profile in profiles for arg in ("--profile", profile)]
    result = run_config(docker_compose, *flags)
    assert result.returncode == 0, result.stderr


def test_compose_requires_an_admin_token(docker_compose):
    # The proxy binds 0.0.0.0 in its container; `serve` would refuse to start without one,
    # so Compose refuses first, with a message that names the variable.
    result = run_config(docker_compose, admin_token=None)
    assert result.returncode != 0
    assert "TRACETAP_ADMIN_TOKEN" in result.stderr


def test_replicas_example_in_the_docs_validates(docker_compose, tmp_path):
    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOY_DOC.read_text(), re.S)
    example = [b for b in blocks if b.startswith("# docker-compose.replicas.yml")]
    assert len(example) == 1, "docs/deploy.md lost its replicas example"
    override = tmp_path / "docker-compose.replicas.yml"
    override.write_text(example[0])
    result = run_config(docker_compose, "-f", str(override), "--profile", "vllm")
    assert result.returncode == 0, result.stderr


def test_proxy_is_configured_only_by_real_tracetap_variables(compose):
    env = compose["services"]["tracetap"]["environment"]
    assert isinstance(env, dict)
    known = {"TRACETAP_" + field.upper() for field in Settings.__struct_fields__}
    assert set(env) <= known, f"not tracetap settings: {sorted(set(env) - known)}"
    assert env["TRACETAP_HOST"] == "0.0.0.0"
    assert env["TRACETAP_DB"].startswith("postgresql://")
    assert env["TRACETAP_DATA_DIR"] == "/data"
    assert env["TRACETAP_UPSTREAM"] == "${TRACETAP_UPSTREAM:-http://vllm:8000/v1}"
    assert env["TRACETAP_ADMIN_TOKEN"].startswith("${TRACETAP_ADMIN_TOKEN:?")
    assert "8080:8080" in compose["services"]["tracetap"]["ports"]


def test_proxy_starts_after_postgres_is_healthy_and_migrations_succeeded(compose):
    depends = compose["services"]["tracetap"]["depends_on"]
    assert depends["postgres"] == {"condition": "service_healthy"}
    assert depends["migrate"] == {"condition": "service_completed_successfully"}
    assert "pg_isready" in " ".join(compose["services"]["postgres"]["healthcheck"]["test"])


def test_migrate_runs_db_upgrade_against_the_same_database(compose):
    migrate, proxy = compose["services"]["migrate"], compose["services"]["tracetap"]
    assert migrate["command"] == ["db", "upgrade"]
    assert migrate["environment"] == {"TRACETAP_DB": proxy["environment"]["TRACETAP_DB"]}
    assert migrate["depends_on"]["postgres"] == {"condition": "service_healthy"}


def test_optional_model_servers_sit_behind_profiles(compose):
    vllm, mock = compose["services"]["vllm"], compose["services"]["mock-engine"]
    assert vllm["profiles"] == ["vllm"]
    assert "${MODEL:-" in " ".join(vllm["command"])
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert mock["profiles"] == ["mock"]
    assert mock["command"] == ["mock-engine", "--host", "0.0.0.0", "--port", "8000"]


def test_prometheus_scrapes_the_proxy_with_the_shipped_rules(compose):
    mounts = [v.split(":") for v in compose["services"]["prometheus"]["volumes"]]
    # The image reads /etc/prometheus/prometheus.yml; the rule files sit beside it.
    assert ["./deploy/prometheus", "/etc/prometheus", "ro"] in mounts
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tracetap"]
    assert job["metrics_path"] == "/metrics"
    assert [t for sc in job["static_configs"] for t in sc["targets"]] == ["tracetap:8080"]
    assert config["rule_files"] == ["rules.yml", "alerts.yml"]
    assert all((PROMETHEUS_FILE.parent / f).is_file() for f in config["rule_files"])


def test_grafana_is_optional_and_provisioned_with_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    assert grafana["profiles"] == ["grafana"]
    mounts = {host: container for host, container, *_ in
              (v.split(":") for v in grafana["volumes"])}
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./deploy/grafana/tracetap.json"] == "/etc/grafana/dashboards/tracetap.json"
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == (
        "/etc/grafana/dashboards/tracetap.json")
    (provider,) = yaml.safe_load(
        (GRAFANA_DIR / "provisioning/dashboards/tracetap.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
    (source,) = yaml.safe_load(
        (GRAFANA_DIR / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    # The compose service's name and port, as Grafana's server reaches it.
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090:9090" in compose["services"]["prometheus"]["ports"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def test_image_runs_tracetap_as_a_non_root_user():
    instructions = dockerfile_instructions()
    values = {}
    for name, value in instructions:
        values[name] = value  # the last one wins, as in Docker
    assert values["FROM"].startswith("python:3.11-slim")
    assert values["USER"].split(":")[0] not in ("root", "0")
    assert json.loads(values["ENTRYPOINT"]) == ["tracetap"]
    assert json.loads(values["CMD"]) == ["serve"]
    assert values["EXPOSE"] == "8080"
    assert "/healthz" in values["HEALTHCHECK"]
    assert "/data" in values["VOLUME"]


def test_build_context_holds_what_the_dockerfile_copies():
    # .dockerignore is an allowlist; a COPY of a path it leaves out fails only at build time.
    allowed = {
        line[1:].rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.startswith("!")
    }
    for name, value in dockerfile_instructions():
        if name == "COPY" and not value.startswith("--from"):
            for source in value.split()[:-1]:
                assert source in allowed, f"{source} is excluded by .dockerignore"
                assert (REPO / source).exists()


def test_replicas_profile_puts_haproxy_in_front_of_every_replica(compose):
    services = compose["services"]
    cfg = (REPO / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    servers = re.findall(r"^\s*server\s+(\S+)\s+(\S+)", cfg, re.M)
    # Both backends (model calls, admin API) list the same replicas under the same names.
    assert len(servers) == 2 * len(set(servers))
    targets = [addr.rsplit(":", 1) for _, addr in set(servers)]
    # Every server line names a compose service on the proxy's port, and every replica is one.
    replicas = [name for name, svc in services.items()
                if svc.get("command") == ["serve"]]
    assert sorted(host for host, _ in targets) == sorted(replicas) == [
        "tracetap", "tracetap-2", "tracetap-3"]
    assert {port for _, port in targets} == {services["tracetap"]["environment"]["TRACETAP_PORT"]}
    for name in replicas:
        svc = services[name]
        assert svc["environment"] == services["tracetap"]["environment"]
        assert svc["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    # One journal per process: no two replicas share a data volume.
    data = [v for name in replicas for v in services[name]["volumes"] if v.endswith(":/data")]
    assert len(set(data)) == len(replicas)
    haproxy = services["haproxy"]
    assert haproxy["profiles"] == ["replicas"] == services["tracetap-2"]["profiles"]
    assert "./deploy/haproxy:/usr/local/etc/haproxy:ro" in haproxy["volumes"]
    assert haproxy["environment"]["HAPROXY_BIND"] == ":8090"
    assert haproxy["ports"] == ["8090:8090"]


def test_haproxy_routes_by_episode_with_consistent_hashing_and_readyz_checks():
    cfg = (REPO / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    lines = [line.split("#")[0].strip() for line in cfg.splitlines()]
    assert "balance hash var(txn.episode)" in lines
    assert "hash-type consistent" in lines
    assert "option httpchk GET /readyz" in lines
    assert "option httpchk GET /readyz/admin" in lines  # the admin backend's own check
    # The episode's sources in tracetap's own order: path, key, header.
    sources = [line for line in lines if line.startswith("http-request set-var(txn.episode)")]
    assert [s.split()[2] for s in sources] == [
        "path,field(3,/)", "req.hdr(authorization),bytes(7)", "req.hdr(api-key)",
        "req.hdr(x-api-key)", "req.hdr(x-tracetap-episode)"]
    # Only tracetap's own episode keys count: a placeholder key must not decide the route.
    assert all("tt-" in s for s in sources[1:4])
