"""dispatcher.ini.example documents every key the code knows, in the right
section, with the code's default; and the example's core sections load."""
import os
import re
import subprocess

from outbox_test import BUILD_DIR, ROOT

TABLE = re.compile(r'\{\s*"([a-z_]+)",\s*CONF_([A-Z]+),\s*"([^"]*)"')


def tables():
    src = open(os.path.join(ROOT, "dispatcher", "config.c")).read()
    out = {}
    for name, section in (("core_keys_database", "database"), ("core_keys_dispatcher", "dispatcher"),
                          ("core_keys_metrics", "metrics"), ("core_keys_log", "log"),
                          ("provider_common_keys", "common")):
        body = src.split(f"{name}[] = {{", 1)[1].split("};", 1)[0]
        out[section] = TABLE.findall(body)
    for f in os.listdir(os.path.join(ROOT, "providers")):
        path = os.path.join(ROOT, "providers", f)
        if os.path.isfile(os.path.join(path, f + ".c")):
            # A plugin split into providers/NAME/: its key table is in NAME.c.
            path, f = os.path.join(path, f + ".c"), f + ".c"
        if f.endswith(".c"):
            body = open(path).read()
            m = re.search(r"struct outbox_conf_key \w+\[\] = \{(.*?)\n\};", body, re.S)
            if m:
                out["provider." + f[:-2]] = TABLE.findall(m.group(1))
    return out


def example_sections():
    secs, cur = {}, None
    for line in open(os.path.join(ROOT, "dispatcher.ini.example")):
        m = re.match(r"\[([^\]]+)\]", line)
        if m:
            cur = m.group(1)
            secs.setdefault(cur, {})
            continue
        m = re.match(r"([a-z_]+)\s*=\s*(.*?)\s*$", line)
        if m and cur:
            secs[cur][m.group(1)] = m.group(2)
    return secs


def test_every_key_is_documented_with_its_default():
    ex = example_sections()
    text = open(os.path.join(ROOT, "dispatcher.ini.example")).read()
    missing = []
    for section, keys in tables().items():
        for key, _type, default in keys:
            if section == "common":
                if not re.search(rf"^;\s+{key} =", text, re.M):
                    missing.append(f"(common) {key}")
                continue
            if key not in ex.get(section, {}):
                missing.append(f"[{section}] {key}")
            elif section.startswith("provider.") or section in ("database", "dispatcher", "metrics", "log"):
                assert ex[section][key] == default, f"[{section}] {key}: example says " \
                    f"{ex[section][key]!r}, code default is {default!r}"
    assert not missing, missing


def test_example_core_sections_load(tmp_path):
    text = open(os.path.join(ROOT, "dispatcher.ini.example")).read()
    core = text.split("[provider.http]")[0]
    p = tmp_path / "core.ini"
    p.write_text(core.replace("listen = 127.0.0.1:9464", "listen ="))
    r = subprocess.run([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config", str(p),
                        "--check-config"], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, PGCONNECT_TIMEOUT="2"))
    assert r.returncode == 0, r.stderr
