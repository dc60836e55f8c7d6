# SPDX-License-Identifier: ISC
"""A provider plugin's ABI is provider.h: the built plugin exports
outbox_provider_entry and nothing else (providers/plugin.map).  Its own
copies of lib/ and providers/lib/ (the growing string, the allocation
policy, the URL parser) are then what it calls: exported, the daemon's copies of the
same names, linked with -rdynamic, would be bound in their place, and a
plugin built from another tree would run the daemon's helpers over its
own struct layouts."""
import glob
import os
import subprocess

from outbox_test import BUILD_DIR


def exported(path):
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_a_plugin_exports_only_its_entry_point():
    plugins = sorted(glob.glob(os.path.join(BUILD_DIR, "providers", "outbox_*.so")))
    names = {os.path.basename(p) for p in plugins}
    assert {"outbox_http.so", "outbox_crm.so", "outbox_email.so"} <= names, plugins
    extra = {os.path.basename(p): sorted(exported(p) - {"outbox_provider_entry"})
             for p in plugins}
    assert all("outbox_provider_entry" in exported(p) for p in plugins)
    assert {k: v for k, v in extra.items() if v} == {}
