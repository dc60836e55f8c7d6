# SPDX-License-Identifier: ISC
"""The Debian package for the tests: build it once per test process with
`make deb` (a private build directory, the working tree untouched) and
install it into throwaway roots.

    deb = build_deb()            # path of outbox-dispatcher_VERSION_ARCH.deb
    root = install_into_root(deb, tmp_path / "root")

A test that boots systemd can install the same .deb into its own root.
"""
import atexit
import glob
import os
import shutil
import subprocess
import tempfile

from outbox_test import ROOT

_built = {}


def build_deb():
    """Run `make deb` once (about a minute on 2 cores); return the .deb's path.
    The .changes and the -dbgsym package sit beside it.  OUTBOX_DEB=PATH
    tests an already built package instead."""
    if os.environ.get("OUTBOX_DEB"):
        return os.path.abspath(os.environ["OUTBOX_DEB"])
    if "deb" not in _built:
        out = tempfile.mkdtemp(prefix="outbox-deb.")
        atexit.register(shutil.rmtree, out, True)
        r = subprocess.run(["make", "-s", "deb", f"BUILD={out}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, f"make deb failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
        debs = [p for p in glob.glob(os.path.join(out, "deb", "outbox-dispatcher_*.deb"))
                if "-dbgsym_" not in p]
        assert len(debs) == 1, debs
        _built["deb"] = debs[0]
        _built["log"] = r.stdout + r.stderr
    return _built["deb"]


def dpkg_root(root, *args):
    """dpkg against the database in root.  Maintainer scripts run outside a
    chroot (the root has no shell) with DPKG_ROOT=root, as the package's
    own scripts and debhelper's snippets expect; dependencies are not
    installed there (--force-depends): the host's libraries serve."""
    cmd = ["dpkg", f"--root={root}", "--force-script-chrootless", "--force-depends",
           f"--log={root}/var/log/dpkg.log"]
    if os.geteuid() != 0:
        cmd.append("--force-not-root")
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120)


def install_into_root(deb, root):
    """An empty dpkg database in root, then `dpkg -i deb` into it."""
    root = str(root)
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates", "var/log"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    for f in ("var/lib/dpkg/status", "var/lib/dpkg/available"):
        open(os.path.join(root, f), "a").close()
    r = dpkg_root(root, "-i", deb)
    assert r.returncode == 0, r.stdout + r.stderr
    return root
