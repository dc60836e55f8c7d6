# SPDX-License-Identifier: ISC
"""Every npm install the suite and the benches run (examples/n8n's
check-with-n8n.sh, bench/peer/install.sh) reports nowhere and leaves
nothing behind, whatever the machine's ~/.npmrc says: npm runs with
install telemetry off (SCARF_ANALYTICS=false, DO_NOT_TRACK=1, npm's fund,
audit and update-notifier off), native modules are built against this
Node's headers rather than fetched (nodedir, build-from-source), and npm's
TMPDIR is a private folder that is gone afterwards, with whatever an
install script wrote there (n8n's @scarf/scarf writes
scarf-js-history-USER.log).  A stand-in npm records what it was given."""
import json
import os
import subprocess

from outbox_test import ROOT

CHECK = os.path.join(ROOT, "examples", "n8n", "check-with-n8n.sh")
PEER_INSTALL = os.path.join(ROOT, "bench", "peer", "install.sh")

FAKE_NPM = r"""#!/bin/sh
# Records its environment, writes into TMPDIR as an install script would,
# then lays out what the caller checks for.
/usr/bin/python3 -c 'import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], "w"))' "$FAKE_NPM_ENV"
echo "history" > "${TMPDIR:-/tmp}/scarf-js-history-$(id -un).log"
mkdir -p node_modules/.bin node_modules/graphile-worker
printf '#!/bin/sh\necho 1.123.81\n' > node_modules/.bin/n8n
chmod +x node_modules/.bin/n8n
v=$(sed -n 's/.*"graphile-worker": *"\([0-9.]*\)".*/\1/p' package.json | head -1)
printf '{"name": "graphile-worker", "version": "%s", "main": "index.js"}\n' "$v" > node_modules/graphile-worker/package.json
echo 'module.exports = {};' > node_modules/graphile-worker/index.js
exit 0
"""


def run_install(tmp_path, argv, extra_env):
    bin_dir, tmp, home = tmp_path / "bin", tmp_path / "tmp", tmp_path / "home"
    for d in (bin_dir, tmp, home):
        d.mkdir()
    (bin_dir / "npm").write_text(FAKE_NPM)
    (bin_dir / "npm").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.lower().startswith("npm_config_") and k not in ("SCARF_ANALYTICS", "DO_NOT_TRACK")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", TMPDIR=str(tmp), HOME=str(home),
               FAKE_NPM_ENV=str(tmp_path / "npm-env.json"), **extra_env)
    env.pop("N8N_BIN", None)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "npm-env.json") as f:
        return json.load(f), tmp


def check_quiet(npm_env, tmp):
    assert npm_env.get("SCARF_ANALYTICS") == "false"
    assert npm_env.get("DO_NOT_TRACK") == "1"
    for k in ("npm_config_fund", "npm_config_audit", "npm_config_update_notifier"):
        assert npm_env.get(k) == "false", (k, npm_env.get(k))
    assert npm_env.get("npm_config_build_from_source") == "true"
    if os.path.isfile("/usr/include/node/common.gypi"):
        assert npm_env.get("npm_config_nodedir") == "/usr"
    private = npm_env["TMPDIR"]
    assert private != str(tmp) and os.path.dirname(private) == str(tmp), private
    assert not os.path.exists(private), "npm's private TMPDIR is still there"
    assert list(tmp.iterdir()) == [], f"left in TMPDIR: {list(tmp.iterdir())}"


def test_the_n8n_install_reports_nowhere_and_leaves_nothing(tmp_path):
    npm_env, tmp = run_install(tmp_path, ["sh", CHECK, "install"],
                               {"N8N_CACHE": str(tmp_path / "cache")})
    check_quiet(npm_env, tmp)


def test_the_peer_bench_install_reports_nowhere_and_leaves_nothing(tmp_path):
    npm_env, tmp = run_install(tmp_path, ["sh", PEER_INSTALL],
                               {"PEER_CACHE": str(tmp_path / "cache")})
    check_quiet(npm_env, tmp)


def guide_block(heading):
    """The first ```sh block after a heading of docs/n8n.md."""
    with open(os.path.join(ROOT, "docs", "n8n.md")) as f:
        text = f.read()
    rest = text[text.index(heading):]
    return rest[rest.index("```sh\n") + 6:rest.index("```\n", rest.index("```sh\n") + 6)]


def test_the_guides_n8n_install_runs_as_written_and_reaches_only_the_registry(tmp_path):
    """docs/n8n.md step 1, run as written (with a stand-in npm) from the
    repository's top folder: the pinned files land in ~/n8n and npm is told
    what a registry-only machine needs, as the suite's installs are (no
    prebuilt downloads, this Node's headers, no telemetry)."""
    block = guide_block("### 1. Install and run n8n")
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    (bin_dir / "npm").write_text(
        "#!/bin/sh\n/usr/bin/python3 -c 'import json, os, sys; "
        "json.dump({\"argv\": sys.argv[2:], \"cwd\": os.getcwd(), \"env\": dict(os.environ)}, "
        "open(sys.argv[1], \"w\"))' \"$FAKE_NPM_RECORD\" \"$@\"\n")
    (bin_dir / "npm").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.lower().startswith("npm_config_") and k != "SCARF_ANALYTICS"}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", HOME=str(home),
               FAKE_NPM_RECORD=str(tmp_path / "npm.json"))
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "npm.json") as f:
        rec = json.load(f)
    assert rec["cwd"] == str(home / "n8n")
    for name in ("package.json", "package-lock.json"):
        with open(home / "n8n" / name) as got, open(os.path.join(ROOT, "tests", "n8n", "npm", name)) as want:
            assert got.read() == want.read(), name
    assert rec["argv"][0] == "ci", rec["argv"]
    for flag in ("--no-audit", "--no-fund", "--nodedir=/usr", "--build-from-source"):
        assert flag in rec["argv"], (flag, rec["argv"])
    assert rec["env"].get("SCARF_ANALYTICS") == "false"
