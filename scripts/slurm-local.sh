#!/usr/bin/env bash
# A real one-node Slurm on this machine, for tests: munge, MariaDB + slurmdbd (accounting: submitit
# reads job states with sacct), slurmctld and slurmd, from the distribution's packages. The node's
# features stand for the GPU types of conf/gpu (slurm.constraint), so sweeps select "cards" by
# constraint with no GPU present (backend=sim). Needs root.
#
#   scripts/slurm-local.sh install   apt-get the packages (Debian/Ubuntu)
#   scripts/slurm-local.sh start     configure and start everything; waits until the node is idle
#   scripts/slurm-local.sh stop      stop what start started
#   scripts/slurm-local.sh status    sinfo
#
# State, logs and pid files: $HARNESS_SLURM_DIR (default /tmp/harness-slurm). It writes
# /etc/slurm/slurm.conf and slurmdbd.conf, and refuses to overwrite ones it did not write.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${HARNESS_SLURM_DIR:-/tmp/harness-slurm}
MARK="# written by harness scripts/slurm-local.sh"
HOST=$(hostname -s)
CPUS=${HARNESS_SLURM_CPUS:-8}   # declared, not counted: test jobs ask for one CPU each

log() { echo "slurm-local: $*" >&2; }

install() {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    munge slurmctld slurmd slurmdbd slurm-client mariadb-server >/dev/null
}

features() {  # every card's constraint, comma-separated
  sed -n 's/^ *constraint: *\([A-Za-z0-9_-]*\).*/\1/p' harness/conf/gpu/*.yaml | sort -u | paste -sd, -
}

write_conf() {  # path, content: only over our own files
  if [ -e "$1" ] && ! grep -qF "$MARK" "$1"; then
    log "$1 exists and is not ours: not touching it"; exit 1
  fi
  printf '%s\n%s\n' "$MARK" "$2" > "$1"
}

wait_for() {  # seconds, what, command...
  local n=$1 what=$2; shift 2
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  log "$what did not come up; logs in $STATE"; exit 1
}

start() {
  [ "$(id -u)" = 0 ] || { log "needs root"; exit 1; }
  command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null || install
  mkdir -p "$STATE/ctld" "$STATE/slurmd" /etc/slurm /run/munge /var/log/munge /var/lib/munge /run/mysqld
  # munge: its key, its dirs owned by munge, the daemon as the munge user
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
  chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
  chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  wait_for 20 munged munge -n
  # MariaDB for slurmdbd
  mkdir -p "$STATE/mysql" && chown mysql:mysql /run/mysqld "$STATE/mysql"  # written as the mysql user
  [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  if ! mysqladmin ping >/dev/null 2>&1; then
    setsid /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
      --pid-file="$STATE/mysql/mariadb.pid" --log-error="$STATE/mysql/mariadb.log" </dev/null >/dev/null 2>&1 &
  fi
  wait_for 60 MariaDB mysqladmin ping
  mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db; CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'harness'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
  write_conf /etc/slurm/slurmdbd.conf "AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=harness
LogFile=$STATE/slurmdbd.log
PidFile=$STATE/slurmdbd.pid"
  chmod 600 /etc/slurm/slurmdbd.conf
  local mem
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
  write_conf /etc/slurm/slurm.conf "ClusterName=harness
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
MpiDefault=none
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
# Kill a job past its limit at once; keep finished jobs visible to squeue a while.
KillWait=5
OverTimeLimit=0
MinJobAge=600
InactiveLimit=0
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=$HOST CPUs=$CPUS RealMemory=$mem Features=$(features) State=UNKNOWN
PartitionName=harness Nodes=$HOST Default=YES MaxTime=INFINITE State=UP"
  pgrep -x slurmdbd >/dev/null || /usr/sbin/slurmdbd
  wait_for 60 slurmdbd sacctmgr -n list cluster
  sacctmgr -n list cluster format=cluster | grep -qw harness || sacctmgr -i add cluster harness >/dev/null
  pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
  wait_for 60 slurmctld scontrol ping
  pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
  wait_for 60 "the node" sh -c "sinfo -h -N -o %T | grep -qE '^(idle|mixed|allocated)'"
  log "up: node $HOST, $CPUS CPUs, features $(features)"
}

stop() {
  scancel --user=root >/dev/null 2>&1 || true
  for d in slurmd slurmctld slurmdbd; do pkill -x "$d" || true; done
  [ -s "$STATE/mysql/mariadb.pid" ] && kill "$(cat "$STATE/mysql/mariadb.pid")" 2>/dev/null || true
  pkill -x munged || true
  log "stopped"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) sinfo -N -o "%N %T %c %f" ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
