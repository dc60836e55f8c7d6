#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/peer/install.sh: graphile-worker, exactly as bench/peer/package-lock.json
# pins it, installed by `npm ci` into a cache folder named after the
# lockfile's hash; prints that folder's node_modules path.  A folder is
# reused only when its install finished (it is renamed into place after
# `npm ci` and a require() of the package succeed); a failed or interrupted
# install leaves at most a *.partial.* folder, which is never reused and is
# removed by the next install.  Any failure exits non-zero with npm's output.
#
#   PEER_CACHE   the cache folder (default ${XDG_CACHE_HOME:-~/.cache}/outbox-bench-peer)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
cache=${PEER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/outbox-bench-peer}
command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 ||
    { echo "bench-peer: needs node (>= 18) and npm" >&2; exit 1; }
hash=$(cat "$here/package.json" "$here/package-lock.json" | sha256sum | cut -c1-16)
dest=$cache/graphile-$hash
check() {   # $1: the folder; graphile-worker loads and is the pinned version
    NODE_PATH=$1/node_modules node -e '
        const v = require("graphile-worker/package.json").version;
        require("graphile-worker");
        if (v !== process.argv[1]) { console.error("graphile-worker " + v + ", want " + process.argv[1]); process.exit(1); }' \
        "$(sed -n 's/.*"graphile-worker": *"\([0-9.]*\)".*/\1/p' "$here/package.json" | head -1)"
}
if [ -f "$dest/.complete" ]; then
    echo "bench-peer: graphile-worker from the cache ($dest)" >&2
    echo "$dest/node_modules"
    exit 0
fi
mkdir -p "$cache"
rm -rf "$cache"/graphile-*.partial.*
tmp=$cache/graphile-$hash.partial.$$
mkdir "$tmp"
# Telemetry off, a private TMPDIR removed afterwards (scripts/npm-env.sh).
. "$here/../../scripts/npm-env.sh"
trap 'npm_quiet_end; rm -rf "$tmp"' EXIT
cp "$here/package.json" "$here/package-lock.json" "$tmp/"
echo "bench-peer: npm ci graphile-worker into $dest" >&2
if ! npm_quiet_in "$tmp" ci --ignore-scripts --no-audit --no-fund --loglevel=error >"$tmp/npm.log" 2>&1; then
    cat "$tmp/npm.log" >&2
    echo "bench-peer: npm ci failed (is the npm registry reachable?)" >&2
    exit 1
fi
check "$tmp" || { echo "bench-peer: the installed graphile-worker does not load" >&2; exit 1; }
touch "$tmp/.complete"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "$dest/node_modules"
