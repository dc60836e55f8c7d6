# SPDX-License-Identifier: ISC
"""The Debian package (debian/, `make deb`): what it contains, lintian, and
an installation into a throwaway root whose binaries then run: --version,
--check-config with the shipped example, and a worker that sends one
effect through the installed plugins against the test PostgreSQL.

Exclusive: the package build compiles the whole tree (about a minute on
two cores) and would slow the timing-sensitive tests running beside it.
"""
import os
import re
import subprocess

import pytest

from debian_package import build_deb, dpkg_root, install_into_root
from outbox_test import (ROOT, Dispatcher, attempts, effect, enqueue, kill_switch, wait_for,
                         write_config)

pytestmark = pytest.mark.exclusive


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)


def multiarch():
    return run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"]).stdout.strip()


PLUGIN_DIR = f"/usr/lib/{multiarch()}/outbox-dispatcher/providers"


def upstream_version():
    """The version this tree builds: debian/changelog's, + git<count>.g<hash>
    in a git checkout (Makefile, VERSION)."""
    v = subprocess.run(["make", "-s", "--no-print-directory", "print-version"], cwd=ROOT,
                       capture_output=True, text=True, check=True).stdout.strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+(\+git\d+\.g[0-9a-f]{9}(\.dirty)?)?", v), v
    return v


@pytest.fixture(scope="module")
def deb():
    return build_deb()


def test_package_contents(deb):
    arch = run(["dpkg", "--print-architecture"]).stdout.strip()
    assert os.path.basename(deb) == f"outbox-dispatcher_{upstream_version()}_{arch}.deb"
    listing = run(["dpkg-deb", "-c", deb]).stdout
    entries = {}
    for line in listing.splitlines():
        perm, owner, _size, _date, _time, path = line.split(None, 5)
        entries[path.removeprefix(".")] = (perm, owner)
    expected = {
        "/usr/bin/outbox-dispatcher": "-rwxr-xr-x",
        "/usr/bin/outboxctl": "-rwxr-xr-x",
        "/usr/bin/outbox-console": "-rwxr-xr-x",
        "/lib/systemd/system/outbox-console.service": "-rw-r--r--",
        "/usr/share/man/man8/outbox-console.8.gz": "-rw-r--r--",
        f"{PLUGIN_DIR}/outbox_http.so": "-rw-r--r--",
        f"{PLUGIN_DIR}/outbox_email.so": "-rw-r--r--",
        f"{PLUGIN_DIR}/outbox_crm.so": "-rw-r--r--",
        "/lib/systemd/system/outbox-dispatcher@.service": "-rw-r--r--",
        "/lib/systemd/system/outbox-dispatcher.target": "-rw-r--r--",
        "/lib/systemd/system/outbox-prune.service": "-rw-r--r--",
        "/lib/systemd/system/outbox-prune.timer": "-rw-r--r--",
        "/etc/outbox-dispatcher/dispatcher.ini.example": "-rw-r--r--",
        "/etc/outbox-dispatcher/environment": "-rw-r--r--",
        "/usr/share/man/man8/outbox-dispatcher.8.gz": "-rw-r--r--",
        "/usr/share/man/man8/outboxctl.8.gz": "-rw-r--r--",
        "/usr/share/doc/outbox-dispatcher/copyright": "-rw-r--r--",
        "/usr/share/doc/outbox-dispatcher/changelog.gz": "-rw-r--r--",
        "/usr/share/doc/outbox-dispatcher/README.md.gz": "-rw-r--r--",
        "/usr/share/doc/outbox-dispatcher/examples/prometheus/outbox-dispatcher.rules.yml": "-rw-r--r--",
        "/usr/share/doc/outbox-dispatcher/examples/grafana/outbox-dispatcher.json": "-rw-r--r--",
    }
    for sql in sorted(os.listdir(os.path.join(ROOT, "sql"))):
        if re.match(r"\d+_.*\.sql$", sql):
            expected[f"/usr/share/outbox-dispatcher/sql/{sql}"] = "-rw-r--r--"
    for sql in sorted(os.listdir(os.path.join(ROOT, "sql", "functions"))):
        expected[f"/usr/share/outbox-dispatcher/sql/functions/{sql}"] = "-rw-r--r--"
    for path, perm in expected.items():
        assert path in entries, f"{path} missing from the package:\n{listing}"
        assert entries[path] == (perm, "root/root"), (path, entries[path])
    # Nothing from a build tree, no /usr/local, no stray examples.
    assert not [p for p in entries if p.startswith("/usr/local") or "build" in p], entries

    # The README's figure for the package's size holds (within a quarter).
    readme = open(os.path.join(ROOT, "README.md")).read()
    stated = int(re.search(r"The package \(about (\d+) KB", readme).group(1))
    size = os.path.getsize(deb) / 1024
    assert 0.75 * stated <= size <= 1.25 * stated, f"README says about {stated} KB, the .deb is {size:.0f} KB"

    fields = run(["dpkg-deb", "-f", deb, "Version", "Depends", "Architecture"]).stdout
    assert f"Version: {upstream_version()}\n" in fields
    depends = re.search(r"^Depends: (.*)$", fields, re.M).group(1)
    for lib in ("libc6", "libpq5", "libcurl4", "libesmtp6", "libjansson4", "libinih1", "libsystemd0",
                "libssl3", "libevent-2.1-7", "libevent-pthreads-2.1-7"):
        assert re.search(rf"(^|, ){re.escape(lib)}( |,|$)", depends), (lib, depends)
    assert "-dev" not in depends, depends


def test_units_and_maintainer_scripts(deb, tmp_path):
    run(["dpkg-deb", "-R", deb, str(tmp_path / "x")])
    x = tmp_path / "x"
    unit = (x / "lib/systemd/system/outbox-dispatcher@.service").read_text()
    assert ("ExecStart=/usr/bin/outbox-dispatcher --config /etc/outbox-dispatcher/dispatcher.ini "
            "--instance %i") in unit
    assert "@PREFIX@" not in unit
    assert "DynamicUser=yes" in unit   # so the package creates no system user
    conffiles = (x / "DEBIAN/conffiles").read_text().split()
    assert conffiles == ["/etc/outbox-dispatcher/dispatcher.ini.example", "/etc/outbox-dispatcher/environment"]
    assert "AI_ACTIONS_ENABLED=false" in (x / "etc/outbox-dispatcher/environment").read_text()
    scripts = {f: (x / "DEBIAN" / f).read_text() for f in ("preinst", "postinst", "prerm", "postrm")
               if (x / "DEBIAN" / f).exists()}
    for name, text in scripts.items():
        assert run(["sh", "-n", str(x / "DEBIAN" / name)]).returncode == 0, name
        # Installing or upgrading never starts, restarts or enables a unit
        # (the kill switch and a config need an operator first).
        assert not re.search(r"deb-systemd-invoke\s+(start|restart|try-restart)", text), (name, text)
        assert not re.search(r"systemctl\s+[^\n]*\b(start|restart|enable)\b", text), (name, text)
        assert not re.search(r"deb-systemd-helper\s+enable", text.split("was-enabled")[0]), (name, text)
    # An upgrade leaves running workers alone: no stop before it.
    assert "stop" not in scripts.get("preinst", ""), scripts.get("preinst")
    # Removal stops them, with systemctl itself (a policy-rc.d that denies
    # must not leave workers running from deleted binaries).
    assert re.search(r"systemctl stop outbox-prune.timer outbox-prune.service outbox-dispatcher.target "
                     r"\\\n\s*'outbox-dispatcher@\*.service'", scripts["prerm"]), scripts["prerm"]
    # Installing or upgrading reloads systemd (new unit files are in force
    # for the next restart); purging removes the operator's enablement links.
    assert "systemctl --system daemon-reload" in scripts["postinst"]
    assert "*.wants/outbox-dispatcher@*.service" in scripts["postrm"]


def test_lintian_clean(deb, tmp_path):
    changes = deb.replace(".deb", ".changes")
    assert os.path.exists(changes), changes
    # lintian leaves files in its TMPDIR (mldbm-elf-*): give it one of the
    # test's own.
    r = run(["lintian", "--fail-on", "error,warning", "--display-info", changes], timeout=300,
            env=dict(os.environ, TMPDIR=str(tmp_path)))
    tags = [line for line in r.stdout.splitlines() if re.match(r"[EWIXPO]: ", line)]
    assert r.returncode == 0 and not [t for t in tags if t[0] in "EW"], r.stdout + r.stderr
    print("\n".join(tags))


def test_man_pages(deb, tmp_path):
    run(["dpkg-deb", "-x", deb, str(tmp_path)])
    for name, words in (("outbox-dispatcher", ("--check-config", "AI_ACTIONS_ENABLED", "SIGHUP")),
                        ("outboxctl", ("kill-switch", "exit codes", "/usr/share/outbox-dispatcher/sql"))):
        page = tmp_path / f"usr/share/man/man8/{name}.8.gz"
        r = run(["man", "-l", str(page)], env=dict(os.environ, MANWIDTH="200", MAN_KEEP_FORMATTING="0"))
        assert r.returncode == 0, r.stderr
        text = re.sub(r".\x08", "", r.stdout).replace("\u2010", "-")
        assert text.startswith(name.upper() + "(8)"), text[:200]
        assert upstream_version() in text
        for w in words:
            assert w in text, (name, w)


class InstalledDispatcher(Dispatcher):
    """A worker run from the installed root's binary."""

    def __init__(self, root, *a, **kw):
        super().__init__(*a, **kw)
        self.binary = os.path.join(root, "usr/bin/outbox-dispatcher")

    def start(self, wait_ready=True):
        self.logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen([self.binary, "--config", self.config_path],
                                     stdout=self.logf, stderr=self.logf, env=self.env)
        wait_for(lambda: self.ready() or self.proc.poll() is not None, timeout=30, what="ready")
        assert self.proc.poll() is None, self.log()
        return self


def test_installs_into_a_throwaway_root_and_runs(deb, db, conn, sink, tmp_path, trusted_tmp):
    # Not under /tmp: the worker refuses plugins below a world-writable directory.
    root = install_into_root(deb, trusted_tmp / "root")
    status = run(["dpkg-query", f"--admindir={root}/var/lib/dpkg", "-W", "-f", "${Status} ${Version}",
                  "outbox-dispatcher"]).stdout
    assert status == f"install ok installed {upstream_version()}"
    for d in ("credentials", "prune"):   # postinst: the workers' and the prune unit's
        creds = os.path.join(root, "etc/outbox-dispatcher", d)
        assert os.path.isdir(creds) and (os.stat(creds).st_mode & 0o777) == 0o700, d
    # Installed, neither enabled nor started: no wants/ links anywhere.
    assert not os.path.exists(os.path.join(root, "etc/systemd/system/multi-user.target.wants")), \
        os.listdir(os.path.join(root, "etc/systemd/system"))
    plugins = root + PLUGIN_DIR
    env = dict(os.environ, PGCONNECT_TIMEOUT="2")

    r = run([f"{root}/usr/bin/outbox-dispatcher", "--version"])
    assert r.returncode == 0 and r.stdout == f"outbox-dispatcher {upstream_version()}\n", r
    r = run([f"{root}/usr/bin/outboxctl", "--db", db, "status"])
    assert r.returncode == 0, r.stdout + r.stderr

    # The compiled-in plugin directory is the multiarch one: a config that
    # names none makes the worker look there (loaded if this host has the
    # package installed, else "cannot load" naming the path).
    core = tmp_path / "core.ini"
    write_config(core, {"provider.http": {"allow_hosts": "127.0.0.1"}})
    r = run([f"{root}/usr/bin/outbox-dispatcher", "--config", str(core), "--check-config"], env=env)
    assert f"{PLUGIN_DIR}/outbox_http.so" in r.stderr, r.stderr

    # The shipped example, with the installed plugin directory (this root
    # is not /), passes as it is (email and crm are opt-in, commented out);
    # with the email section switched on, both plugins load.
    example = open(os.path.join(root, "etc/outbox-dispatcher/dispatcher.ini.example")).read()
    assert example.count("\nprovider_dir =\n") == 1
    shipped = tmp_path / "shipped.ini"
    shipped.write_text(example.replace("\nprovider_dir =\n", f"\nprovider_dir = {plugins}\n"))
    r = run([f"{root}/usr/bin/outbox-dispatcher", "--config", str(shipped), "--check-config"], env=env)
    assert r.returncode == 0, r.stderr
    assert f'"path":"{plugins}/outbox_http.so"' in r.stderr, r.stderr
    mine = tmp_path / "example.ini"
    assert shipped.read_text().count("\n;[provider.email]\n") == 1
    mine.write_text(shipped.read_text().replace("\n;[provider.email]\n", "\n[provider.email]\n")
                    .replace("\n;server = 127.0.0.1:25\n", "\nserver = 127.0.0.1:25\n"))
    r = run([f"{root}/usr/bin/outbox-dispatcher", "--config", str(mine), "--check-config"], env=env)
    assert r.returncode == 0, r.stderr
    for p in ("http", "email"):
        assert f'"path":"{plugins}/outbox_{p}.so"' in r.stderr, r.stderr

    # A real worker from the root sends one effect through the installed
    # http plugin.
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/ok", {"body": {"hello": "package"}})
    w = InstalledDispatcher(root, db, tmp_path, {"dispatcher": {"provider_dir": plugins}}, name="pkg1")
    try:
        w.start()
        e = wait_for(lambda: (lambda x: x if x["state"] == "completed" else None)(effect(conn, eid)),
                     what="the effect completed by the installed worker")
        assert e["provider_id"].startswith("sink-"), e
        assert [a["worker"] for a in attempts(conn, eid)] == ["pkg1"]
        assert sink.count(path_prefix="/ok") == 1
        assert f'"path":"{plugins}/outbox_http.so"' in w.log()
    finally:
        assert w.stop() == 0, w.log()

    # Purge: the package's files, its conffiles and the (empty) credentials
    # directory go; nothing of the operator's would.
    r = dpkg_root(root, "--purge", "outbox-dispatcher")
    assert r.returncode == 0, r.stdout + r.stderr
    left = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
            if "/var/" not in d + "/" and not d.startswith(os.path.join(root, "var"))]
    assert left == [], left
    assert not os.path.exists(os.path.join(root, "etc/outbox-dispatcher"))
