#!/usr/bin/env bash
# The rollout fleet's Ray cluster (docs/cluster.md §1): the same `ray start` commands on every rollout node,
# with Ray's token authentication set up the way Ray 2.60 needs it on a multi-node cluster.
#
#   bash examples/lib/ray_cluster.sh head   [extra `ray start` flags]          # on the rollout head node
#   bash examples/lib/ray_cluster.sh worker rollout-head:6379 [extra flags]    # on every other rollout node
#   bash examples/lib/ray_cluster.sh stop                                      # on any node: stop Ray there
#
# Token authentication: every Ray process of the cluster and every client (the trainer's RAY_ADDRESS=ray://...)
# runs with RAY_AUTH_MODE=token and reads the same token from RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token).
# `head` writes a new random token there when the file does not exist yet; copy that file to the other rollout
# nodes and to the training nodes (or put it on shared storage and point RAY_AUTH_TOKEN_PATH at it). Without it a
# worker fails with `AuthenticationError: InvalidAuthToken ... RAY_AUTH_MODE is currently 'disabled'`.
#
# Node address: Ray finds a node's IP through a route to the internet (8.8.8.8) and falls back to 127.0.0.1, which
# other nodes cannot reach, on hosts without a default route (a private cluster network). So this script passes
# --node-ip-address: NODE_IP if set, else the source address of this host's route towards the head (worker) or
# the default route (head), else the first address of `hostname -I`.
#
# Environment: NUM_GPUS (8 per node; 0 on a CPU machine), RAY_PORT (6379), RAY_CLIENT_PORT (10001),
# RAY_AUTH_TOKEN_PATH, NODE_IP, RAY (the `ray` command), PYTHON (python3). Add `--block` to keep `ray start` in the
# foreground (the node stops when it gets SIGTERM), e.g. under a process supervisor.
set -euo pipefail

role="${1:-}"
shift || true
RAY="${RAY:-ray}"
NUM_GPUS="${NUM_GPUS:-8}"
RAY_PORT="${RAY_PORT:-6379}"
RAY_CLIENT_PORT="${RAY_CLIENT_PORT:-10001}"
PYTHON="${PYTHON:-python3}"
export RAY_AUTH_MODE=token
# Ray prestarts one idle worker per CPU of the node its first driver (the trainer's Ray Client server) connects to,
# for tasks. The fleet runs only actors with an environment of their own, which never use them (measured: 2 idle
# workers, 1.7 CPU-s, on a 2-CPU node). Set it to 1 to get them back (for tasks of your own on this cluster).
export RAY_prestart_worker_first_driver="${RAY_prestart_worker_first_driver:-0}"

# node_ip [HOST]: this host's source address towards HOST (default: the internet), else its first address.
node_ip() {
    "$PYTHON" - "${1:-8.8.8.8}" <<'EOF'
import socket, subprocess, sys
try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(sys.argv[1]), 53))  # picks the route; sends nothing
        print(s.getsockname()[0])
except OSError:
    print(subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0])
EOF
}
export RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"

case "$role" in
head)
    if [[ ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
        mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
        (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH")
        echo "ray_cluster.sh: wrote a new token to $RAY_AUTH_TOKEN_PATH; copy it to every rollout and training node" >&2
    fi
    NODE_IP="${NODE_IP:-$(node_ip)}"
    echo "ray_cluster.sh: head node address $NODE_IP" >&2
    exec "$RAY" start --head --port "$RAY_PORT" --num-gpus "$NUM_GPUS" --dashboard-host "$NODE_IP" \
        --ray-client-server-port "$RAY_CLIENT_PORT" --node-ip-address "$NODE_IP" "$@"
    ;;
worker)
    head_address="${1:?usage: ray_cluster.sh worker HEAD_HOST:PORT [ray start flags]}"
    shift
    if [[ ! -s "$RAY_AUTH_TOKEN_PATH" ]]; then
        echo "ray_cluster.sh: no token at $RAY_AUTH_TOKEN_PATH: copy the head's token file here first" >&2
        exit 2
    fi
    NODE_IP="${NODE_IP:-$(node_ip "${head_address%:*}")}"
    echo "ray_cluster.sh: worker node address $NODE_IP" >&2
    exec "$RAY" start --address "$head_address" --num-gpus "$NUM_GPUS" --node-ip-address "$NODE_IP" "$@"
    ;;
stop)
    exec "$RAY" stop "$@"
    ;;
*)
    echo "usage: ray_cluster.sh head|worker HEAD_HOST:PORT|stop [ray start flags]" >&2
    exit 2
    ;;
esac
