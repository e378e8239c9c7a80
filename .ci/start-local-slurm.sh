#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (Debian's slurm-wlm 22.05 + munge), for testing sbatch scripts,
# signals (scancel --signal) and requeue for real. Needs root. Idempotent: re-running restarts nothing that runs.
# Usage: bash .ci/start-local-slurm.sh (or make slurm-local)   then: sinfo; sbatch ...; squeue; scancel ...
# Copied from the workplace's shared/slurm/; .ci/run starts it before the suite so tests/test_slurm.py runs.
set -euo pipefail
if ! command -v slurmctld >/dev/null; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
H=$(hostname -s); CPUS=$(nproc); MEM=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 2048 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
chown munge:munge /run/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$H
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
NodeName=$H CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$H Default=YES MaxTime=INFINITE State=UP
CONF
printf 'CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n' > /etc/slurm/cgroup.conf
# The daemons start with only stdin/stdout/stderr open: a daemon keeps every descriptor it
# inherits, and one started under `flock LOCK bash .ci/run` would hold that lock for its lifetime.
without_inherited_fds() {
    (
        for fd in $(ls /proc/$BASHPID/fd); do
            [ "$fd" -gt 2 ] && eval "exec $fd>&-"
        done
        exec "$@"
    )
}
pgrep -x munged >/dev/null || without_inherited_fds su -s /bin/sh munge -c /usr/sbin/munged
pgrep -x slurmctld >/dev/null || without_inherited_fds /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || without_inherited_fds /usr/sbin/slurmd
for _ in $(seq 20); do sinfo -h -o %t 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo
