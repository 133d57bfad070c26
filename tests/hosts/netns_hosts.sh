# shellcheck shell=bash
# Several hosts on one machine, for the multi-host tests (tests/hosts/*.sh): each host a network namespace with one
# veth on a bridge, the bridge in a namespace of its own, and a head namespace on the same bridge where mpirun runs
# (a login node: it holds no rank, so cutting or killing any host leaves the launcher's own link up). Addresses are
# 10.200.0.0/24, given only inside these namespaces: nothing is routed out, the machine's own interfaces and routes
# are never touched, and several tests can run side by side (each has its own bridge, so the same subnet never
# meets another test's). Every namespace is named with the test's PID and removed when the script exits, on every
# path (the EXIT trap), with whatever still runs in it killed first.
#
# Sourced after tests/common/mpirun_lib.sh. Functions:
#   hosts_up N          makes hosts 1..N (addresses 10.200.0.1..N, namespaces in host_ns[i]) and the head
#   on_head CMD...      runs CMD in the head namespace (mpirun goes there)
#   hosts_mpirun ARGS   scripts/ringflex-mpirun from the head, over the hosts of $hostfile (default $work/hostfile:
#                       hosts 1..N, one slot each), with
#                       the launch agent that enters each host's namespace; ARGS as mpirun's (-n, the program)
#   host_pids I         the pids running in host I's namespace (none: empty)
#   link_down I         takes host I's link down (inside its namespace), as a pulled cable
#   slow_links DELAY RATE  a netem qdisc on every host's veth: DELAY of latency and RATE of bandwidth each way; where
#                       the kernel has no sch_netem, a token bucket of RATE alone ($hosts_slowed says which)
# Where namespaces cannot be made (no root, no CAP_SYS_ADMIN, a kernel without them) the test fails under CI and
# scripts/test.sh (CI=true or RINGFLEX_STRICT_SKIPS=1, as tests/common/oracle_env.py decides) and skips with its
# reason elsewhere (exit 77).
hosts_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_dir=$(cd "$hosts_dir/../.." && pwd)
readonly hosts_subnet=10.200.0.0/24 hosts_head_addr=10.200.0.254
hosts_tag="rf$$"  # the PID: unique among the tests running now
host_ns=()
hosts_made=()  # every namespace made, removed by hosts_cleanup

hosts_strict() {
  local ci=${CI:-}
  ci=${ci,,}
  { [ -n "$ci" ] && [ "$ci" != 0 ] && [ "$ci" != false ]; } || [ "${RINGFLEX_STRICT_SKIPS:-}" = 1 ]
}

hosts_cleanup() {
  local ns pid
  for ns in "${hosts_made[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
  for ns in "${hosts_made[@]}"; do ip netns del "$ns" 2>/dev/null; done
  hosts_made=()
}
trap hosts_cleanup EXIT
trap 'exit 130' INT TERM

# hosts_make_ns NAME: a namespace with its loopback up, remembered for the cleanup.
hosts_make_ns() {
  ip netns add "$1" || return 1
  hosts_made+=("$1")
  ip -n "$1" link set lo up
}

# hosts_attach NS ADDR PORT: a veth from NS (eth0, ADDR/24) to the bridge (port PORT).
hosts_attach() {
  local ns=$1 addr=$2 port=$3
  ip link add "$hosts_tag$port" netns "$ns" type veth peer name "$port" netns "${hosts_tag}br" || return 1
  ip -n "$ns" link set "$hosts_tag$port" name eth0 &&
    ip -n "$ns" addr add "$addr/24" dev eth0 &&
    ip -n "$ns" link set eth0 up &&
    ip -n "${hosts_tag}br" link set "$port" master br0 &&
    ip -n "${hosts_tag}br" link set "$port" up
}

hosts_up() {
  local n=$1 i why
  if ! hosts_make_ns "${hosts_tag}br" 2>"$work/netns.err"; then
    why=$(tr '\n' ' ' <"$work/netns.err")
    why="cannot make network namespaces (root with CAP_SYS_ADMIN and CAP_NET_ADMIN needed): $why"
    if hosts_strict; then
      echo "FAILED: $why (a failure under CI and scripts/test.sh)" >&2
      exit 1
    fi
    echo "SKIPPED: $why"
    exit 77
  fi
  { ip -n "${hosts_tag}br" link add br0 type bridge && ip -n "${hosts_tag}br" link set br0 up; } || exit 1
  hosts_make_ns "${hosts_tag}head" && hosts_attach "${hosts_tag}head" "$hosts_head_addr" p0 || exit 1
  : >"$work/hostfile"
  : >"$work/hosts.map"
  for ((i = 1; i <= n; i++)); do
    host_ns[i]=${hosts_tag}h$i
    hosts_make_ns "${host_ns[i]}" && hosts_attach "${host_ns[i]}" "10.200.0.$i" "p$i" || exit 1
    echo "10.200.0.$i slots=1" >>"$work/hostfile"
    echo "10.200.0.$i ${host_ns[i]}" >>"$work/hosts.map"
  done
  hosts_count=$n
}

on_head() { ip netns exec "${hosts_tag}head" "$@"; }

hosts_mpirun() {
  RF_NETNS_HOSTS="$work/hosts.map" on_head "$repo_dir/scripts/ringflex-mpirun" --hostfile "${hostfile:-$work/hostfile}" \
    --mca plm_rsh_agent "$hosts_dir/netns_agent.sh" --mca btl_tcp_if_include "$hosts_subnet" \
    --mca oob_tcp_if_include "$hosts_subnet" "$@"
}

host_pids() { ip netns pids "${host_ns[$1]}" 2>/dev/null; }

link_down() { ip -n "${host_ns[$1]}" link set eth0 down; }

slow_links() {
  local i qdisc=(netem delay "$1" rate "$2")
  # shellcheck disable=SC2034  # read by the sourcing script
  hosts_slowed="netem: $1 delay, $2"
  if ! tc -n "${host_ns[1]}" qdisc add dev eth0 root "${qdisc[@]}" 2>/dev/null; then
    # A kernel without sch_netem (a micro-VM's, as on the development machine): the rate alone, by a token bucket
    # (its burst: what the rate sends in 4 ms, enough for the kernel's timer to keep up; its queue: 50 ms).
    qdisc=(tbf rate "$2" burst 512kb latency 50ms)
    # shellcheck disable=SC2034
    hosts_slowed="tbf: $2, no added delay (this kernel has no sch_netem)"
    tc -n "${host_ns[1]}" qdisc add dev eth0 root "${qdisc[@]}" || return 1
  fi
  for ((i = 2; i <= hosts_count; i++)); do
    tc -n "${host_ns[i]}" qdisc add dev eth0 root "${qdisc[@]}" || return 1
  done
}
