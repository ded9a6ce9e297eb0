#!/usr/bin/env bash
# `make demo`: the whole system as far as it exists, in a few minutes on a laptop CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
TS=.venv/bin/trainscale
export COLUMNS=${COLUMNS:-140}
step() { printf '\n\033[1m== %s ==\033[0m\n' "$*"; }

step "1. Why training takes a data center (the seed's running example, recomputed)"
$TS explain
