# SPDX-License-Identifier: ISC
# scripts/npm-env.sh: sourced (". scripts/npm-env.sh") by every script that
# runs `npm ci` (examples/n8n/check-with-n8n.sh, bench/peer/install.sh), so
# that an install reports nowhere, reaches only the npm registry and leaves
# nothing behind, on any machine, whatever its ~/.npmrc says:
#   - install telemetry off: SCARF_ANALYTICS=false (@scarf/scarf, which n8n
#     pulls in, otherwise posts to its analytics service and writes a log to
#     TMPDIR), DO_NOT_TRACK=1, and npm's own fund, audit and update-notifier
#     requests off;
#   - native modules (isolated-vm, sqlite3, cpu-features) built from source
#     against the installed Node's headers (nodedir=/usr when
#     /usr/include/node has them, as Debian's libnode-dev and NodeSource's
#     nodejs install them), instead of a prebuilt binary from GitHub and
#     headers from nodejs.org, which a machine that reaches only the
#     registries cannot fetch;
#   - npm_quiet_in runs npm with a private TMPDIR and removes it afterwards.
export SCARF_ANALYTICS=false DO_NOT_TRACK=1
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false
export npm_config_build_from_source=true
if [ -z "${npm_config_nodedir:-}" ] && [ -f /usr/include/node/node.h ] && [ -f /usr/include/node/common.gypi ]; then
    export npm_config_nodedir=/usr
fi

NPM_PRIVATE_TMP=
# npm_quiet_in DIR ARGS...: npm ARGS run in DIR with a private TMPDIR, which
# is removed afterwards; returns npm's exit status.  A script killed while
# npm runs removes it from its EXIT trap with npm_quiet_end.
npm_quiet_in() {
    _npm_dir=$1; shift
    NPM_PRIVATE_TMP=$(mktemp -d "${TMPDIR:-/tmp}/outbox-npm.XXXXXX") || return 1
    _npm_rc=0
    (cd "$_npm_dir" && TMPDIR=$NPM_PRIVATE_TMP TMP=$NPM_PRIVATE_TMP TEMP=$NPM_PRIVATE_TMP npm "$@") || _npm_rc=$?
    npm_quiet_end
    return $_npm_rc
}
npm_quiet_end() {
    [ -z "$NPM_PRIVATE_TMP" ] || rm -rf "$NPM_PRIVATE_TMP"
    NPM_PRIVATE_TMP=
}
