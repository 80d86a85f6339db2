#!/usr/bin/env bash
# Pass-through overhead as issue 13 measures it: h2load (nghttp2-client) drives small GETs
# of one object over TLS and HTTP/2, straight to an nginx upstream that answers a small
# JSON object, and through haproxy, nginx and Bulwark in front of that upstream (TLS on
# both legs; HTTP/2 to the upstream but for nginx, which speaks HTTP/1.1 upstream).
# Proxies and the upstream share core 0, h2load has core 1.
#
#   loadtest/passthrough/h2load.sh [BULWARK_BINARY]     (default: target/release/bulwark)
#
# Bulwark does all its per-request work: a bearer token reviewed by TokenReview (cached),
# classification, a rule match (an exempt rule), admission, metrics, the replica pick and
# the front-proxy headers; its cache is off. Prints one table; the work folder is kept in
# $OUT (default: a temporary folder).
#
# Needs: h2load, haproxy, nginx, openssl, taskset (Debian: nghttp2-client haproxy nginx
# openssl util-linux).
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
bulwark=${1:-$here/target/release/bulwark}
out=${OUT:-$(mktemp -d)}
conns=${CONNS:-20}
streams=${STREAMS:-10}
requests=${REQUESTS:-200000}
rate=${RATE:-2000}
duration=${DURATION:-10}
path=/api/v1/namespaces/ns-0/configmaps/configmap-0
proxy_core=${PROXY_CORE:-0}
# Which rows to measure (all by default).
rows=${ROWS:-"direct haproxy nginx bulwark"}
load_core=${LOAD_CORE:-1}
for tool in h2load haproxy nginx openssl taskset; do
  command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin command -v "$tool" >/dev/null || {
    echo "h2load.sh: $tool is not installed" >&2; exit 2; }
done
export PATH=$PATH:/usr/sbin
cd "$out"

# --- certificates: one CA signs every serving certificate and the front-proxy client ---
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj /CN=bench-ca -keyout ca.key -out ca.crt 2>/dev/null
leaf() { # name, subject, extension
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
}
leaf server /CN=localhost "subjectAltName=DNS:localhost,IP:127.0.0.1"
leaf front-proxy /CN=front-proxy-client "extendedKeyUsage=clientAuth"
cat server.crt server.key > server.pem
echo -n "bench-own-token" > own-token

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up=$(port); hap=$(port); ngx=$(port); bw=$(port); bw_admin=$(port)

# --- the upstream: nginx answering like an apiserver, as fast as it can ---
mkdir -p upstream-tmp proxy-tmp
object='{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"configmap-0","namespace":"ns-0","resourceVersion":"1"},"data":{"k":"v"}}'
review='{"kind":"TokenReview","apiVersion":"authentication.k8s.io/v1","status":{"authenticated":true,"user":{"username":"bench","groups":["system:authenticated"]}}}'
cat > upstream.conf <<CONF
daemon off; master_process off; worker_processes 1; pid $out/upstream.pid;
error_log $out/upstream.log warn;
events { worker_connections 8000; }
http {
  access_log off;
  client_body_temp_path $out/upstream-tmp;
  server {
    listen 127.0.0.1:$up ssl http2;
    ssl_certificate $out/server.crt; ssl_certificate_key $out/server.key;
    http2_max_concurrent_streams 1000;
    keepalive_requests 100000000;
    default_type application/json;
    location = /readyz { return 200 'ok'; }
    location = /apis/authentication.k8s.io/v1/tokenreviews { return 201 '$review'; }
    location / { return 200 '$object'; }
  }
}
CONF

cat > haproxy.cfg <<CONF
global
  maxconn 8000
  nbthread 1
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend clients
  bind 127.0.0.1:$hap ssl crt $out/server.pem alpn h2,http/1.1
  default_backend upstream
backend upstream
  http-reuse always
  server up 127.0.0.1:$up ssl verify required verifyhost localhost ca-file $out/ca.crt alpn h2
CONF

cat > proxy.conf <<CONF
daemon off; master_process off; worker_processes 1; pid $out/proxy.pid;
error_log $out/proxy.log warn;
events { worker_connections 8000; }
http {
  access_log off;
  client_body_temp_path $out/proxy-tmp; proxy_temp_path $out/proxy-tmp;
  upstream up { server 127.0.0.1:$up; keepalive 64; }
  server {
    listen 127.0.0.1:$ngx ssl http2;
    ssl_certificate $out/server.crt; ssl_certificate_key $out/server.key;
    http2_max_concurrent_streams 1000;
    location / {
      proxy_pass https://up; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_ssl_trusted_certificate $out/ca.crt; proxy_ssl_verify on; proxy_ssl_name localhost;
      proxy_ssl_session_reuse on;
    }
  }
}
CONF

mkdir -p rules
cat > rules/bench.yaml <<CONF
rules:
  - name: bench
    precedence: 100
    match:
      groups: ["system:authenticated"]
    level: exempt
CONF
cat > bulwark.yaml <<CONF
listen:
  address: 127.0.0.1:$bw
  cert: $out/server.crt
  key: $out/server.key
  clientCA: $out/ca.crt
admin:
  address: 127.0.0.1:$bw_admin
upstream:
  replicas: ["127.0.0.1:$up"]
  ca: $out/ca.crt
  frontProxy:
    cert: $out/front-proxy.crt
    key: $out/front-proxy.key
  self:
    tokenFile: $out/own-token
identity:
  mode: front-proxy
rules:
  folder: $out/rules
cache:
  enabled: false
CONF

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
start() { # name, command...
  local name=$1; shift
  taskset -c "$proxy_core" "$@" > "$out/$name.out" 2>&1 &
  pids+=($!)
}
wait_port() {
  for _ in $(seq 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "h2load.sh: nothing listens on $1" >&2; return 1
}

start upstream nginx -c "$out/upstream.conf" -p "$out" -e "$out/upstream.log"
wait_port "$up"

h2() { # target port, extra h2load options...
  local target=$1; shift
  taskset -c "$load_core" h2load -c "$conns" -m "$streams" \
    -H "authorization: Bearer bench-client-token" "$@" "https://127.0.0.1:$target$path"
}
saturation() { h2 "$1" -n "$requests" | awk '/finished in/ {gsub(",",""); print $4}'; }
fixed() { # mean and p99-ish (max of the per-request stats h2load gives) at $rate req/s
  local per_conn=$(( rate / conns ))
  h2 "$1" --rps "$per_conn" -D "$duration" |
    awk '/time for request:/ {print $6, $4}'
}
measure() { # name, port
  local name=$1 port=$2
  h2 "$port" -n 2000 > /dev/null  # warm up: connections, token review, caches
  local sat fix
  sat=$(saturation "$port")
  fix=$(fixed "$port")
  printf '| %s | %s | %s |\n' "$name" "$sat" "${fix%% *}"
}

echo "| | saturation req/s | mean latency at $rate req/s |"
echo "|---|---|---|"
row() { [[ " $rows " == *" $1 "* ]]; }
if row direct; then measure direct "$up"; fi

if row haproxy; then
  start haproxy haproxy -db -f "$out/haproxy.cfg"
  wait_port "$hap"
  measure "haproxy (1 thread)" "$hap"
  kill "${pids[-1]}"; unset 'pids[-1]'
fi

if row nginx; then
  start nginx nginx -c "$out/proxy.conf" -p "$out" -e "$out/proxy.log"
  wait_port "$ngx"
  measure "nginx (1 worker, HTTP/1.1 upstream)" "$ngx"
  kill "${pids[-1]}"; unset 'pids[-1]'
fi

row bulwark || exit 0
for workers in 1 2; do
  cores=$proxy_core
  [ "$workers" = 2 ] && cores="$proxy_core,$load_core"
  TOKIO_WORKER_THREADS=$workers RUST_LOG=warn taskset -c "$cores" \
    "$bulwark" serve --config "$out/bulwark.yaml" > "$out/bulwark-$workers.out" 2>&1 &
  pids+=($!)
  wait_port "$bw"
  sleep 0.5
  measure "Bulwark ($workers worker$([ "$workers" = 2 ] && echo s))" "$bw"
  kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'
  sleep 0.5
done
echo
echo "work folder: $out"
