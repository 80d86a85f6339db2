#!/usr/bin/env bash
# Checks Bulwark's alerts with promtool: the rules file parses, its unit tests pass, and
# `promtool check metrics` accepts a live /metrics scrape (proxy/tests/deploy.rs, made to
# fail rather than skip when promtool is missing). Called by .ci/run; promtool comes from
# Debian's `prometheus` package.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if ! command -v promtool >/dev/null; then
    echo "promtool not found: apt-get install -y prometheus" >&2
    exit 1
fi
promtool --version | head -1
echo "--- promtool check rules"
promtool check rules "$here/bulwark.rules.yml"
echo "--- promtool test rules"
promtool test rules "$here/bulwark.rules.test.yml"
echo "--- promtool check metrics on a live scrape, dashboard expressions"
cd "$here/../.."
BULWARK_REQUIRE_TOOLS=1 cargo test -p bulwark --test deploy -- promtool
