#!/bin/sh
# SPDX-License-Identifier: ISC
# scripts/demo.sh: install, build, and run the dispatcher on a demo: a
# throwaway PostgreSQL, a local HTTP sink, two workers, sample effects
# delivered through the seeds' approve-before-act path, and the
# operator's view of the result.  Cleans up after itself.
set -eu
cd "$(dirname "$0")/.."
sh scripts/install-deps.sh
make
sh tests/demo.sh
