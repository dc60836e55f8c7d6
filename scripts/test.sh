#!/bin/sh
# SPDX-License-Identifier: ISC
# scripts/test.sh: install what is needed, then run the whole suite
# (sanitizer build, throwaway PostgreSQL, unit + integration tests).
# Ends with "N passed, N failed"; exits non-zero on any failure.
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
make test
