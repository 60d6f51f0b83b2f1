#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces st<SUFFIX>a and st<SUFFIX>b joined by a veth pair
# (10.77.0.1/24 in a on interface v<SUFFIX>a, 10.77.0.2/24 in b on v<SUFFIX>b; lo up in each). Needs root.
#
#   scripts/netns_pair.sh up SUFFIX     create (an existing pair of that suffix is removed first: rerunnable)
#   scripts/netns_pair.sh down SUFFIX   remove (no error when it is not there)
#   scripts/netns_pair.sh run SUFFIX a|b CMD ...
#                                       run CMD on "host a" (or b): in its namespace, with its own host name
#                                       (node1 / node2, in a private UTS namespace) that both hosts resolve
#                                       (/etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts)
#
# SUFFIX: up to 8 letters/digits, so that several pairs (several test sessions) can exist at once; interface
# names must stay within Linux's 15 characters. Every namespace has its own addresses and routes, so all pairs
# use the same two addresses without clashing.
set -euo pipefail

action=${1:?usage: netns_pair.sh up|down|run SUFFIX [a|b CMD ...]}
suffix=${2:?usage: netns_pair.sh up|down|run SUFFIX [a|b CMD ...]}
if ! [[ $suffix =~ ^[A-Za-z0-9]{1,8}$ ]]; then
    echo "netns_pair.sh: SUFFIX must be 1-8 letters or digits (got '$suffix')" >&2
    exit 2
fi
ns_a=st${suffix}a ns_b=st${suffix}b veth_a=v${suffix}a veth_b=v${suffix}b

down() {
    # Deleting a namespace deletes the veth end inside it, and with it the peer.
    ip netns del "$ns_a" 2>/dev/null || true
    ip netns del "$ns_b" 2>/dev/null || true
    ip link del "$veth_a" 2>/dev/null || true
    rm -rf "/etc/netns/$ns_a" "/etc/netns/$ns_b"
}

up() {
    down
    ip netns add "$ns_a"
    ip netns add "$ns_b"
    ip link add "$veth_a" type veth peer name "$veth_b"
    ip link set "$veth_a" netns "$ns_a"
    ip link set "$veth_b" netns "$ns_b"
    ip -n "$ns_a" addr add 10.77.0.1/24 dev "$veth_a"
    ip -n "$ns_b" addr add 10.77.0.2/24 dev "$veth_b"
    for ns in "$ns_a" "$ns_b"; do
        ip -n "$ns" link set lo up
    done
    ip -n "$ns_a" link set "$veth_a" up
    ip -n "$ns_b" link set "$veth_b" up
    for ns in "$ns_a" "$ns_b"; do
        mkdir -p "/etc/netns/$ns"
        printf '127.0.0.1 localhost\n10.77.0.1 node1\n10.77.0.2 node2\n' > "/etc/netns/$ns/hosts"
    done
}

run() {
    local side=${1:?run SUFFIX a|b CMD ...}
    shift
    case $side in
        a) ns=$ns_a name=node1 ;;
        b) ns=$ns_b name=node2 ;;
        *) echo "netns_pair.sh: host must be a or b (got '$side')" >&2; exit 2 ;;
    esac
    exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
}

case $action in
    up) up ;;
    down) down ;;
    run) shift 2; run "$@" ;;
    *) echo "netns_pair.sh: unknown action '$action' (up or down)" >&2; exit 2 ;;
esac
