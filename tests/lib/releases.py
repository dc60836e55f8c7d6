# SPDX-License-Identifier: ISC
"""The binaries of an earlier commit (a release the fleet upgrades from),
built from the repository's history with `git archive` in a temporary
folder (no checkout moves), once per commit, and kept in

    ${XDG_CACHE_HOME:-~/.cache}/outbox-test-releases/<commit>/
        outbox-dispatcher  outboxctl  providers/*.so

The folder is made when missing (a fresh machine has no ~/.cache: the
first run builds cold, ~1-3 minutes a commit on two cores); delete it to
build again.  Parallel tests building the same commit wait for one build
(a lock file beside it)."""
import fcntl
import os
import shutil
import subprocess
import tempfile

from outbox_test import ROOT

# The last release (what main was when the online upgrade came), and the
# one before scopes and the live queue (schema 103).
RELEASES = {"71088d8": "the last release (schema 106)",
            "9d05c90": "the release before the live queue (schema 103)"}


def cache_root():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "outbox-test-releases")


def resolve(ref):
    r = subprocess.run(["git", "rev-parse", "--verify", ref + "^{commit}"], cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"{ref} is not in this clone's history: {r.stderr}")
    return r.stdout.strip()


def release_build(ref):
    """The folder holding ref's outbox-dispatcher, outboxctl and providers/."""
    commit = resolve(ref)
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    out = os.path.join(root, commit)
    with open(os.path.join(root, commit + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(os.path.join(out, "outbox-dispatcher"), os.X_OK):
            return out
        tree = tempfile.mkdtemp(prefix="outbox-release-")
        try:
            archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", tree], stdin=archive.stdout, check=True)
            assert archive.wait() == 0
            env = {k: v for k, v in os.environ.items()
                   if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "CFLAGS", "BUILD")}
            r = subprocess.run(["make", "-C", tree, "-j2", "all"], env=env, capture_output=True,
                               text=True)
            assert r.returncode == 0, \
                f"building {commit}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
            partial = out + f".partial.{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(os.path.join(partial, "providers"))
            for exe in ("outbox-dispatcher", "outboxctl"):
                shutil.copy2(os.path.join(tree, "build", exe), os.path.join(partial, exe))
            pdir = os.path.join(tree, "build", "providers")
            for so in os.listdir(pdir):
                if so.endswith(".so"):
                    shutil.copy2(os.path.join(pdir, so), os.path.join(partial, "providers", so))
            os.chmod(partial, 0o755)
            os.chmod(os.path.join(partial, "providers"), 0o755)
            shutil.rmtree(out, ignore_errors=True)
            os.rename(partial, out)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    return out
