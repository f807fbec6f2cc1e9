#!/usr/bin/env bash
# Start a throwaway one-node Slurm cluster on this machine (munged, slurmctld and slurmd as root, node
# "localhost" with this machine's CPUs) for the Slurm launcher's tests, installing Debian's slurm-wlm and
# munge if needed. Idempotent: a second run finds it running. Prints only the slurm.conf path to export
# as SLURM_CONF (every Slurm command reads it); everything else goes to stderr.
# Usage: export SLURM_CONF=$(bash scripts/start_slurm.sh)
set -euo pipefail
DIR=${PHALANX_SLURM_DIR:-/tmp/phalanx-slurm}
CTLD_PORT=${PHALANX_SLURM_PORT:-6817}
CONF=$DIR/slurm.conf
if [ "$(id -u)" != 0 ]; then
  echo "start_slurm.sh: the test cluster's daemons run as root; run it as root" >&2
  exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  # A fresh machine's package lists may be empty or old: refresh them when apt knows no candidate.
  if ! apt-cache policy slurm-wlm 2>/dev/null | grep -q 'Candidate: [0-9]'; then apt-get update -qq >&2; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >&2
fi

# munge authenticates every Slurm message; the package makes a key, a bare machine may lack one.
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key >&2
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  runuser -u munge -- /usr/sbin/munged >&2
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# The node is this machine as the configuration says it is (config_overrides): CPUs from nproc, so a
# container's CPU limit is what Slurm hands out, and memory a little under what the kernel reports.
mkdir -p "$DIR/state" "$DIR/spool"
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
cat > "$CONF.new" <<EOF
ClusterName=phalanx-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again once its old credential expires (default 120 s): tests requeue.
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (default 60 s): a requeued job starts as soon as it may.
SchedulerParameters=sched_interval=2,bf_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# Finished jobs stay visible to scontrol (there is no accounting database for sacct) for an hour.
MinJobAge=3600
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
# A pid file names a live daemon only if that process is the daemon (after a SIGKILL the pid may be reused).
running() { [ -f "$1" ] && [ "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" = "$2" ]; }
if ! cmp -s "$CONF.new" "$CONF"; then  # a new or changed configuration: restart on it
  for daemon in slurmd slurmctld; do
    pid=$DIR/$daemon.pid
    if running "$pid" "$daemon"; then kill "$(cat "$pid")"; while running "$pid" "$daemon"; do sleep 0.1; done; fi
  done
  mv "$CONF.new" "$CONF"
else
  rm -f "$CONF.new"
fi
export SLURM_CONF=$CONF
# -c: a throwaway cluster starts with no jobs (an earlier session's queue must not run again here).
running "$DIR/slurmctld.pid" slurmctld || slurmctld -c -f "$CONF" >&2
running "$DIR/slurmd.pid" slurmd || slurmd -f "$CONF" -N localhost >&2

state() { sinfo -h -n localhost -o '%T' 2>/dev/null | head -n 1; }
for _ in $(seq 300); do
  case "$(state)" in
    idle|mixed|allocated) echo "$CONF"; exit 0 ;;
    # A node left down or drained by an earlier run (a killed slurmd) comes back by hand.
    down*|drain*) scontrol update nodename=localhost state=resume >&2 || true ;;
  esac
  sleep 0.2
done
echo "start_slurm.sh: the node never became idle (sinfo: $(state); see $DIR/slurmctld.log and $DIR/slurmd.log)" >&2
exit 1
