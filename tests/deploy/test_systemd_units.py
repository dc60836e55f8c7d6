# SPDX-License-Identifier: ISC
"""The systemd units (verified with systemd-analyze, hardening present) and
the worker's /metrics and /healthz endpoints scraped during a real run,
their counters checked against the database.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


from outbox_test import (  # noqa: E402
    BUILD_DIR, ROOT, Dispatcher, enqueue, free_port, kill_switch, query, scalar, wait_for,
    worker_dsn,
)

UNIT_DIR = os.path.join(ROOT, "systemd")
TEMPLATE = "outbox-dispatcher@.service"
TARGET = "outbox-dispatcher.target"
DAEMON = os.path.join(BUILD_DIR, "outbox-dispatcher")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")

needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None,
                                   reason="systemd-analyze is not installed (Debian: apt-get install systemd)")
needs_worker = pytest.mark.skipif(not os.access(DAEMON, os.X_OK), reason="worker not built")


# ---- the units -------------------------------------------------------------

def unit_directives(path):
    """{(section, key): [values]} of a unit file (keys may repeat)."""
    out, section = {}, None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            assert sep, f"{path}: not a key=value line: {line!r}"
            out.setdefault((section, key.strip()), []).append(value.strip())
    return out


@pytest.fixture
def installed_units(tmp_path):
    """The units as `make install PREFIX=<tmp>` writes them, with
    <tmp>/bin/outbox-dispatcher a real executable (the built worker, or
    /bin/true when it is not built yet)."""
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    units = tmp_path / "units"
    units.mkdir()
    for name in ("outbox-dispatcher", "outboxctl", "outbox-console"):
        built = os.path.join(BUILD_DIR, name)
        exe = prefix / "bin" / name
        shutil.copy(built if os.access(built, os.X_OK) else "/bin/true", exe)
        os.chmod(exe, 0o755)
    for name in os.listdir(UNIT_DIR):
        if name.endswith((".service", ".target", ".timer")):
            with open(os.path.join(UNIT_DIR, name)) as f:
                text = f.read().replace("@PREFIX@", str(prefix))
            (units / name).write_text(text)
    return units


def analyze(*args):
    return subprocess.run([SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=60)


def test_systemd_units_exist():
    for name in (TEMPLATE, TARGET, "outbox-prune.service", "outbox-prune.timer", "environment.example"):
        assert os.path.isfile(os.path.join(UNIT_DIR, name)), name
    with open(os.path.join(UNIT_DIR, TEMPLATE)) as f:
        assert "@PREFIX@/bin/outbox-dispatcher --config " in f.read()


@needs_analyze
def test_systemd_analyze_verify(installed_units):
    # An instance of the template (the template is found beside it) and the
    # target; any complaint (unknown key, bad syntax, missing executable)
    # is a failure, not just a non-zero exit.
    r = analyze("verify", "--man=no", str(installed_units / "outbox-dispatcher@1.service"),
                str(installed_units / TARGET), str(installed_units / "outbox-prune.service"),
                str(installed_units / "outbox-prune.timer"),
                str(installed_units / "outbox-console.service"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr


@needs_analyze
def test_systemd_analyze_verify_catches_breakage(installed_units):
    """The check above is able to fail: a typo and a missing binary."""
    unit = installed_units / TEMPLATE
    text = unit.read_text()
    unit.write_text(text.replace("ProtectHome=yes", "ProtectHome=yes\nProtectHomeTypo=yes"))
    r = analyze("verify", "--man=no", str(installed_units / "outbox-dispatcher@1.service"))
    assert "ProtectHomeTypo" in r.stdout + r.stderr
    unit.write_text(text.replace("/bin/outbox-dispatcher ", "/bin/no-such-binary "))
    r = analyze("verify", "--man=no", str(installed_units / "outbox-dispatcher@1.service"))
    assert r.returncode != 0
    assert "no-such-binary" in r.stdout + r.stderr


@needs_analyze
def test_systemd_security_exposure(installed_units):
    # systemd's own score: 0 (locked down) .. 10 (unprotected); the unit is
    # at 1.4 with the network it needs.  Fail if a change loosens it.
    r = analyze("security", "--offline=yes", "--threshold=20",
                str(installed_units / "outbox-dispatcher@1.service"))
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 2.0, r.stdout
    assert r.returncode == 0, r.stdout + r.stderr


@needs_analyze
def test_console_unit_is_locked_down_like_the_workers(installed_units):
    r = analyze("security", "--offline=yes", "--threshold=20",
                str(installed_units / "outbox-console.service"))
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 2.0, r.stdout
    worker = unit_directives(os.path.join(UNIT_DIR, TEMPLATE))
    console = unit_directives(os.path.join(UNIT_DIR, "outbox-console.service"))
    hardening = [k for k in worker if k[0] == "Service" and k[1].startswith(
        ("Protect", "Private", "Restrict", "NoNewPrivileges", "SystemCall", "Capability",
         "MemoryDeny", "LockPersonality", "DynamicUser", "UMask"))]
    assert hardening
    for k in hardening:
        assert console.get(k) == worker[k], k


def test_systemd_template_hardening():
    d = unit_directives(os.path.join(UNIT_DIR, TEMPLATE))

    def one(section, key):
        v = d.get((section, key))
        assert v, f"[{section}] {key}= missing"
        return v[-1]

    assert one("Service", "Type") == "notify"
    assert one("Service", "NotifyAccess") == "main"
    assert one("Service", "WatchdogSec") == "30"
    # One config for every instance; the instance number picks the worker
    # name and the metrics port (--instance).
    assert one("Service", "ExecStart") == \
        "@PREFIX@/bin/outbox-dispatcher --config /etc/outbox-dispatcher/dispatcher.ini --instance %i"
    # Reload signals the worker and waits for its verdict, written to the
    # runtime directory (a refused config fails `systemctl reload`).
    assert d[("Service", "ExecReload")] == ["@PREFIX@/bin/outbox-dispatcher --reload $MAINPID"]
    assert one("Service", "RuntimeDirectory") == "outbox-dispatcher/%i"
    assert one("Service", "RuntimeDirectoryMode") == "0700"
    assert one("Service", "Restart") == "on-failure"
    assert one("Service", "KillMode") == "mixed"
    assert one("Service", "KillSignal") == "SIGTERM"
    # Above the default shutdown_grace_ms (10 s) with room to record outcomes.
    stop = one("Service", "TimeoutStopSec")
    assert stop.isdigit() and int(stop) >= 20
    assert one("Service", "EnvironmentFile") == "-/etc/outbox-dispatcher/environment"
    assert any(v.startswith("outbox:/etc/outbox-dispatcher/credentials")
               for v in d[("Service", "LoadCredential")])
    for key, value in [
        ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"), ("PrivateDevices", "yes"), ("DynamicUser", "yes"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"), ("UMask", "0077"),
        ("CapabilityBoundingSet", ""), ("AmbientCapabilities", ""),
        ("ProtectKernelTunables", "yes"), ("ProtectKernelModules", "yes"),
        ("ProtectControlGroups", "yes"), ("RestrictNamespaces", "yes"),
        ("LockPersonality", "yes"), ("MemoryDenyWriteExecute", "yes"),
        ("RestrictRealtime", "yes"), ("RestrictSUIDSGID", "yes"),
        ("SystemCallArchitectures", "native"),
    ]:
        assert one("Service", key) == value, key
    assert "@system-service" in d[("Service", "SystemCallFilter")]
    assert one("Unit", "PartOf") == TARGET
    assert one("Install", "WantedBy") == TARGET
    t = unit_directives(os.path.join(UNIT_DIR, TARGET))
    assert t[("Install", "WantedBy")] == ["multi-user.target"]


def test_systemd_environment_example_is_off():
    """The example ships with sends off: copying it never arms a host."""
    with open(os.path.join(UNIT_DIR, "environment.example")) as f:
        values = [line.strip() for line in f if line.strip().startswith("AI_ACTIONS_ENABLED=")]
    assert values == ["AI_ACTIONS_ENABLED=false"]


def test_ipaddressdeny_drop_in_example(installed_units):
    """The network wall drop-in denies loopback, link-local (cloud metadata)
    and the other metadata addresses, allows the database's address, is a
    valid drop-in of the template, and the package ships it."""
    path = os.path.join(UNIT_DIR, "ipaddressdeny.conf.example")
    d = unit_directives(path)
    deny = " ".join(d[("Service", "IPAddressDeny")]).split()
    for must in ("localhost", "link-local", "fd00:ec2::254/128", "100.100.100.200/32",
                 "168.63.129.16/32"):
        assert must in deny, must
    assert d[("Service", "IPAddressAllow")], "the database's address is allowed"
    assert set(k for k, _ in d) == {"Service"}
    with open(os.path.join(ROOT, "debian", "outbox-dispatcher.examples")) as f:
        assert "systemd/ipaddressdeny.conf.example" in f.read().split()
    if SYSTEMD_ANALYZE is not None:
        dropin = installed_units / "outbox-dispatcher@.service.d"
        dropin.mkdir()
        shutil.copy(path, dropin / "ipaddressdeny.conf")
        r = analyze("verify", "--man=no", str(installed_units / "outbox-dispatcher@1.service"))
        assert r.returncode == 0 and (r.stdout + r.stderr).strip() == "", r.stdout + r.stderr


# ---- /metrics and /healthz on a running worker -----------------------------

SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse_metrics(text):
    """Prometheus text format -> {(name, frozenset(labels)): value}; checks
    that every sample follows its family's # TYPE."""
    types, samples = {}, {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"second TYPE for {name}"
            assert kind in ("counter", "gauge", "histogram"), line
            if kind == "counter":
                assert name.endswith("_total"), name
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line)
        assert m, f"bad sample line {line!r}"
        name, labels, value = m.groups()
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or types.get(base) == "histogram", f"{name} has no TYPE before it"
        assert name.startswith("outbox_"), name
        lab = {}
        if labels:
            pos = 0
            for lm in LABEL_RE.finditer(labels):
                assert lm.start() == pos, f"bad labels {labels!r}"
                lab[lm.group(1)] = re.sub(r"\\(.)", lambda x: "\n" if x.group(1) == "n" else x.group(1),
                                          lm.group(2))
                pos = lm.end()
            assert pos == len(labels), f"bad labels {labels!r}"
        samples[(name, frozenset(lab.items()))] = float(value)
    return samples


def metric(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def http_get(port, path):
    """(status, body, content type); (None, error, None) when nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode(), r.headers.get("Content-Type")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers.get("Content-Type")
    except (urllib.error.URLError, ConnectionError) as e:
        return None, str(e), None


class Sink:
    """A loopback HTTP endpoint: /ok/... answers 200 with an id, /bad/...
    422, /busy/... 503 with Retry-After: 0."""

    def __init__(self):
        sink = self
        self.requests = []
        self.lock = threading.Lock()

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                with sink.lock:
                    sink.requests.append(self.path)
                    seq = len(sink.requests)
                if self.path.startswith("/ok"):
                    code, body, extra = 200, json.dumps({"id": f"sink-{seq}"}), {}
                elif self.path.startswith("/bad"):
                    code, body, extra = 422, '{"error":"unprocessable"}', {}
                else:
                    code, body, extra = 503, '{"error":"busy"}', {"Retry-After": "0"}
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.server.shutdown()
        self.server.server_close()


OUTCOMES = ("accepted", "not_sent", "retry", "terminal", "ambiguous")


@needs_worker
def test_metrics_scrape_agrees_with_database(conn, dispatchers):
    port = free_port()
    kill_switch(conn, True)
    with Sink() as sink:
        ok = [enqueue(conn, "http", sink.url(f"/ok/{i}"), {"body": {"n": i}}) for i in range(12)]
        bad = [enqueue(conn, "http", sink.url(f"/bad/{i}"), {"body": {"n": i}}) for i in range(3)]
        busy = [enqueue(conn, "http", sink.url(f"/busy/{i}"), {"body": {"n": i}}) for i in range(2)]
        w = dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"},
                         "provider.http": {"max_attempts": 3, "backoff_base_ms": 1, "breaker_failures": 1000,
                                           "backoff_cap_ms": 5},
                         "dispatcher": {"maintenance_interval_ms": 200}})

        # Scraped while it runs: always well-formed.
        code, text, ctype = http_get(port, "/metrics")
        assert code == 200, text
        assert ctype.startswith("text/plain; version=0.0.4")
        assert metric(parse_metrics(text), "outbox_worker_info", worker=w.name) == 1

        all_ids = ok + bad + busy

        def finished():
            rows = query(conn, "SELECT state, count(*) FROM outbox_effects WHERE effect_id = ANY(%s::uuid[]) "
                               "GROUP BY 1", (all_ids,))
            done = sum(n for st, n in rows if st in ("completed", "failed"))
            return True if done == len(all_ids) else (False, dict(rows))

        try:
            wait_for(lambda: finished() is True, timeout=60, what="every effect completed or failed")
        except AssertionError as e:
            raise AssertionError(f"{e}: {finished()}\n{w.log()[-4000:]}") from None
        assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE effect_id = ANY(%s::uuid[]) "
                            "AND state = 'completed'", (ok,)) == len(ok)

        def db_counts():
            rows = query(conn, "SELECT outcome_class, count(*) FROM effect_attempts "
                               "WHERE worker = %s GROUP BY 1", (w.name,))
            return {k: v for k, v in rows}

        def agree():
            code, text, _ = http_get(port, "/metrics")
            if code != 200:
                return None
            s = parse_metrics(text)
            want = db_counts()
            got = {o: metric(s, "outbox_sends_total", provider="http", outcome=o) for o in OUTCOMES}
            if any(got[o] != want.get(o, 0) for o in OUTCOMES):
                return None
            if metric(s, "outbox_sends_in_flight") != 0 or metric(s, "outbox_db_up") != 1:
                return None
            return s

        s = wait_for(agree, timeout=30, what="/metrics counters equal to effect_attempts")
        # A send is counted when its answer comes, an exhausted retry once
        # outbox_complete has answered: after the attempt row agree() saw.
        s = wait_for(lambda: (lambda s: s if metric(s, "outbox_retries_exhausted_total") >= len(busy)
                              else None)(parse_metrics(http_get(port, "/metrics")[1])),
                     timeout=30, what="outbox_retries_exhausted_total counting every busy effect")
        want = db_counts()
        assert want.get("accepted") == len(ok)
        assert want.get("terminal") == len(bad)
        assert want.get("retry") == len(busy) * 3          # max_attempts = 3, each 503
        total = sum(want.get(o, 0) for o in OUTCOMES)
        assert metric(s, "outbox_send_duration_seconds_count", provider="http") == total
        assert metric(s, "outbox_send_duration_seconds_bucket", provider="http", le="+Inf") == total
        assert metric(s, "outbox_send_duration_seconds_sum", provider="http") >= 0
        assert metric(s, "outbox_retries_exhausted_total") == len(busy)
        assert metric(s, "outbox_leased_total") >= total
        assert metric(s, "outbox_lease_lost_total") == 0
        assert metric(s, "outbox_kill_switch_blocked_total") == 0
        assert metric(s, "outbox_unknown_effects") == \
            scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'unknown'")
        assert metric(s, "outbox_kill_switch_sends_allowed") == 1
        # The sink saw exactly the calls the metrics counted.
        assert len(sink.requests) == total

        code, body, _ = wait_for(lambda: (lambda r: r if r[0] == 200 else None)(http_get(port, "/healthz")),
                                 timeout=15, what="/healthz 200")
        assert body == "ok"
        code, body, _ = http_get(port, "/nope")
        assert code == 404

        # Kill switch off: the gauge says so, nothing new is leased or sent.
        # (outbox_kill_switch_blocked_total counts only the sends caught at
        # the sending transition itself, i.e. leased just before the flip.)
        kill_switch(conn, False)
        held = [enqueue(conn, "http", sink.url(f"/ok/held-{i}"), {"body": {}}) for i in range(3)]

        def scrape():
            return parse_metrics(http_get(port, "/metrics")[1])

        s = wait_for(lambda: (lambda s: s if metric(s, "outbox_kill_switch_sends_allowed") == 0
                              else None)(scrape()),
                     timeout=30, what="outbox_kill_switch_sends_allowed == 0")
        # Two more housekeeping passes (the heartbeat age drops each time),
        # each with polls in between, and still nothing sent.
        for _ in range(2):
            age = metric(scrape(), "outbox_loop_heartbeat_age_seconds")
            wait_for(lambda: metric(scrape(), "outbox_loop_heartbeat_age_seconds") < age,
                     timeout=30, what="a housekeeping pass")
        s = scrape()
        assert metric(s, "outbox_kill_switch_sends_allowed") == 0
        assert metric(s, "outbox_sends_in_flight") == 0
        assert metric(s, "outbox_sends_total", provider="http", outcome="accepted") == len(ok)
        assert not [r for r in sink.requests if "held" in r]
        assert scalar(conn, "SELECT count(*) FROM effect_attempts WHERE effect_id = ANY(%s::uuid[])",
                      (held,)) == 0
        assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE effect_id = ANY(%s::uuid[]) "
                            "AND state = 'pending' AND attempts = 0", (held,)) == len(held)

        # On again: the held effects go out, each once, and the counters
        # still agree with the attempts log.
        kill_switch(conn, True)
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE effect_id = ANY(%s::uuid[]) "
                                      "AND state = 'completed'", (held,)) == len(held),
                 timeout=30, what="held effects completed")
        s = wait_for(agree, timeout=30, what="/metrics counters equal to effect_attempts again")
        assert metric(s, "outbox_sends_total", provider="http", outcome="accepted") == len(ok) + len(held)
        assert sorted(r for r in sink.requests if "held" in r) == [f"/ok/held-{i}" for i in range(3)]
        wait_for(lambda: metric(scrape(), "outbox_kill_switch_sends_allowed") == 1,
                 timeout=30, what="outbox_kill_switch_sends_allowed == 1")


@needs_worker
def test_metrics_healthz_reports_database_down(db, tmp_path):
    port = free_port()
    dead = free_port()     # nothing listens there
    d = Dispatcher(db, tmp_path, {"database": {"conninfo": f"host=127.0.0.1 port={dead} dbname=x "
                                                           "connect_timeout=2"},
                                  "metrics": {"listen": f"127.0.0.1:{port}"},
                                  "dispatcher": {"maintenance_interval_ms": 200}})
    d.start()
    try:
        code, body, _ = wait_for(
            lambda: (lambda r: r if r[0] == 503 and "database" in r[1] else None)(http_get(port, "/healthz")),
            timeout=30, what="/healthz 503 naming the database")
        assert "unreachable" in body, body
        s = parse_metrics(http_get(port, "/metrics")[1])
        assert metric(s, "outbox_db_up") == 0
    finally:
        d.stop()


@needs_worker
def test_metrics_bind_failure_names_the_address(db, tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    addr = "127.0.0.1:%d" % holder.getsockname()[1]
    d = Dispatcher(db, tmp_path, {"metrics": {"listen": addr}})
    try:
        d.start(wait_ready=False)
        rc = d.wait(timeout=30)
        assert rc != 0
        log = d.log()
        assert addr in log and "Address already in use" in log, log
    finally:
        holder.close()
        if d.proc.poll() is None:
            d.kill()
        else:
            d.logf.close()


# ---- sd_notify from a running worker ---------------------------------------

class NotifySocket:
    """A stand-in for systemd's NOTIFY_SOCKET: collects the datagrams."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                continue
            except OSError:
                return

    def count(self, pred):
        return sum(1 for m in list(self.messages) if pred(m))

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.close()


@needs_worker
def test_systemd_notify_protocol(dispatchers, tmp_path):
    sockdir = tempfile.mkdtemp(prefix="outbox-notify-")     # short: sun_path is 108 bytes
    ns = NotifySocket(os.path.join(sockdir, "notify"))
    try:
        w = dispatchers(env={"NOTIFY_SOCKET": ns.path, "WATCHDOG_USEC": "400000"})
        wait_for(lambda: ns.count(lambda m: m.startswith("READY=1\nSTATUS=")), what="READY=1")
        # Pings from the loop every WatchdogSec/2 = 200 ms.
        wait_for(lambda: ns.count(lambda m: m == "WATCHDOG=1") >= 3, timeout=10, what="3 watchdog pings")

        # SIGHUP: RELOADING=1 with MONOTONIC_USEC, then READY=1 again.
        w.signal(signal.SIGHUP)
        wait_for(lambda: ns.count(lambda m: m.startswith("READY=1\nSTATUS=config reloaded")),
                 what="READY=1 after reload")
        reloading = [m for m in ns.messages if m.startswith("RELOADING=1")]
        assert len(reloading) == 1 and re.search(r"\nMONOTONIC_USEC=\d+$", reloading[0]), reloading

        # A broken config is refused: READY=1 with a status that says so.
        with open(w.config_path, "a") as f:
            f.write("\n[dispatcher]\nlease_seconds = banana\n")
        w.signal(signal.SIGHUP)
        wait_for(lambda: ns.count(lambda m: m.startswith("READY=1\nSTATUS=reload failed")),
                 what="READY=1 reporting the failed reload")
        assert w.proc.poll() is None

        # SIGTERM: STOPPING=1, and a clean exit.
        assert w.stop() == 0
        # Sent before the exit; the collector's thread may take it in after.
        wait_for(lambda: ns.count(lambda m: m.startswith("STOPPING=1")), timeout=10,
                 what="STOPPING=1")
        assert ns.count(lambda m: m.startswith("STOPPING=1")) == 1
        # Every message is KEY=VALUE lines (a STATUS never spans lines).
        for m in ns.messages:
            for line in m.split("\n"):
                assert re.match(r"^[A-Z_]+=", line), m
    finally:
        ns.close()
        shutil.rmtree(sockdir, ignore_errors=True)


# ---- the unit's sandbox against what the worker really does ----------------

def expand_syscall_group(name, seen=None):
    """The syscall names of a systemd group, nested groups expanded."""
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    r = analyze("syscall-filter", name)
    assert r.returncode == 0, r.stderr
    out = set()
    for line in r.stdout.splitlines()[1:]:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        out |= expand_syscall_group(line, seen) if line.startswith("@") else {line}
    return out


def sanitizer_build(path):
    with open(path, "rb") as f:
        return b"__asan_init" in f.read() or b"__ubsan_handle" in f.read()


@needs_analyze
@needs_worker
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_systemd_sandbox_fits_the_worker(conn, db, tmp_path):
    """Run the worker under strace through start, sends, a reload and a stop,
    and check what it did against the unit's SystemCallFilter=,
    RestrictAddressFamilies= and MemoryDenyWriteExecute=."""
    if sanitizer_build(DAEMON):
        pytest.skip("sanitizer build: the runtime makes syscalls the shipped binary does not")
    d = unit_directives(os.path.join(UNIT_DIR, TEMPLATE))
    allowed, denied = set(), set()
    for v in d[("Service", "SystemCallFilter")]:
        target = denied if v.startswith("~") else allowed
        for item in v.lstrip("~").split():
            target |= expand_syscall_group(item) if item.startswith("@") else {item}
    allowed -= denied
    families = set(d[("Service", "RestrictAddressFamilies")][-1].split())

    port = free_port()
    trace = tmp_path / "strace.out"
    kill_switch(conn, True)
    with Sink() as sink:
        ids = [enqueue(conn, "http", sink.url(f"/ok/{i}"), {"body": {"n": i}}) for i in range(3)]
        w = Dispatcher(db, tmp_path, {"metrics": {"listen": f"127.0.0.1:{port}"}})
        real_start = subprocess.Popen

        def traced(argv, **kw):
            return real_start(["strace", "-f", "-qq", "-o", str(trace)] + argv, **kw)
        subprocess.Popen = traced
        try:
            w.start()
        finally:
            subprocess.Popen = real_start
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE effect_id = ANY(%s::uuid[]) "
                                      "AND state = 'completed'", (ids,)) == len(ids),
                 what="sends completed under strace")
        assert http_get(port, "/metrics")[0] == 200
        # w.proc is strace: signal the worker itself, strace ends with it.
        with open(f"/proc/{w.proc.pid}/task/{w.proc.pid}/children") as f:
            worker_pid = int(f.read().split()[0])
        os.kill(worker_pid, signal.SIGHUP)
        wait_for(lambda: any(e.get("event") == "reloaded" for e in w.events()), what="reload")
        os.kill(worker_pid, signal.SIGTERM)
        assert w.wait(timeout=30) == 0
        w.logf.close()

    text = trace.read_text()
    used = set(re.findall(r"^\d+\s+([a-z_0-9]+)\(", text, re.M))
    # The exec itself, and what strace does around it, are not the worker's.
    used -= {"execve"}
    assert used, text[:2000]
    assert not used - allowed, f"syscalls outside SystemCallFilter: {sorted(used - allowed)}"
    socket_families = set(re.findall(r"\bsocket\((AF_[A-Z0-9]+)", text))
    assert socket_families <= families, f"socket families outside RestrictAddressFamilies: {socket_families}"
    wx = [line for line in text.splitlines()
          if re.search(r"\b(mmap|mprotect)\(", line) and "PROT_WRITE" in line and "PROT_EXEC" in line]
    assert not wx, f"writable+executable mappings (MemoryDenyWriteExecute=yes): {wx[:3]}"


# ---- truthful readiness and health ------------------------------------------

class Forwarder:
    """A TCP forwarder from a loopback port to PostgreSQL: the database
    "appears" at that port once it starts."""

    def __init__(self, port, to_port):
        self.port, self.to_port = port, to_port
        self.srv = None

    def start(self):
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", self.port))
        self.srv.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.to_port))
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                b.sendall(d)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        if self.srv:
            self.srv.close()


def notify_socket():
    sockdir = tempfile.mkdtemp(prefix="outbox-notify-")     # short: sun_path is 108 bytes
    return sockdir, NotifySocket(os.path.join(sockdir, "notify"))


def statuses(ns):
    return [m for m in list(ns.messages) if m.startswith("STATUS=")]


@needs_worker
def test_up_but_not_ready_while_the_database_is_down(db, tmp_path):
    """Database down at start: READY=1 once the first attempt failed, with
    STATUS= "up, not ready: database unreachable" (so that the start
    timeout does not restart the worker every minute, resetting its
    alerts' `for:`), no "serving" yet; STATUS=ready and "serving" once it
    answers, with no second READY=1."""
    port = free_port()
    sockdir, ns = notify_socket()
    fwd = None
    dsn = re.sub(r"port=\d+", f"port={port}", db) + " connect_timeout=2"
    d = Dispatcher(db, tmp_path, {"database": {"conninfo": worker_dsn(dsn)},
                                  "dispatcher": {"maintenance_interval_ms": 200}},
                   env={"NOTIFY_SOCKET": ns.path})
    try:
        d.start()
        wait_for(lambda: any(m.startswith("READY=1\nSTATUS=up, not ready: database unreachable")
                             for m in ns.messages), timeout=30, what="READY=1, not ready")
        # Two reconnect rounds later, still not serving, and told so.
        n = len(statuses(ns))
        wait_for(lambda: len(statuses(ns)) >= n + 2, timeout=30, what="more STATUS= while waiting")
        assert all("up, not ready: database unreachable" in m for m in statuses(ns)[n:]), statuses(ns)
        assert not any(e.get("event") == "serving" for e in d.events())
        fwd = Forwarder(port, int(os.environ["PGPORT"])).start()
        wait_for(lambda: any(m.startswith("STATUS=ready") for m in ns.messages), timeout=30,
                 what="STATUS=ready once the database answers")
        assert any(e.get("event") == "serving" for e in d.events())
        assert len([m for m in ns.messages if m.startswith("READY=1")]) == 1, ns.messages
    finally:
        d.stop()
        ns.close()
        shutil.rmtree(sockdir, ignore_errors=True)
        if fwd:
            fwd.close()


@needs_worker
def test_ready_waits_for_schema_permission_and_version(conn, db, tmp_path):
    """A worker login that may not read the schema version, then a schema
    too old: READY=1 as soon as the first is known, up but not ready,
    STATUS= and /healthz say which; STATUS=ready once fixed."""
    port = free_port()
    sockdir, ns = notify_socket()
    newest = query(conn, "SELECT version, name, checksum FROM schema_migrations ORDER BY version DESC LIMIT 1")[0]
    query(conn, "REVOKE SELECT ON schema_migrations FROM outbox_dispatcher")
    d = Dispatcher(db, tmp_path, {"metrics": {"listen": f"127.0.0.1:{port}"},
                                  "dispatcher": {"maintenance_interval_ms": 200}},
                   env={"NOTIFY_SOCKET": ns.path})
    try:
        d.start()
        wait_for(lambda: any("permission denied for table schema_migrations" in m for m in statuses(ns)),
                 timeout=30, what="STATUS= permission denied")
        code, body, _ = http_get(port, "/healthz")
        assert code == 503 and "permission denied" in body, (code, body)
        # Fixed grant, but the schema is one migration behind.
        query(conn, "DELETE FROM schema_migrations WHERE version = %s", (newest[0],))
        query(conn, "GRANT SELECT ON schema_migrations TO outbox_dispatcher")
        wait_for(lambda: any("too old" in m for m in statuses(ns)), timeout=30, what="STATUS= schema too old")
        code, body, _ = http_get(port, "/healthz")
        assert code == 503 and "outboxctl migrate" in body, (code, body)
        assert [m for m in ns.messages if m.startswith("READY=1")] == [
            "READY=1\nSTATUS=up, not ready: schema check failed: permission denied for table "
            "schema_migrations"], ns.messages
        query(conn, "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)", newest)
        wait_for(lambda: any(m.startswith("STATUS=ready") for m in ns.messages), timeout=30,
                 what="STATUS=ready")
        wait_for(lambda: http_get(port, "/healthz")[:2] == (200, "ok"), timeout=30, what="/healthz 200")
    finally:
        d.stop()
        ns.close()
        shutil.rmtree(sockdir, ignore_errors=True)


@needs_worker
def test_healthz_fails_while_leases_are_refused(conn, db, tmp_path):
    """Connected, but the database refuses the lease (a lost grant): after
    three refusals in a row /healthz is 503 with the reason, STATUS= says
    it, outbox_lease_errors_total counts them; healthy again once fixed."""
    port = free_port()
    sockdir, ns = notify_socket()
    # The claim (lease and mark in one) is what an idle worker tries first.
    lease_fn = ("outbox_lease(uuid, text, integer, integer, text[], boolean, timestamptz, uuid, "
                "integer), outbox_claim(uuid, text, integer, integer, text[], boolean, text[], uuid, "
                "timestamptz, uuid, boolean, integer, boolean, text[])")
    kill_switch(conn, True)
    d = Dispatcher(db, tmp_path, {"metrics": {"listen": f"127.0.0.1:{port}"},
                                  "dispatcher": {"maintenance_interval_ms": 200}},
                   env={"NOTIFY_SOCKET": ns.path})
    try:
        d.start()
        wait_for(lambda: http_get(port, "/healthz")[:2] == (200, "ok"), timeout=30, what="healthy")
        query(conn, f"REVOKE EXECUTE ON FUNCTION {lease_fn} FROM outbox_dispatcher")
        with Sink() as sink:
            eid = enqueue(conn, "http", sink.url("/ok/after"), {"body": {}})
            code, body, _ = wait_for(
                lambda: (lambda r: r if r[0] == 503 else None)(http_get(port, "/healthz")),
                timeout=30, what="/healthz 503 while leases are refused")
            assert "cannot lease" in body and "permission denied for function outbox_claim" in body, body
            s = parse_metrics(http_get(port, "/metrics")[1])
            assert metric(s, "outbox_lease_errors_total") >= 3
            assert metric(s, "outbox_db_up") == 1
            # The datagram is sent as the streak reaches three; the
            # collector's thread may take it in after /healthz answered.
            wait_for(lambda: any("cannot lease" in m for m in statuses(ns)), timeout=10,
                     what=f"STATUS= cannot lease (got {ns.messages})")
            query(conn, f"GRANT EXECUTE ON FUNCTION {lease_fn} TO outbox_dispatcher")
            wait_for(lambda: scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s",
                                    (eid,)) == "completed", timeout=30, what="sent once the grant is back")
            wait_for(lambda: http_get(port, "/healthz")[:2] == (200, "ok"), timeout=30, what="healthy again")
    finally:
        d.stop()
        ns.close()
        shutil.rmtree(sockdir, ignore_errors=True)
