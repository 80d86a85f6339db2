#!/usr/bin/env bash
# An alert that really fires: Prometheus scrapes a Bulwark (the load tester's sandbox: a
# simulated 3-replica cluster with Bulwark in front) while a burst of LISTs makes it reject,
# sees BulwarkRejectingRequests firing, then resolving after the burst; runs every query of
# the dashboard and the alerts on that Prometheus (proxy/tests/deploy.rs, none may error);
# then stops Bulwark and sees BulwarkDown firing, with its runbook link.
#
# The rules Prometheus loads are a generated copy of bulwark.rules.yml with every window
# and `for` scaled down to seconds; the shipped file is never changed for the test.
#
# Needs: promtool's `prometheus` (Debian package `prometheus`), curl, base64, and
#   - fairness in Bulwark (rules that reject), and
#   - `bulwark-loadtest sandbox --rules DIR`, which puts DIR in Bulwark's `rules.folder`.
# Run by .ci/run after the tests.
#
# Usage: deploy/prometheus/fire-test.sh   (from anywhere; builds what it needs)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$(mktemp -d)"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

die() { echo "fire-test: $*" >&2; exit 1; }
for tool in prometheus curl base64; do
    command -v "$tool" >/dev/null || die "$tool not found (apt-get install -y prometheus curl)"
done

# Short windows: rates over 30s, `for` of 10s, evaluated every 2s.
window=30s
hold=10s
interval=2s

echo "--- build"
(cd "$root" && cargo build -q -p bulwark-loadtest)
loadtest="$root/target/debug/bulwark-loadtest"
"$loadtest" sandbox --help | grep -q -- '--rules' \
    || die "bulwark-loadtest sandbox has no --rules option yet (needed to load a rules folder)"

echo "--- rules: the sandbox's operators may LIST secrets once a second"
mkdir -p "$work/rules"
cat > "$work/rules/burst.yaml" <<'RULES'
levels:
  - name: burst-test
    seats: 2
    queues: 4
    handSize: 2
    queueLength: 2
    maxWait: 1s
rules:
  - name: operators-list-secrets
    precedence: 100
    match:
      groups: ["sandbox:operators"]
      verbs: [list]
      resources: [{group: "", resource: secrets}]
      namespaces: ["*"]
    level: burst-test
    flow: user
    rate: {qps: 1, burst: 1}
    mode: enforce
RULES

echo "--- sandbox"
"$loadtest" sandbox --dir "$work/sandbox" --rules "$work/rules" > "$work/sandbox.log" 2>&1 &
sandbox_pid=$!
pids+=($sandbox_pid)
for _ in $(seq 1 300); do
    [ -f "$work/sandbox/ready" ] && break
    sleep 0.2
done
[ -f "$work/sandbox/ready" ] || { cat "$work/sandbox.log" >&2; die "the sandbox never became ready"; }
server="$(awk '/^bulwark /{print $2}' "$work/sandbox/ready")"
metrics="$(grep -o 'http://[^ ]*/metrics' "$work/sandbox.log" | head -1)"
[ -n "$metrics" ] || die "the sandbox did not print Bulwark's metrics address"
admin="${metrics#http://}"; admin="${admin%/metrics}"
echo "bulwark $server, admin $admin"

# The operator's credentials, out of its kubeconfig, for curl.
kubeconfig="$work/sandbox/kubeconfig-operator"
field() { awk -v k="$1:" '$1==k {print $2; exit}' "$kubeconfig" | base64 -d; }
field certificate-authority-data > "$work/ca.crt"
field client-certificate-data > "$work/operator.crt"
field client-key-data > "$work/operator.key"

echo "--- prometheus with scaled-down rules"
sed -E \
    -e "s/\[[0-9]+[smh]\]/[$window]/g" \
    -e "s/^([[:space:]]*)for: [0-9]+[smh]$/\1for: $hold/" \
    "$here/bulwark.rules.yml" > "$work/rules.scaled.yml"
if cmp -s "$here/bulwark.rules.yml" "$work/rules.scaled.yml"; then
    die "scaling the windows changed nothing"
fi
promtool check rules "$work/rules.scaled.yml" >/dev/null
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 19090)"
cat > "$work/prometheus.yml" <<PROM
global:
  scrape_interval: $interval
  evaluation_interval: $interval
rule_files:
  - $work/rules.scaled.yml
scrape_configs:
  - job_name: bulwark
    static_configs:
      - targets: ["$admin"]
PROM
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$port" > "$work/prometheus.log" 2>&1 &
pids+=($!)
prom="http://127.0.0.1:$port"
for _ in $(seq 1 100); do curl -sf "$prom/-/ready" >/dev/null && break; sleep 0.2; done
curl -sf "$prom/-/ready" >/dev/null || { cat "$work/prometheus.log" >&2; die "prometheus never became ready"; }

firing() {
    curl -sfG "$prom/api/v1/query" \
        --data-urlencode 'query=ALERTS{alertname="BulwarkRejectingRequests",alertstate="firing",rule="operators-list-secrets"}' \
        | grep -q '"alertstate":"firing"'
}

# Builds the deploy tests now, so that the query check below runs at once.
(cd "$root" && cargo test -q -p bulwark --test deploy --no-run 2>/dev/null)

echo "--- burst: 8 clients LIST secrets in a loop"
burst() {
    while true; do
        curl -s -o /dev/null --cacert "$work/ca.crt" --cert "$work/operator.crt" \
            --key "$work/operator.key" "$server/api/v1/secrets" || true
    done
}
burst_pids=()
for _ in $(seq 1 8); do burst & burst_pids+=($!); pids+=($!); done

deadline=$((SECONDS + 120))
until firing; do
    [ $SECONDS -lt $deadline ] || {
        curl -s "$metrics" | grep '^bulwark_rejected_requests_total' >&2 || true
        die "BulwarkRejectingRequests never fired"
    }
    sleep 2
done
echo "firing after the burst started"

echo "--- burst over"
for pid in "${burst_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
deadline=$((SECONDS + 120))
while firing; do
    [ $SECONDS -lt $deadline ] || die "BulwarkRejectingRequests never resolved"
    sleep 2
done
echo "resolved after the burst"

echo "--- every dashboard panel, annotation and alert expression runs on this Prometheus"
(cd "$root" && BULWARK_PROMETHEUS_URL="$prom" cargo test -q -p bulwark --test deploy \
    -- --exact dashboard_and_alert_queries_run_on_a_live_prometheus --nocapture) \
    || die "a dashboard or alert query failed on the live Prometheus"

echo "--- Bulwark stops: BulwarkDown fires"
kill "$sandbox_pid"
wait "$sandbox_pid" 2>/dev/null || true
down() {
    curl -sfG "$prom/api/v1/query" \
        --data-urlencode 'query=ALERTS{alertname="BulwarkDown",alertstate="firing",job="bulwark"}' \
        | grep -q '"alertstate":"firing"'
}
deadline=$((SECONDS + 120))
until down; do
    [ $SECONDS -lt $deadline ] || die "BulwarkDown never fired"
    sleep 2
done
echo "BulwarkDown firing:"
curl -sfG "$prom/api/v1/alerts" | python3 -c '
import json, sys
for a in json.load(sys.stdin)["data"]["alerts"]:
    if a["labels"]["alertname"] == "BulwarkDown":
        print(json.dumps(a, indent=2))
' 2>/dev/null || curl -sfG "$prom/api/v1/alerts"
echo "fire-test: OK"
