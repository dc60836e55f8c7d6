# SPDX-License-Identifier: ISC
"""Starting a worker: configuration errors name the file, line and key;
plugins that are missing, of the wrong interface version or whose init
fails are refused clearly; the minimal configuration of the stable keys
runs.
"""
import os
import re
import signal
import subprocess

import pytest

from outbox_test import BUILD_DIR, enqueue, final, kill_switch


def start_expect_failure(tmp_path, text, env=None):
    p = tmp_path / "bad.ini"
    p.write_text(text)
    e = dict(os.environ, AI_ACTIONS_ENABLED="true")
    e.update(env or {})
    r = subprocess.run([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config", str(p)],
                       capture_output=True, text=True, timeout=20, env=e)
    return r, str(p)


CONFIG_ERRORS = [
    ("[dispatcher]\nlease_seconds = abc\n", 2, "lease_seconds", "integer"),
    ("[dispatcher]\nlease_seconds = 0\n", 2, "lease_seconds", "from 2 to"),
    ("[dispatcher]\nno_such_key = 1\n", 2, "no_such_key", "unknown key"),
    ("[nonsense]\na = 1\n", 2, "nonsense", "unknown section"),
    ("[database]\npoll_only = maybe\n", 2, "poll_only", "true or false"),
    ("[metrics]\nlisten =\n[dispatcher]\nbatch_size = 5\nbatch_size = 6\n", 5, "batch_size", "set twice"),
    ("[provider.http]\ntimeout_ms = -1\n", 2, "timeout_ms", "integer"),
    ("[provider.http]\nallow_hosts = 10.0.0.0/99\n", 2, "allow_hosts", "CIDR"),
    ("[provider.http]\nbogus = 1\n", 2, "bogus", "unknown key"),
    ("[provider.http]\nsigning_secret = env:NO_SUCH_ENV_VAR_X\n", 2, "signing_secret", "not set"),
    ("this is not ini\n", 1, "", "syntax"),
]


@pytest.mark.parametrize("text,line,key,words", CONFIG_ERRORS, ids=[c[3] + "-" + c[2] for c in CONFIG_ERRORS])
def test_config_errors_name_file_line_and_key(tmp_path, text, line, key, words):
    r, path = start_expect_failure(tmp_path, "[metrics]\nlisten =\n" + text if not text.startswith("[metrics]") else text)
    assert r.returncode == 1
    shift = 0 if text.startswith("[metrics]") else 2
    assert f"{path}:{line + shift}" in r.stderr, r.stderr
    assert key in r.stderr and words in r.stderr, r.stderr


def test_missing_plugin(tmp_path):
    r, _ = start_expect_failure(tmp_path, "[metrics]\nlisten =\n[dispatcher]\nproviders = sms\n")
    assert r.returncode == 1
    assert "provider \\\"sms\\\": cannot load" in r.stderr or 'provider "sms": cannot load' in r.stderr
    assert r.stderr.count("provider_error") == 1


PLUGIN_SRC = r'''
#include "provider.h"
#include <stdio.h>
static void *init(const struct outbox_host *h, const struct outbox_conf *c, char *err, size_t n)
{ (void)h; (void)c; snprintf(err, n, "the relay password file is unreadable"); return NULL; }
static bool validate(void *s, const struct outbox_effect *e, char *k, size_t kl, char *err, size_t n)
{ (void)s; (void)e; (void)k; (void)kl; (void)err; (void)n; return true; }
static bool send(void *s, const struct outbox_effect *e, outbox_done_fn d, void *t, char *err, size_t n)
{ (void)s; (void)e; (void)d; (void)t; (void)err; (void)n; return false; }
static void shut(void *s) { (void)s; }
static const struct outbox_provider p = { ABI, "fake", 0, NULL, init, validate, send, NULL, shut };
const struct outbox_provider *outbox_provider_entry(void) { return &p; }
'''


def provider_abi():
    """OUTBOX_PROVIDER_ABI as providers/provider.h defines it."""
    with open(os.path.join(os.path.dirname(BUILD_DIR), "providers", "provider.h")) as f:
        return int(re.search(r"#define OUTBOX_PROVIDER_ABI (\d+)", f.read()).group(1))


def build_plugin(base, abi):
    """base/plugins/outbox_fake.so; base is a trusted_tmp (or tmp_path:
    under the sticky /tmp the entries on the path are root's, so it is
    trusted too)."""
    src = base / "fake.c"
    src.write_text(PLUGIN_SRC.replace("ABI", str(abi)))
    d = base / "plugins"
    d.mkdir(exist_ok=True)
    inc = os.path.join(os.path.dirname(BUILD_DIR), "providers")
    jansson = subprocess.run(["pkg-config", "--cflags", "jansson"], capture_output=True, text=True).stdout.split()
    subprocess.run(["cc", "-shared", "-fPIC", "-I", inc, *jansson, "-o", str(d / "outbox_fake.so"), str(src)],
                   check=True)
    return d


def test_plugin_with_wrong_interface_version(tmp_path, trusted_tmp):
    d = build_plugin(trusted_tmp, 99)
    r, _ = start_expect_failure(tmp_path, f"[metrics]\nlisten =\n[dispatcher]\nproviders = fake\n"
                                          f"provider_dir = {d}\n")
    assert r.returncode == 1
    assert "built for provider interface 99" in r.stderr, r.stderr
    assert f"speaks {provider_abi()}" in r.stderr, r.stderr


def test_plugin_of_the_oldest_interface_still_loads(tmp_path, trusted_tmp):
    """ABI 3 only appended host->late_result: a plugin built for 2 loads
    (its init runs and fails on purpose here)."""
    with open(os.path.join(os.path.dirname(BUILD_DIR), "providers", "provider.h")) as f:
        oldest = int(re.search(r"#define OUTBOX_PROVIDER_ABI_OLDEST (\d+)", f.read()).group(1))
    assert oldest < provider_abi()
    d = build_plugin(trusted_tmp, oldest)
    r, _ = start_expect_failure(tmp_path, f"[metrics]\nlisten =\n[dispatcher]\nproviders = fake\n"
                                          f"provider_dir = {d}\n")
    assert "init failed: the relay password file is unreadable" in r.stderr, r.stderr
    assert "provider interface" not in r.stderr


def test_plugin_whose_init_fails(tmp_path, trusted_tmp):
    d = build_plugin(trusted_tmp, provider_abi())
    r, _ = start_expect_failure(tmp_path, f"[metrics]\nlisten =\n[dispatcher]\nproviders = fake\n"
                                          f"provider_dir = {d}\n")
    assert r.returncode == 1
    assert "init failed: the relay password file is unreadable" in r.stderr, r.stderr
    assert r.stderr.count("provider_error") == 1


def test_minimal_config_of_the_stable_keys_runs(tmp_path, db, conn, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    p = tmp_path / "min.ini"
    p.write_text(f"[database]\nconninfo = {db}\n[provider.http]\nallow_hosts = 127.0.0.1\n"
                 f"timeout_ms = 2000\n[metrics]\nlisten =\n[dispatcher]\nlease_seconds = 30\n"
                 f"[provider.email]\nserver = 127.0.0.1:2525\ntimeout_ms = 5000\n")
    e = dict(os.environ, AI_ACTIONS_ENABLED="true")
    proc = subprocess.Popen([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config", str(p)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=e)
    try:
        assert final(conn, eid)["state"] == "completed"
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=20)[1].decode()
    assert proc.returncode == 0, out


# -- files that can run code or hold secrets ------------------------------------

def fake_plugin_config(d):
    return f"[metrics]\nlisten =\n[dispatcher]\nproviders = fake\nprovider_dir = {d}\n"


def test_plugin_writable_by_others_is_refused(tmp_path, trusted_tmp):
    """Anyone who can rewrite a plugin could run code as the worker: a
    plugin writable by group or others is refused before it is loaded (its
    init, which fails on purpose, never runs)."""
    d = build_plugin(trusted_tmp, provider_abi())
    so = d / "outbox_fake.so"
    for mode, who in ((0o666, "every user"), (0o775, "its group")):
        os.chmod(so, mode)
        r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
        assert r.returncode == 1
        assert f"provider plugin {so} is writable by {who}" in r.stderr, r.stderr
        assert "init failed" not in r.stderr
    os.chmod(so, 0o755)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
    assert "init failed: the relay password file is unreadable" in r.stderr, r.stderr


def test_provider_dir_writable_by_others_is_refused(tmp_path, trusted_tmp):
    d = build_plugin(trusted_tmp, provider_abi())
    for mode, who in ((0o777, "every user"), (0o1777, "every user"), (0o770, "its group")):
        os.chmod(d, mode)
        r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
        assert r.returncode == 1
        assert f"provider_dir {d} is writable by {who}" in r.stderr, r.stderr
        assert "init failed" not in r.stderr
    os.chmod(d, 0o755)


INIT_RAN = "init failed: the relay password file is unreadable"


@pytest.mark.parametrize("mode,who", [(0o777, "every user"), (0o775, "its group"),
                                      (0o770, "its group")])
def test_plugin_under_a_writable_parent_directory_is_refused(tmp_path, trusted_tmp, mode, who):
    """A 0755 plugin directory in a directory others may write (one level
    up or two, not sticky): they could rename it away and put their own in
    its place."""
    for depth in (1, 2):
        top = trusted_tmp / f"open{depth}"
        inner = top / "x" if depth == 2 else top
        inner.mkdir(parents=True)
        d = build_plugin(inner, provider_abi())
        os.chmod(top, mode)
        r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
        assert r.returncode == 1
        assert (f"provider_dir {d}: the directory {top} is writable by {who} "
                f"(mode {mode:03o})") in r.stderr, r.stderr
        assert "init failed" not in r.stderr
        os.chmod(top, 0o755)
        r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
        assert INIT_RAN in r.stderr, r.stderr


def test_plugin_under_tmp_is_loaded_when_the_entries_in_it_are_ours(tmp_path):
    """pytest's tmp_path is under /tmp (1777, sticky): the sticky bit lets
    no one else rename or remove the root-owned entry below it, so the
    plugin loads (a clone of the tree under /tmp runs its tests)."""
    d = build_plugin(tmp_path, provider_abi())
    open_dir = next(p for p in d.parents if os.stat(p).st_mode & 0o022)   # /tmp, or TMPDIR
    assert os.stat(open_dir).st_mode & 0o1000, open_dir                     # sticky
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
    assert INIT_RAN in r.stderr, r.stderr


@pytest.mark.parametrize("sticky_mode", [0o1777, 0o1775])
def test_sticky_writable_directory_itself_or_a_foreign_entry_in_it_is_refused(
        tmp_path, trusted_tmp, sticky_mode):
    """The exception is for the entry below a sticky directory, and only
    when that entry is root's or the worker's: a provider_dir that is
    itself sticky and writable lets others add plugins, and a link in a
    sticky directory owned by another user can be pointed elsewhere by
    that user."""
    who = "every user" if sticky_mode & 0o002 else "its group"
    d = build_plugin(trusted_tmp, provider_abi())
    os.chmod(d, sticky_mode)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
    assert r.returncode == 1
    assert f"provider_dir {d} is writable by {who}" in r.stderr, r.stderr
    os.chmod(d, 0o755)
    if os.geteuid() != 0:
        return
    sticky = trusted_tmp / "sticky"
    sticky.mkdir()
    link = sticky / "plugins-link"
    os.symlink(d, link)
    os.chmod(sticky, sticky_mode)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(link))
    assert INIT_RAN in r.stderr, r.stderr                 # root's link: trusted
    os.lchown(link, 65534, 65534)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(link))
    assert r.returncode == 1
    assert (f"provider_dir {link}: the directory {sticky} is writable by {who} "
            f"(mode {sticky_mode:03o})") in r.stderr, r.stderr
    assert "init failed" not in r.stderr
    os.chmod(sticky, 0o755)


@pytest.mark.parametrize("mode,who", [(0o777, "every user"), (0o770, "its group")])
def test_plugin_symlinked_into_a_writable_directory_is_refused(tmp_path, trusted_tmp, mode, who):
    """The plugin directory is trusted, the plugin a symlink to a file in a
    directory others may write (or one under such a directory)."""
    d = build_plugin(trusted_tmp, provider_abi())
    elsewhere = trusted_tmp / "elsewhere"
    (elsewhere / "deep").mkdir(parents=True)
    real = elsewhere / "deep" / "outbox_fake.so"
    os.rename(d / "outbox_fake.so", real)
    os.symlink(real, d / "outbox_fake.so")
    so = d / "outbox_fake.so"
    for open_dir in (elsewhere / "deep", elsewhere):
        os.chmod(open_dir, mode)
        r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
        assert r.returncode == 1
        assert (f"provider plugin {so}: the directory {open_dir} is writable by {who}") \
            in r.stderr, r.stderr
        assert "init failed" not in r.stderr
        os.chmod(open_dir, 0o755)
    # The target itself writable: named as the link's target.
    os.chmod(real, 0o666)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
    assert f"provider plugin {so}: its target {real} is writable by every user" in r.stderr, \
        r.stderr
    os.chmod(real, 0o755)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
    assert INIT_RAN in r.stderr, r.stderr


def test_provider_dir_symlinked_into_a_writable_directory_is_refused(tmp_path, trusted_tmp):
    (trusted_tmp / "open").mkdir()
    real = build_plugin(trusted_tmp / "open", provider_abi())
    link = trusted_tmp / "plugins-link"
    os.symlink(real, link)
    os.chmod(trusted_tmp / "open", 0o777)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(link))
    assert r.returncode == 1
    assert f"provider_dir {link}: the directory {trusted_tmp / 'open'} is writable by every user" \
        in r.stderr, r.stderr
    os.chmod(trusted_tmp / "open", 0o755)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(link))
    assert INIT_RAN in r.stderr, r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_plugin_owned_by_another_user_is_refused(tmp_path, trusted_tmp):
    d = build_plugin(trusted_tmp, provider_abi())
    os.chown(d / "outbox_fake.so", 12345, 12345)
    r, _ = start_expect_failure(tmp_path, fake_plugin_config(d))
    assert r.returncode == 1
    assert "is owned by uid 12345, neither root nor the worker's user" in r.stderr, r.stderr
    assert "init failed" not in r.stderr


def test_relative_provider_dir_is_beside_the_config_file(tmp_path, trusted_tmp):
    """provider_dir = plugins means <the config file's directory>/plugins,
    whatever directory the worker was started from."""
    conf = trusted_tmp / "etc"
    conf.mkdir()
    build_plugin(conf, provider_abi())        # conf/plugins/outbox_fake.so
    p = conf / "rel.ini"
    p.write_text("[metrics]\nlisten =\n[dispatcher]\nproviders = fake\nprovider_dir = plugins\n")
    r = subprocess.run([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config", str(p)],
                       capture_output=True, text=True, timeout=20, cwd="/",
                       env=dict(os.environ, AI_ACTIONS_ENABLED="true"))
    assert "init failed: the relay password file is unreadable" in r.stderr, r.stderr
    assert str(conf / "plugins" / "outbox_fake.so") in r.stderr or "cannot load" not in r.stderr


def check_config(path):
    return subprocess.run([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config", str(path),
                           "--check-config"], capture_output=True, text=True, timeout=20,
                          env=dict(os.environ, AI_ACTIONS_ENABLED="true"))


def test_secrets_readable_by_others_are_warned_about(tmp_path):
    """A secret file, or a config holding a secret in clear, that every
    user may read: a warning naming the file (not fatal); mode 0600: none.
    The secret itself is never printed."""
    secret = tmp_path / "signing"
    secret.write_text("whsec_UzNDUkVULUZST00tRklMRQ==\n")
    os.chmod(secret, 0o644)
    p = tmp_path / "w.ini"
    p.write_text("[metrics]\nlisten =\n[provider.http]\nallow_hosts = 127.0.0.1\n"
                 f"signing_secret = file:{secret}\n")
    os.chmod(p, 0o644)
    r = check_config(p)
    assert r.returncode == 0, r.stderr
    assert "secret_file_readable" in r.stderr and str(secret) in r.stderr, r.stderr
    assert "whsec_" not in r.stderr
    assert "config_readable" not in r.stderr
    os.chmod(secret, 0o600)
    r = check_config(p)
    assert r.returncode == 0 and "_readable\"" not in r.stderr, r.stderr

    p.write_text("[metrics]\nlisten =\n[database]\nconninfo = host=db user=w password=PW-IN-CLEAR\n"
                 "[provider.http]\nallow_hosts = 127.0.0.1\nsigning_secret = whsec_UzNDUkVULUlOTElORQ==\n")
    os.chmod(p, 0o644)
    r = check_config(p)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("config_readable") == 2, r.stderr
    assert "[database] conninfo" in r.stderr and "[provider.http] signing_secret" in r.stderr
    assert "whsec_" not in r.stderr and "PW-IN-CLEAR" not in r.stderr
    os.chmod(p, 0o600)
    r = check_config(p)
    assert r.returncode == 0 and "_readable\"" not in r.stderr, r.stderr
