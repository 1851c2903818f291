"""The shipped Prometheus rules and Grafana dashboard, read by a real Prometheus.

``promtool`` and ``prometheus`` come from Debian's ``prometheus`` package (installed by
.ci/run): promtool validates the config and rules and runs every alert's unit tests;
the end-to-end test starts ``prometheus`` itself on a free loopback port, lets it scrape a
running tracetap, and reads the result back from Prometheus' HTTP API.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import openai
import pytest
import yaml
from helpers.http import get, metrics_text, wait_ready
from helpers.loop import free_port
from helpers.servers import Proxy
from prometheus_client.parser import text_string_to_metric_families

from tracetap.migrations import upgrade
from tracetap.proxy.runtime.metrics import Metrics
from tracetap.proxy.runtime.settings import Settings

REPO = Path(__file__).resolve().parents[1]
PROM_DIR = REPO / "deploy" / "prometheus"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
ALERT_TESTS = REPO / "tests" / "prometheus" / "alerts_test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "tracetap.json"
ALERTS_DOC = REPO / "docs" / "alerts.md"
MESSAGES = [{"role": "user", "content": "Name three rivers."}]
# What the Grafana variables stand for when the test runs a panel's query itself.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m", "$job": "tracetap"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left",
                "group_right"}


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing; .ci/run installs Debian's prometheus package")
        pytest.skip(f"{name} not installed (apt-get install prometheus)")
    return found


@pytest.fixture(scope="module")
def promtool() -> str:
    return _binary("promtool")


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    return _binary("prometheus")


def rule_files() -> list[Path]:
    return [PROM_DIR / name for name in yaml.safe_load(PROM_CONFIG.read_text())["rule_files"]]


def rules() -> list[dict]:
    return [rule for path in rule_files()
            for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict]:
    return [rule for rule in rules() if "alert" in rule]


def recorded() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def exposed(outcomes: bool = False) -> set[str]:
    """Every sample name a proxy's /metrics can carry, from its declared families (with
    ``outcomes``: its admin page, /tracetap/metrics)."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count")}
    return {family.name + suffix
            for family in text_string_to_metric_families(Metrics().render(outcomes).decode())
            for suffix in suffixes[family.type]}


def test_the_open_page_grades_no_episode():
    graded = {name for name in exposed(outcomes=True) - exposed()
              if not name.endswith("_created")}  # prometheus_client's creation stamps
    assert graded == {"tracetap_episode_reward_sum", "tracetap_episode_reward_count",
                      "tracetap_episodes_integrity_total",
                      "tracetap_episode_integrity_causes_total"}
    # The shipped Prometheus scrapes the open page only: what it stores, anyone who can
    # query it (its port is published) could read.
    (job,) = yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and "authorization" not in job


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, labels and ranges removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set(re.findall(r"(?<![\w:$])[A-Za-z_:][\w:]*\b(?!\s*\()", expr))
    return names - PROMQL_WORDS


def dashboard_targets(dashboard: dict) -> list[dict]:
    return [t for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def with_grafana_vars(expr: str) -> str:
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace(name, value)
    return expr


def test_metric_names_parser_reads_promql():
    # The helper every check below leans on: it must find names, and only names.
    expr = ('histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{x="y(z)"}[5m])))'
            ' / on(job) group_left b:c:rate5m and time() - d offset 5m > bool 0.5e3')
    assert metric_names(expr) == {"a_bucket", "b:c:rate5m", "d"}


# -- promtool ----------------------------------------------------------------------------


def promtool_run(binary: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_shipped_config_and_rules(promtool):
    result = promtool_run(promtool, "check", "config", str(PROM_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rule_files())} rule files found" in result.stdout
    result = promtool_run(promtool, "check", "rules", *map(str, rule_files()))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(rule_files())


def test_every_alert_fires_and_stays_silent_in_promtool_unit_tests(promtool):
    result = promtool_run(promtool, "test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    cases = [case for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
             for case in test["alert_rule_test"]]
    tested = {rule["alert"]: {"fires": False, "silent": False} for rule in alerts()}
    for case in cases:
        tested[case["alertname"]]["fires" if case["exp_alerts"] else "silent"] = True
    untested = {name: seen for name, seen in tested.items() if not all(seen.values())}
    assert not untested, f"alerts lacking a firing or a silent case: {untested}"
    # The unit tests load the shipped files, not copies.
    loaded = {(ALERT_TESTS.parent / f).resolve()
              for f in yaml.safe_load(ALERT_TESTS.read_text())["rule_files"]}
    assert loaded == {p.resolve() for p in rule_files()}


# -- what the rules and the dashboard read ---------------------------------------------


def test_rules_read_only_metrics_tracetap_exposes():
    known = exposed() | recorded()
    assert len(recorded()) == 6 and len(alerts()) == 10
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, rule
        assert names <= known, f"{rule.get('record') or rule['alert']} reads {names - known}"


def test_each_alert_explains_itself_and_has_a_runbook():
    headings = re.findall(r"^#+ (.+)$", ALERTS_DOC.read_text(), re.M)
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
    for rule in alerts():
        name, notes = rule["alert"], rule["annotations"]
        assert name.startswith("Tracetap")
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert notes["summary"] and notes["description"]
        doc, anchor = notes["runbook"].split("#")
        assert doc == "docs/alerts.md" and anchor == name.lower() and anchor in anchors, name


def test_dashboard_is_importable_and_reads_only_existing_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "tracetap" and dashboard["title"] and dashboard["id"] is None
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        # Every query goes to the data source the importer picks, none to a fixed uid.
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["title"] and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
    known = exposed() | recorded() | {"ALERTS"}
    read = set()
    for target in dashboard_targets(dashboard):
        names = metric_names(with_grafana_vars(target["expr"]))
        assert names and names <= known, f"{target['expr']} reads {names - known}"
        read |= names
    # The panels the issue asks for are there: each of these is read by some panel.
    assert {"route_code:tracetap_requests:rate5m", "tracetap_requests_total",
            "route:tracetap_overhead_seconds:p99_5m",
            "route:tracetap_time_to_first_token_seconds:p99_5m",
            "tracetap_upstream_duration_seconds_bucket", "outcome:tracetap_records:rate5m",
            "tracetap_journal_bytes", "tracetap_db_batch_size_bucket",
            "tracetap_db_write_duration_seconds_bucket", "tracetap_episodes_finished_total",
            "tracetap_upstream_healthy"} <= read
    job = variables["job"]
    assert metric_names(job["definition"].removeprefix("label_values(").split(",")[0]) <= known


# -- a real Prometheus scraping a running tracetap --------------------------------------


class PrometheusServer:
    """``prometheus`` on a free loopback port, with the shipped rules and a fast scrape of
    one target; config and storage live in a temporary folder."""

    INTERVAL = "500ms"

    def __init__(self, binary: str, workdir: Path, target: str):
        self.port = free_port()
        self.log = workdir / "prometheus.log"
        config = yaml.safe_load(PROM_CONFIG.read_text())
        config["global"] = {"scrape_interval": self.INTERVAL, "scrape_timeout": self.INTERVAL,
                            "evaluation_interval": self.INTERVAL}
        config["rule_files"] = [str(path) for path in rule_files()]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.args = [binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}"]
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(self.url + "/-/ready", self.process, timeout, what="prometheus")
        except AssertionError as error:
            raise RuntimeError(f"{error}:\n{self.log.read_text()}") from None
        return self

    def api(self, path: str, **params: str):
        query = "?" + urllib.parse.urlencode(params) if params else ""
        status, body = get(f"{self.url}/api/v1/{path}{query}", timeout=5)
        assert status == 200 and body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        return self.api("query", query=promql)["result"]

    def value(self, promql: str) -> float | None:
        """The single series' value, or None while there is none."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def scraped_proxy(loop_thread, engine, tmp_path) -> Proxy:
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"
    upgrade(url)
    settings = Settings(upstream=engine.url, db=url, data_dir=str(tmp_path / "data"),
                        port=free_port())
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def prometheus(prometheus_binary, scraped_proxy, tmp_path) -> PrometheusServer:
    workdir = tmp_path / "prometheus"
    workdir.mkdir()
    server = PrometheusServer(prometheus_binary, workdir,
                              f"127.0.0.1:{scraped_proxy.settings.port}")
    try:
        yield server.start()
    finally:
        server.stop()


def poll(check, what: str, until=bool, timeout: float = 30.0):
    """``check()`` until ``until`` holds for its result; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if until(result):
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; last: {result!r}")
        time.sleep(0.1)  # polling Prometheus, which evaluates on its own clock


def drive_traffic(proxy: Proxy, episode: str, *, drop: bool) -> None:
    """Three chat calls (one streamed), a completion, an upstream 400, a finished episode
    with a reward; with ``drop``, one more call whose record the full journal drops."""
    assert proxy.admin("POST", "/tracetap/episodes", {"id": episode})[0] == 201
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)
    with client:
        for _ in range(2):
            client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4)
        list(client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4,
                                            stream=True))
        client.completions.create(model="mock-model", prompt="Once", max_tokens=3)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                           extra_body={"mock_status": 400})
        if drop:  # the journal refuses the next record, as it does when full
            journal = proxy.state.writer.journal
            journal.max_bytes, limit = 0, journal.max_bytes
            try:
                client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=2)
            finally:
                journal.max_bytes = limit
    assert proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", {"reward": 0.75})[0] == 200
    proxy.flush()


def own_scrape(proxy: Proxy) -> set[str]:
    text = metrics_text(proxy.url)
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_real_prometheus_scrapes_tracetap_and_evaluates_the_shipped_rules(
        prometheus, scraped_proxy):
    target = f"127.0.0.1:{scraped_proxy.settings.port}"
    job = f'job="tracetap", instance="{target}"'
    chat = f'route="chat_completions", {job}'
    # A first round, scraped before the second: a series' first sample is its baseline, so
    # only increases after it count in rate() and increase() (the dropped series starts at
    # 0 from the proxy's start).
    drive_traffic(scraped_proxy, "prom-1", drop=False)
    poll(lambda: prometheus.value(f'tracetap_requests_total{{{chat}, code="200"}}') == 3,
         "a scrape of the first round")
    drive_traffic(scraped_proxy, "prom-2", drop=True)
    names = own_scrape(scraped_proxy)
    assert {"tracetap_requests_total", "tracetap_episodes_finished_total",
            "tracetap_upstream_healthy"} <= names
    assert not {name for name in names if "reward" in name or "integrity" in name}

    def stored_names() -> set[str] | None:
        found = set(prometheus.api("label/__name__/values", **{"match[]": f"{{{job}}}"}))
        return found if names <= found else None

    def dropped_alert() -> list[dict]:
        return [a for a in prometheus.api("alerts")["alerts"]
                if a["labels"]["alertname"] == "TracetapRecordsDropped" and a["state"] == "firing"]

    # Prometheus stored every series tracetap serves, under the same names.
    poll(stored_names, "every tracetap series in Prometheus")
    # ... and the exact counts: 7 chat answers (one the dropped call's), 2 upstream errors,
    # 10 records written and 1 dropped, 9 choices captured, all with token ids.
    expected = {
        f'tracetap_requests_total{{{chat}, code="200"}}': 7,
        f'tracetap_requests_total{{{chat}, code="400"}}': 2,
        f'tracetap_requests_total{{route="completions", {job}, code="200"}}': 2,
        f'tracetap_records_total{{{job}, outcome="written"}}': 10,
        f'tracetap_records_total{{{job}, outcome="dropped"}}': 1,
        f"tracetap_choices_total{{{job}}}": 9,
        # Labelled by reason, so no series at all while none is missing.
        f"sum(tracetap_token_ids_missing_total{{{job}}}) or vector(0)": 0,
        f"tracetap_episodes_finished_total{{{job}}}": 2,
        # The grades never reach it (the open page has none).
        f"count({{{job}, __name__=~\".*(reward|integrity).*\"}}) or vector(0)": 0,
        f"tracetap_upstream_healthy{{{job}}}": 1,
        f"tracetap_db_writes_ok{{{job}}}": 1,
        f"tracetap_paused{{{job}}}": 0,
    }
    poll(lambda: {q: prometheus.value(q) for q in expected}, "the exact counts",
         until=lambda seen: seen == expected)

    # The recording rules, evaluated on what was scraped.
    recorded_job = 'job="tracetap"'
    for rule, labels in [
        ("route_code:tracetap_requests:rate5m", 'route="chat_completions", code="200"'),
        ("route_code:tracetap_requests:rate5m", 'route="completions", code="200"'),
        ("outcome:tracetap_records:rate5m", 'outcome="written"'),
        ("outcome:tracetap_records:rate5m", 'outcome="dropped"'),
        ("route:tracetap_overhead_seconds:p50_5m", 'route="chat_completions"'),
        ("route:tracetap_overhead_seconds:p99_5m", 'route="chat_completions"'),
        ("route:tracetap_time_to_first_token_seconds:p50_5m", 'route="chat_completions"'),
        ("route:tracetap_time_to_first_token_seconds:p99_5m", 'route="chat_completions"'),
    ]:
        value = poll(lambda r=rule, s=labels: prometheus.value(f"{r}{{{recorded_job}, {s}}}"),
                     f"{rule}{{{labels}}} above 0")
        assert value > 0 and math.isfinite(value), (rule, labels, value)
    assert prometheus.value(f'route:tracetap_overhead_seconds:p99_5m{{{recorded_job}, '
                            f'route="chat_completions"}}') <= 0.1  # the top bucket

    # The dropped-records alert fires for this proxy, and nothing else does.
    (alert,) = poll(dropped_alert, "TracetapRecordsDropped firing")
    assert alert["labels"]["instance"] == target and alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook"] == "docs/alerts.md#tracetaprecordsdropped"
    firing = {a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"]
              if a["state"] == "firing"}
    assert firing == {"TracetapRecordsDropped"}

    # Every shipped rule loaded and evaluated without error.
    groups = prometheus.api("rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    assert {r["name"] for r in loaded} == {r.get("record") or r["alert"] for r in rules()}
    assert all(r["health"] == "ok" for r in loaded), [r for r in loaded if r["health"] != "ok"]

    # Each dashboard query, run the way Grafana would, returns data.
    dashboard = json.loads(DASHBOARD.read_text())
    for target_ in dashboard_targets(dashboard):
        expr = with_grafana_vars(target_["expr"])
        assert poll(lambda e=expr: prometheus.query(e), f"data for {expr}")
