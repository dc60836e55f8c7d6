# SPDX-License-Identifier: ISC
"""The Debian package for the tests: build it once per test process with
`make deb` (a private build directory, the working tree untouched) and
install it into throwaway roots.

    deb = build_deb()            # path of outbox-dispatcher_VERSION_ARCH.deb
    root = install_into_root(deb, tmp_path / "root")

A test that boots systemd can install the same .deb into its own root;
build_upgrade_deb(deb) is a newer build of it, for upgrades.
"""
import atexit
import email.utils
import glob
import os
import re
import shutil
import subprocess
import tempfile

from outbox_test import ROOT

_built = {}
# The package builds' directories, shared by the tests of one process and
# removed when it exits (the no-trace check of exclusive tests allows them).
SHARED_DIRS = set()


def build_deb():
    """Run `make deb` once (about a minute on 2 cores); return the .deb's path.
    The .changes and the -dbgsym package sit beside it.  OUTBOX_DEB=PATH
    tests an already built package instead."""
    if os.environ.get("OUTBOX_DEB"):
        return os.path.abspath(os.environ["OUTBOX_DEB"])
    if "deb" not in _built:
        out = tempfile.mkdtemp(prefix="outbox-deb.")
        SHARED_DIRS.add(out)
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


def build_upgrade_deb(deb):
    """A newer build of the package: the same tree, a changelog entry of
    VERSION+upgrade1 dated now (so its files are newer too), built again.
    Reuses the first build's objects when its tree is beside the .deb (a
    few seconds: packaging only); from the working tree otherwise."""
    if "upgrade" in _built:
        return _built["upgrade"]
    out = tempfile.mkdtemp(prefix="outbox-deb-up.")
    SHARED_DIRS.add(out)
    atexit.register(shutil.rmtree, out, True)
    src = os.path.join(out, "src")
    first = os.path.join(os.path.dirname(deb), "src")
    if os.path.isdir(os.path.join(first, "build-deb")):
        shutil.copytree(first, src, symlinks=True)
        # debhelper's record of the first build, or dh would skip its steps.
        for p in ("debian/outbox-dispatcher", "debian/tmp", "debian/.debhelper", "debian/files",
                  "debian/debhelper-build-stamp") + tuple(
                      os.path.relpath(g, src) for g in glob.glob(os.path.join(src, "debian", "*.debhelper*"))
                      + glob.glob(os.path.join(src, "debian", "*.substvars"))):
            path = os.path.join(src, p)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)
        flags = ["-nc"]
    else:
        os.makedirs(src)
        subprocess.run(f"tar -c --exclude=./.git --exclude='./build' --exclude='./build-*' . | "
                       f"tar -x -C '{src}'", shell=True, cwd=ROOT, check=True)
        flags = []
    changelog = os.path.join(src, "debian", "changelog")
    old = open(changelog).read()
    version = re.match(r"\S+ \(([^)]+)\)", old).group(1) + "+upgrade1"
    entry = (f"outbox-dispatcher ({version}) unstable; urgency=medium\n\n"
             "  * A newer build of the same tree, for the upgrade tests.\n\n"
             f" -- outbox-dispatcher developers <dev@outbox-dispatcher.invalid>  "
             f"{email.utils.formatdate()}\n\n")
    with open(changelog, "w") as f:
        f.write(entry + old)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    r = subprocess.run(["dpkg-buildpackage", "-us", "-uc", "-b", "-J2"] + flags, cwd=src, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"dpkg-buildpackage failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
    debs = [p for p in glob.glob(os.path.join(out, "outbox-dispatcher_*.deb")) if "-dbgsym_" not in p]
    assert len(debs) == 1, debs
    _built["upgrade"] = debs[0]
    return debs[0]


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
