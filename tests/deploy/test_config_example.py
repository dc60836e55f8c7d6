# SPDX-License-Identifier: ISC
"""dispatcher.ini.example: every key the code knows is documented, in the
right section, with the code's default (read from the code's key tables,
lib/config.c and providers/NAME*.c, not from a copy); the file runs
as shipped once [database] conninfo and [provider.http] allow_hosts are
set; and the worker's command line: --check-config touches neither the
metrics port nor the database, --instance N lets N workers share one file.
"""
import glob
import os
import re
import socket
import subprocess


from outbox_test import (  # noqa: E402
    BUILD_DIR, ROOT, Dispatcher, enqueue, kill_switch, query, scalar, wait_for, worker_dsn,
)

EXAMPLE = os.path.join(ROOT, "dispatcher.ini.example")
DAEMON = os.path.join(BUILD_DIR, "outbox-dispatcher")
TABLE = re.compile(r'\{\s*"([a-z_]+)",\s*CONF_([A-Z]+),\s*"([^"]*)"')
CORE = (("core_keys_database", "database"), ("core_keys_dispatcher", "dispatcher"),
        ("core_keys_metrics", "metrics"), ("core_keys_log", "log"),
        ("core_keys_console", "console"),
        ("provider_common_keys", "common"))


def tables():
    """{section: {key: default}} from the code's key tables."""
    src = open(os.path.join(ROOT, "lib", "config.c")).read()
    out = {}
    for name, section in CORE:
        body = src.split(f"{name}[] = {{", 1)[1].split("};", 1)[0]
        out[section] = {k: d for k, _t, d in TABLE.findall(body)}
    for f in sorted(os.listdir(os.path.join(ROOT, "providers"))):
        path = os.path.join(ROOT, "providers", f)
        if os.path.isfile(os.path.join(path, f + ".c")):
            # A plugin split into providers/NAME/: its key table is in NAME.c.
            path, f = os.path.join(path, f + ".c"), f + ".c"
        if f.endswith(".c"):
            body = open(path).read()
            m = re.search(r"struct outbox_conf_key \w+\[\] = \{(.*?)\n\};", body, re.S)
            if m:
                out["provider." + f[:-2]] = {k: d for k, _t, d in TABLE.findall(m.group(1))}
    return out


def provider_default(provider, key, common):
    """A common key's default for one provider: a value the provider's
    sources give that key (its own table, or a table of defaults of its
    own), else the common table's."""
    for path in sorted(glob.glob(os.path.join(ROOT, "providers", provider + "*.c")) +
                       glob.glob(os.path.join(ROOT, "providers", provider, "*.c"))):
        m = re.search(r'\{\s*"' + key + r'",\s*(?:CONF_[A-Z]+,\s*)?"([^"]*)"', open(path).read())
        if m:
            return m.group(1)
    return common[key]


def example():
    """{section: {key: value}} of the example, the commented-out (opt-in)
    sections and settings included (";[section]", ";key = value")."""
    secs, cur = {}, None
    for line in open(EXAMPLE):
        m = re.match(r";?\[([^\]]+)\]\s*$", line)
        if m:
            cur = m.group(1)
            secs.setdefault(cur, {})
            continue
        m = re.match(r";?([a-z_]+)\s*=\s*(.*?)\s*$", line)
        if m and cur:
            secs[cur][m.group(1)] = m.group(2)
    return secs


def test_every_key_is_documented_with_the_codes_default():
    ex, code = example(), tables()
    text = open(EXAMPLE).read()
    problems = []
    for key, default in code["common"].items():
        m = re.search(rf"^;\s+{key} =[ \t]*(\S*)", text, re.M)
        if not m:
            problems.append(f"(common) {key}: missing")
        elif default and m.group(1) != default:   # "key =    text": an empty default
            problems.append(f"(common) {key}: example says {m.group(1)!r}, code {default!r}")
    for section, keys in code.items():
        if section == "common":
            continue
        for key, default in keys.items():
            if key not in ex.get(section, {}):
                problems.append(f"[{section}] {key}: missing")
            elif ex[section][key] != default:
                problems.append(f"[{section}] {key}: example says {ex[section][key]!r}, "
                                f"code default is {default!r}")
    # Common keys a provider section lists: the value that provider uses.
    for section, kv in ex.items():
        if not section.startswith("provider."):
            continue
        for key, value in kv.items():
            if key in code["common"] and key not in code.get(section, {}):
                want = provider_default(section[9:], key, code["common"])
                if value != want:
                    problems.append(f"[{section}] {key}: example says {value!r}, code {want!r}")
    assert not problems, problems


def test_the_check_above_can_fail(tmp_path, monkeypatch):
    """The comparison reads the file: a drifted default is caught."""
    import test_config_example as me
    text = open(EXAMPLE).read()
    bad = tmp_path / "bad.ini"
    bad.write_text(text.replace("lease_seconds = 30\n", "lease_seconds = 31\n")
                       .replace(";auth_retry_ms = 60000", ";auth_retry_ms = 1"))
    monkeypatch.setattr(me, "EXAMPLE", str(bad))
    try:
        me.test_every_key_is_documented_with_the_codes_default()
    except AssertionError as e:
        assert "lease_seconds" in str(e) and "auth_retry_ms" in str(e), e
    else:
        raise AssertionError("a drifted default was not caught")


def shipped(tmp_path, conninfo, allow="127.0.0.1"):
    """The example as a user copies it, with only the two settings made."""
    text = open(EXAMPLE).read()
    text = re.sub(r"^conninfo =.*$", f"conninfo = {conninfo}", text, count=1, flags=re.M)
    text = re.sub(r"^allow_hosts =.*$", f"allow_hosts = {allow}", text, count=1, flags=re.M)
    p = tmp_path / "dispatcher.ini"
    p.write_text(text)
    return p


def free_port_pair():
    """A port P with P+1 free too (for instances 1 and 2)."""
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        t = socket.socket()
        try:
            t.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
        finally:
            s.close()
            t.close()
    raise AssertionError("no two adjacent free ports")


def http_get(port, path):
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


def start(path, tmp_path, name, *args):
    log = open(tmp_path / f"{name}.log", "ab")
    p = subprocess.Popen([DAEMON, "--config", str(path), *args], stdout=log, stderr=log,
                         env=dict(os.environ, AI_ACTIONS_ENABLED="true"))
    return p, log


def stop(p, log):
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    log.close()


def test_example_runs_as_shipped_and_sends(db, conn, tmp_path, sink, shipped_port):
    """Only conninfo (a login granted outbox_dispatcher alone) and
    allow_hosts set: the worker starts, serves on the listed port, and
    sends an effect."""
    path = shipped(tmp_path, worker_dsn(db))
    r = subprocess.run([DAEMON, "--config", str(path), "--check-config"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/ok/shipped", {"body": {"x": 1}})
    p, log = start(path, tmp_path, "shipped")
    try:
        wait_for(lambda: scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s",
                                (eid,)) == "completed" or p.poll() is not None,
                 timeout=60, what="the effect sent by the shipped config")
        assert p.poll() is None, (tmp_path / "shipped.log").read_text()
        assert [r["path"] for r in sink.received()] == ["/ok/shipped"]
        # The documented port, and healthy.
        wait_for(lambda: http_get(shipped_port, "/healthz") == (200, "ok"), timeout=30,
                 what=f"/healthz 200 on 127.0.0.1:{shipped_port}")
    finally:
        stop(p, log)


def test_check_config_binds_no_port_and_connects_nowhere(tmp_path):
    """--check-config beside a running instance (its port taken) and with a
    database that must not be called: it loads the config and the plugins,
    and touches neither."""
    metrics = socket.socket()
    metrics.bind(("127.0.0.1", 0))
    metrics.listen(1)
    fake_db = socket.socket()
    fake_db.bind(("127.0.0.1", 0))
    fake_db.listen(5)
    fake_db.setblocking(False)
    try:
        path = shipped(tmp_path, f"host=127.0.0.1 port={fake_db.getsockname()[1]} dbname=x "
                                 "connect_timeout=2")
        text = path.read_text().replace("listen = 127.0.0.1:9464",
                                        f"listen = 127.0.0.1:{metrics.getsockname()[1]}")
        path.write_text(text)
        r = subprocess.run([DAEMON, "--config", str(path), "--check-config"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "config_ok" in r.stderr, r.stderr
        try:
            c, _ = fake_db.accept()
            c.close()
            raise AssertionError("--check-config connected to the database")
        except BlockingIOError:
            pass
        # And a broken file still fails it.
        path.write_text(text.replace("lease_seconds = 30", "lease_seconds = many"))
        r = subprocess.run([DAEMON, "--config", str(path), "--check-config"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "lease_seconds" in r.stderr, r.stderr
    finally:
        metrics.close()
        fake_db.close()


def test_two_instances_from_one_config(db, conn, dispatchers, sink):
    """--instance 1 and 2 with the same file: names NAME-1 and NAME-2,
    metrics on the base port and the next, both lease and send."""
    base = free_port_pair()
    cfg = {"metrics": {"listen": f"127.0.0.1:{base}"}, "dispatcher": {"worker_name": "web3"}}
    w1 = dispatchers(cfg, name="shared", args=["--instance", "1"])
    # The same file: the second worker reads the first one's config.
    w2 = Dispatcher(db, w1.tmp, {}, name="shared2", args=["--instance", "2"])
    w2.config_path = w1.config_path
    w2.start()
    try:
        assert wait_for(lambda: http_get(base, "/healthz") == (200, "ok"), timeout=30,
                        what="instance 1 healthy")
        assert wait_for(lambda: http_get(base + 1, "/healthz") == (200, "ok"), timeout=30,
                        what="instance 2 healthy")
        assert 'outbox_worker_info{worker="web3-1"} 1' in http_get(base, "/metrics")[1]
        assert 'outbox_worker_info{worker="web3-2"} 1' in http_get(base + 1, "/metrics")[1]
        kill_switch(conn, True)
        ids = [enqueue(conn, "http", sink.url + f"/delay/50?n={i}", {"body": {}}) for i in range(40)]
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE effect_id = ANY(%s::uuid[]) "
                                      "AND state = 'completed'", (ids,)) == len(ids),
                 timeout=60, what="all sent")
        workers = {r[0] for r in query(conn, "SELECT DISTINCT worker FROM effect_attempts "
                                             "WHERE effect_id = ANY(%s::uuid[])", (ids,))}
        assert workers <= {"web3-1", "web3-2"}, workers
        names = {r[0] for r in query(conn, "SELECT application_name FROM pg_stat_activity "
                                           "WHERE application_name LIKE 'outbox %%'")}
        assert {"outbox lease web3-1", "outbox lease web3-2"} <= names, names
    finally:
        w2.stop()


def test_instance_is_checked(tmp_path):
    path = shipped(tmp_path, "host=127.0.0.1 port=1 dbname=x")
    for bad in ("eu-1", "0", "1001", "01"):
        r = subprocess.run([DAEMON, "--config", str(path), "--instance", bad, "--check-config"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "--instance" in r.stderr, (bad, r.stderr)
    path.write_text(path.read_text().replace("listen = 127.0.0.1:9464", "listen = 127.0.0.1:65535"))
    r = subprocess.run([DAEMON, "--config", str(path), "--instance", "2", "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "65535" in r.stderr, r.stderr


def test_credentials_directory_expands(tmp_path):
    """file:${CREDENTIALS_DIRECTORY}/NAME: one path for every instance."""
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "outbox_db-conninfo").write_text("host=127.0.0.1 port=1 dbname=x\n")
    path = shipped(tmp_path, "file:${CREDENTIALS_DIRECTORY}/outbox_db-conninfo")
    env = dict(os.environ, CREDENTIALS_DIRECTORY=str(creds))
    r = subprocess.run([DAEMON, "--config", str(path), "--check-config"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    env.pop("CREDENTIALS_DIRECTORY")
    r = subprocess.run([DAEMON, "--config", str(path), "--check-config"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 1 and "CREDENTIALS_DIRECTORY" in r.stderr, r.stderr
