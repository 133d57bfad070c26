#!/usr/bin/env bash
# The launch agent of the namespaced hosts (tests/hosts/netns_hosts.sh), in ssh's place for mpirun
# (--mca plm_rsh_agent): called as `netns_agent.sh [OPTIONS] HOST COMMAND...`, it runs COMMAND (Open MPI's orted
# line, one shell command as ssh would pass it) inside HOST's network namespace, under the namespace's name as its
# host name. $RF_NETNS_HOSTS maps each
# address to its namespace, one "ADDRESS NAMESPACE" a line.
set -euo pipefail
while [ "$#" -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=${1:?netns_agent.sh: no host given}
shift
ns=$(awk -v host="$host" '$1 == host { print $2 }' "${RF_NETNS_HOSTS:?netns_agent.sh: RF_NETNS_HOSTS is not set}")
[ -n "$ns" ] || { echo "netns_agent.sh: $host is not in $RF_NETNS_HOSTS" >&2; exit 1; }
# Its own host name too (a UTS namespace named as the network one), as a real host has: Open MPI names its session
# directories and the messages that name a node after it.
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns && $*"
