# SPDX-License-Identifier: ISC
"""contrib/: the Prometheus alert rules and the Grafana dashboard.

promtool (Debian's, see scripts/install-deps.sh) checks the rules and runs
their unit tests on synthetic series (contrib/prometheus/tests.yml); every
alert must be exercised there; every dashboard query must parse; and every
metric named in the rules or the dashboard must be served by a live
worker's /metrics after it has sent something.
"""
import json
import os
import re
import shutil
import subprocess
import urllib.request

import yaml

from outbox_test import ROOT, enqueue, free_port, kill_switch, states, wait_for

RULES = os.path.join(ROOT, "contrib", "prometheus", "outbox-dispatcher.rules.yml")
RULE_TESTS = os.path.join(ROOT, "contrib", "prometheus", "tests.yml")
DASHBOARD = os.path.join(ROOT, "contrib", "grafana", "outbox-dispatcher.json")

# Not served by the worker: Prometheus records `up` for every scrape target.
PROMETHEUS_OWN = {"up"}


def promtool():
    p = shutil.which("promtool")
    assert p, "promtool is missing: scripts/install-deps.sh installs it from Debian's prometheus package"
    return p


def rule_exprs():
    doc = yaml.safe_load(open(RULES))
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def dashboard_exprs():
    dash = json.load(open(DASHBOARD))
    exprs = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            exprs.append((p["title"], t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            exprs.append((f"variable {v['name']}", v["definition"]))
    return exprs


# A metric name in PromQL: an identifier before a label matcher, or any
# outbox_* identifier (bare selectors such as `outbox_db_up == 0`).
NAME_BEFORE_BRACE = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{")
OUTBOX_NAME = re.compile(r"\b(outbox_[a-z0-9_]+)\b")


def metric_names(expr):
    return set(NAME_BEFORE_BRACE.findall(expr)) | set(OUTBOX_NAME.findall(expr))


def test_promtool_checks_the_rules():
    r = subprocess.run([promtool(), "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in r.stdout, r.stdout


def test_promtool_unit_tests_of_the_rules():
    r = subprocess.run([promtool(), "test", "rules", RULE_TESTS], capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout, r.stdout


def test_every_alert_fires_in_the_unit_tests():
    doc = yaml.safe_load(open(RULE_TESTS))
    fired = {t["alertname"] for case in doc["tests"] for t in case.get("alert_rule_test", [])
             if t.get("exp_alerts")}
    quiet = {t["alertname"] for case in doc["tests"] for t in case.get("alert_rule_test", [])
             if not t.get("exp_alerts")}
    alerts = set(rule_exprs())
    assert alerts - fired == set(), "alerts never shown firing in tests.yml"
    assert alerts - quiet == set(), "alerts never shown quiet in tests.yml"


def test_dashboard_queries_parse(tmp_path):
    """Grafana's variables replaced by values, each query becomes a recording
    rule: promtool parses them all."""
    dash = json.load(open(DASHBOARD))
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    rules = []
    for i, (title, expr) in enumerate(dashboard_exprs()):
        if expr.startswith("label_values("):
            m = re.fullmatch(r"label_values\((.*), *[a-z_]+\)", expr)
            assert m, expr
            expr = m.group(1)
        e = (expr.replace("$__rate_interval", "1m").replace("$job", ".*").replace("$instance", ".*"))
        assert "$" not in e, f"{title}: unknown variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}", "expr": e})
    f = tmp_path / "dashboard-queries.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool(), "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_covers_the_issue_panels():
    """The dashboard shows each thing an operator asked for, from these metrics."""
    exprs = " ".join(e for _, e in dashboard_exprs())
    for name in ("outbox_sends_total", "outbox_send_duration_seconds_bucket", "outbox_queue_lag_seconds",
                 "outbox_unknown_effects", "outbox_retries_exhausted_total", "outbox_kill_switch_sends_allowed",
                 "outbox_breaker_opened_total", "outbox_maintenance_pass_seconds", "outbox_db_up",
                 "outbox_loop_heartbeat_age_seconds"):
        assert name in exprs, name
    assert "by (provider, outcome)" in exprs


def test_every_metric_named_exists_on_a_live_worker(conn, dispatchers, sink):
    named = {}
    for alert, expr in rule_exprs().items():
        for n in metric_names(expr):
            named.setdefault(n, []).append(f"rule {alert}")
    for title, expr in dashboard_exprs():
        for n in metric_names(expr):
            named.setdefault(n, []).append(f"panel {title}")
    assert len(named) > 15, named

    # One accepted send and one terminal answer, so that the per-provider
    # series (sends by outcome, the duration histogram) exist.
    kill_switch(conn, True)
    enqueue(conn, "http", sink.url + "/ok", {"body": {"n": 1}})
    enqueue(conn, "http", sink.url + "/status/422", {"body": {"n": 2}})
    port = free_port()
    dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"}})
    wait_for(lambda: states(conn).get("completed") == 1 and states(conn).get("failed") == 1,
             what="one effect completed, one failed")

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return text if 'outbox_send_duration_seconds_count{provider="http"} 2' in text else None
    text = wait_for(scrape, what="both sends in /metrics")
    # Served: with a sample, or declared (# TYPE) for series that exist
    # only while something is set (a scope's, while one is paused).
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
              if line and not line.startswith("#")}
    served |= {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}

    missing = {n: where for n, where in named.items()
               if n not in served and n not in PROMETHEUS_OWN}
    assert not missing, f"named in contrib/ but not served by the worker: {missing}"
    unexpected_builtin = {n for n in named if not n.startswith("outbox_")} - PROMETHEUS_OWN
    assert not unexpected_builtin, unexpected_builtin


def test_outbox_ready_is_what_healthz_answers(db, dispatchers):
    """OutboxWorkerNotReady reads outbox_ready: 0 while /healthz answers 503
    with the loop turning (here: the database unreachable), 1 once it
    answers 200."""
    import urllib.error
    from outbox_test import worker_dsn

    def get(port, path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def ready_gauge(port):
        text = get(port, "/metrics")[1]
        return [line for line in text.splitlines() if line.startswith("outbox_ready ")]

    closed = free_port()
    down_port = free_port()
    dsn = " ".join(kv for kv in worker_dsn(db).split() if not kv.startswith(("host=", "port=")))
    dispatchers({"database": {"conninfo": f"{dsn} host=127.0.0.1 port={closed}"},
                 "metrics": {"listen": f"127.0.0.1:{down_port}"}}, name="down")
    code, body = wait_for(lambda: (lambda r: r if "database unreachable" in r[1] else None)(
        get(down_port, "/healthz")), what="/healthz saying the database is unreachable")
    assert code == 503, (code, body)
    age = re.search(r"^outbox_loop_heartbeat_age_seconds (\S+)$", get(down_port, "/metrics")[1], re.M)
    assert float(age.group(1)) < 30, "the loop turns: the heartbeat alone would not tell"
    assert ready_gauge(down_port) == ["outbox_ready 0"]

    up_port = free_port()
    dispatchers({"metrics": {"listen": f"127.0.0.1:{up_port}"}}, name="up")
    wait_for(lambda: get(up_port, "/healthz")[0] == 200, what="/healthz 200")
    assert ready_gauge(up_port) == ["outbox_ready 1"]
