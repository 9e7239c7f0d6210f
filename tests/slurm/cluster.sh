#!/usr/bin/env bash
# A real, local SLURM cluster for the test suite: munge + MariaDB + slurmdbd +
# slurmctld + 4 virtual slurmd nodes (n1..n4) on this one host.
#
#   tests/slurm/cluster.sh start    # install Debian packages if missing, start everything (idempotent)
#   tests/slurm/cluster.sh stop     # stop everything this script started (safe to repeat)
#   tests/slurm/cluster.sh status   # exit 0 = running, 3 = stopped, 1 = partly running
#   tests/slurm/cluster.sh env      # eval "$(tests/slurm/cluster.sh env)" -> SLURM_CONF etc.
#
# Needs root (Debian 12 / Slurm 22.05). All state, configs, logs and pid files live in
# one directory, ${HPCDL_SLURM_DIR:-/tmp/hpcdl-slurm}; delete it for a cold start.
#
# Tunables (environment):
#   HPCDL_SLURM_DIR           state directory                    (/tmp/hpcdl-slurm)
#   HPCDL_SLURM_PORT_BASE     ports: base+817 ctld, base+819 dbd,
#                             base+306 mariadb, base+1001.. slurmd (16000)
#   HPCDL_SLURM_START_TIMEOUT seconds to wait for each daemon/nodes (90)
#   HPCDL_SLURM_NO_INSTALL=1  never run apt-get (fail if packages are missing)
#   HPCDL_SLURM_KEEP_ON_FAILURE=1  leave daemons running when start fails (debugging)
#   HPCDL_SLURM_KEEP_JOBS=1   do not cancel jobs found in slurmctld's saved state at start
#   HPCDL_SLURM_PROCTRACK     force pgid|cgroup (default: cgroup if cgroup v1 is writable)
set -euo pipefail

DIR="${HPCDL_SLURM_DIR:-/tmp/hpcdl-slurm}"
case "$DIR" in /*) ;; *) DIR="$PWD/$DIR" ;; esac
DIR="${DIR%/}"
BASE="${HPCDL_SLURM_PORT_BASE:-16000}"
TIMEOUT="${HPCDL_SLURM_START_TIMEOUT:-90}"
CLUSTER=hpcdl
NODES=(n1 n2 n3 n4)
CPUS_PER_NODE=2

CTLD_PORT=$((BASE + 817))
DBD_PORT=$((BASE + 819))
DB_PORT=$((BASE + 306))

ETC="$DIR/etc"
RUN="$DIR/run"
LOG="$DIR/log"
MUNGE_DIR="$DIR/munge"
MUNGE_SOCK="$MUNGE_DIR/munge.socket"
DB_DIR="$DIR/mysql"
DB_SOCK="$DB_DIR/mysqld.sock"
SLURM_CONF_FILE="$ETC/slurm.conf"

PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

# Every daemon we start carries this variable in its environment (and so do the
# slurmstepd processes that slurmd forks); `stop` uses it to find stragglers.
MARK_VAR=HPCDL_SLURM_DAEMON

log() { printf '[cluster.sh] %s\n' "$*" >&2; }
die() { printf '[cluster.sh] ERROR: %s\n' "$*" >&2; exit 1; }

# ----------------------------------------------------------------- packages
install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "${HPCDL_SLURM_NO_INSTALL:-0}" = 1 ] && die "missing Debian packages: ${missing[*]} (HPCDL_SLURM_NO_INSTALL=1)"
    [ "$(id -u)" = 0 ] || die "missing Debian packages: ${missing[*]}; run as root to install them"
    log "installing ${missing[*]} (apt-get)"
    local created_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\n# installed by hpcdl tests/slurm/cluster.sh: do not start daemons\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    local rc=0
    (
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=600 update -qq &&
            apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}"
    ) >"${TMPDIR:-/tmp}/hpcdl-slurm-apt.log" 2>&1 || rc=$?
    [ "$created_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    if [ "$rc" != 0 ]; then
        tail -n 30 "${TMPDIR:-/tmp}/hpcdl-slurm-apt.log" >&2 || true
        die "apt-get failed (rc=$rc), full log: ${TMPDIR:-/tmp}/hpcdl-slurm-apt.log"
    fi
}

# ----------------------------------------------------------------- process helpers
pid_of() { # component -> pid if its pid file names a live process, else nothing
    local f="$RUN/$1.pid" pid
    [ -s "$f" ] || return 1
    pid=$(tr -dc '0-9' <"$f")
    [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
    # Guard against pid reuse: the process must carry our marker or at least be the right program.
    if tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qx "$MARK_VAR=$DIR" ||
        [ "$(cat 2>/dev/null "/proc/$pid/comm")" = "${1%%-*}" ]; then
        if ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; then echo "$pid"; return 0; fi
    fi
    return 1
}

components() { printf "%s\n" munged mariadbd slurmdbd slurmctld; for n in "${NODES[@]}"; do echo "slurmd-$n"; done; }

# start_daemon NAME CMD... : run CMD in the foreground mode of the daemon, detached, pid -> $RUN/NAME.pid
start_daemon() {
    local name=$1; shift
    env "$MARK_VAR=$DIR" SLURM_CONF="$SLURM_CONF_FILE" setsid "$@" \
        </dev/null >>"$LOG/$name.out" 2>&1 9>&- &
    echo $! >"$RUN/$name.pid"
}

marked_pids() { # live processes carrying our marker, plus slurmstepd holding files in $DIR
    local e pid
    for e in /proc/[0-9]*/environ; do
        pid=${e#/proc/}; pid=${pid%/environ}
        [ "$pid" = "$$" ] && continue
        if tr '\0' '\n' 2>/dev/null <"$e" | grep -qx "$MARK_VAR=$DIR"; then
            echo "$pid"
        elif [ "$(cat 2>/dev/null "/proc/$pid/comm")" = slurmstepd ] &&
            # setproctitle() may clobber slurmstepd's environ; its log fd still points into $DIR
            ls -l "/proc/$pid/fd/" 2>/dev/null | grep -qF -- "-> $DIR/"; then
            echo "$pid"
        fi
    done
}

descendants() { # all descendants of the given pids
    [ $# -eq 0 ] && return 0
    local f stat rest ppid
    local -A kids=()
    for f in /proc/[0-9]*/stat; do
        stat=$(cat 2>/dev/null "$f") || continue
        rest=${stat##*) }; ppid=$(echo "$rest" | cut -d' ' -f2)
        f=${f#/proc/}; kids[$ppid]+=" ${f%/stat}"
    done
    local queue=("$@") p c
    while [ ${#queue[@]} -gt 0 ]; do
        p=${queue[0]}; queue=("${queue[@]:1}")
        for c in ${kids[$p]:-}; do echo "$c"; queue+=("$c"); done
    done
}

job_cgroup_pids() { # processes in the job cgroups of our nodes (proctrack/cgroup, cgroup v1)
    grep -q '^ProctrackType=proctrack/cgroup' "$SLURM_CONF_FILE" 2>/dev/null || return 0
    local n d
    for n in "${NODES[@]}"; do
        for d in /sys/fs/cgroup/freezer/slurm_"$n"/uid_*/job_*; do
            [ -d "$d" ] && find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null
        done
    done
    return 0
}

wait_gone() { # wait_gone SECONDS PID...
    local t=$1 p alive; shift
    local deadline=$((SECONDS + t))
    while :; do
        alive=()
        for p in "$@"; do [ -d "/proc/$p" ] && ! grep -q '^State:.*Z' "/proc/$p/status" 2>/dev/null && alive+=("$p"); done
        [ ${#alive[@]} -eq 0 ] && return 0
        [ $SECONDS -ge $deadline ] && return 1
        sleep 0.2
    done
}

kill_pids() { # kill_pids PID... : TERM, wait, KILL
    [ $# -eq 0 ] && return 0
    kill -TERM "$@" 2>/dev/null || true
    if ! wait_gone 15 "$@"; then
        log "still alive after SIGTERM, sending SIGKILL: $*"
        kill -KILL "$@" 2>/dev/null || true
        wait_gone 5 "$@" || log "WARNING: could not kill: $*"
    fi
}

tails() { # show the end of every daemon log
    local f
    for f in "$LOG"/*; do
        [ -s "$f" ] || continue
        printf '\n===== tail %s =====\n' "$f" >&2
        tail -n 15 "$f" >&2
    done
}

wait_for() { # wait_for DESCRIPTION COMPONENT COMMAND... : poll COMMAND until success
    local what=$1 comp=$2; shift 2
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        if [ -n "$comp" ] && ! pid_of "$comp" >/dev/null; then
            tails; die "$comp died while waiting for $what"
        fi
        if [ $SECONDS -ge $deadline ]; then
            tails; die "timed out after ${TIMEOUT}s waiting for $what"
        fi
        sleep 0.2
    done
}

# ----------------------------------------------------------------- configs
cgroup_v1_writable() {
    local probe="/sys/fs/cgroup/freezer/hpcdl-probe-$$"
    [ -d /sys/fs/cgroup/freezer ] || return 1
    mkdir "$probe" 2>/dev/null || return 1
    rmdir "$probe" 2>/dev/null || true
    return 0
}

write_configs() {
    local proctrack=proctrack/pgid
    if cgroup_v1_writable; then proctrack=proctrack/cgroup; fi
    [ -n "${HPCDL_SLURM_PROCTRACK:-}" ] && proctrack=proctrack/${HPCDL_SLURM_PROCTRACK#proctrack/}
    local host; host=$(uname -n); host=${host%%.*}

    cat >"$SLURM_CONF_FILE" <<EOF
# Generated by tests/slurm/cluster.sh -- rewritten on every start.
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
StateSaveLocation=$DIR/state/slurmctld
SlurmdSpoolDir=$DIR/spool/%n
TmpFS=$DIR/tmpfs/%n
SlurmctldPidFile=$RUN/slurmctld.self.pid
SlurmdPidFile=$RUN/slurmd-%n.self.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=$proctrack
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
LaunchParameters=use_interactive_step
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5
ReturnToService=2
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
MinJobAge=60
KillWait=5
WaitTime=0
JobRequeue=1
MaxArraySize=1001
MaxJobCount=100000
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# For slurmdbd connections the munge socket is taken from here, not from AuthInfo.
AccountingStoragePass=$MUNGE_SOCK
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
EOF
    local i n
    for i in "${!NODES[@]}"; do
        n=${NODES[$i]}
        echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((BASE + 1001 + i)) CPUs=$CPUS_PER_NODE RealMemory=2000 State=UNKNOWN" >>"$SLURM_CONF_FILE"
    done
    local all; all=$(IFS=,; echo "${NODES[*]}")
    # Preemption as many sites run it: a job of the higher-tier partition "urgent" (same nodes)
    # preempts jobs of "debug": SLURM sends them SIGCONT and SIGTERM, waits GraceTime, kills what
    # is left and requeues the job itself (tests/slurm/test_hpcdl_slurm.py -k preempt).
    cat >>"$SLURM_CONF_FILE" <<EOF
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=$all Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes=$all Default=NO MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2 PreemptMode=OFF
EOF

    if [ "$proctrack" = proctrack/cgroup ]; then
        cat >"$ETC/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
CgroupAutomount=no
ConstrainCores=no
ConstrainDevices=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
EOF
    else
        rm -f "$ETC/cgroup.conf"
    fi

    (umask 077; cat >"$ETC/slurmdbd.conf" <<EOF
# Generated by tests/slurm/cluster.sh -- rewritten on every start.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.self.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    )
    chmod 0600 "$ETC/slurmdbd.conf"
}

ensure_hosts() { # node names must resolve for some client paths
    local missing=() n
    for n in "${NODES[@]}"; do getent hosts "$n" >/dev/null 2>&1 || missing+=("$n"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ -w /etc/hosts ]; then
        echo "127.0.0.1 ${missing[*]}  # hpcdl tests/slurm/cluster.sh" >>/etc/hosts
    else
        log "WARNING: node names ${missing[*]} do not resolve and /etc/hosts is not writable"
    fi
}

# ----------------------------------------------------------------- daemons
start_munge() {
    pid_of munged >/dev/null && return 0
    install -d -m 0755 -o munge -g munge "$MUNGE_DIR"
    if [ ! -s "$MUNGE_DIR/munge.key" ]; then
        dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    fi
    chown munge:munge "$MUNGE_DIR/munge.key"; chmod 0400 "$MUNGE_DIR/munge.key"
    touch "$LOG/munged.log"; chown munge:munge "$LOG/munged.log"
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
    start_daemon munged setpriv --reuid=munge --regid=munge --init-groups -- /usr/sbin/munged --foreground \
        --socket="$MUNGE_SOCK" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$LOG/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" --num-threads=2
    wait_for "munged" munged sh -c "munge -n --socket='$MUNGE_SOCK' | unmunge --socket='$MUNGE_SOCK'"
}

db() { mariadb --no-defaults --socket="$DB_SOCK" -uroot "$@"; }

start_mariadb() {
    pid_of mariadbd >/dev/null && return 0
    install -d -m 0755 -o mysql -g mysql "$DB_DIR"
    if [ ! -d "$DB_DIR/data/mysql" ]; then
        log "initialising MariaDB data directory"
        rm -rf "$DB_DIR/data"
        mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR/data" \
            --auth-root-authentication-method=socket --skip-test-db \
            >"$LOG/mariadb-install-db.log" 2>&1 ||
            { tail -n 30 "$LOG/mariadb-install-db.log" >&2; die "mariadb-install-db failed"; }
    fi
    rm -f "$DB_SOCK"
    start_daemon mariadbd /usr/sbin/mariadbd --no-defaults --user=mysql \
        --datadir="$DB_DIR/data" --bind-address=127.0.0.1 --port="$DB_PORT" \
        --socket="$DB_SOCK" --pid-file="$DB_DIR/mariadbd.pid" --log-error="$LOG/mariadbd.log" \
        --skip-name-resolve --innodb-buffer-pool-size=64M --innodb-log-file-size=16M \
        --max-connections=100 --performance-schema=OFF
    wait_for "mariadbd" mariadbd db -e 'SELECT 1'
    db <<'EOF'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
}

start_slurmdbd() {
    pid_of slurmdbd >/dev/null && return 0
    start_daemon slurmdbd /usr/sbin/slurmdbd -D
    wait_for "slurmdbd" slurmdbd sacctmgr -n -P list cluster format=cluster
}

add_cluster_to_accounting() {
    if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null ||
            { tails; die "sacctmgr add cluster $CLUSTER failed"; }
    fi
}

# Cancel every job, by user and by array-task id (e.g. 259_0): slurmctld 22.05 can recover an
# array task requeued by preemption under a raw job id it then calls invalid, and that task
# would hold its nodes until the cluster stops.
cancel_all_jobs() {
    local u
    for u in $(squeue -h -o %u 2>/dev/null | sort -u); do
        scancel --full --quiet -u "$u" 2>/dev/null || true
    done
    scancel --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
}

start_slurmctld() {
    pid_of slurmctld >/dev/null && return 0
    install -d -m 0755 "$DIR/state/slurmctld"
    start_daemon slurmctld /usr/sbin/slurmctld -D -i
    wait_for "slurmctld" slurmctld scontrol ping
    # Jobs left in the saved state by an unclean stop would be requeued and occupy nodes.
    local stale
    stale=$(squeue -h -o %i 2>/dev/null | paste -sd' ' -)
    if [ -n "$stale" ] && [ "${HPCDL_SLURM_KEEP_JOBS:-0}" != 1 ]; then
        log "cancelling jobs left over from an earlier run: $stale"
        cancel_all_jobs
    fi
}

start_slurmd() {
    local n
    for n in "${NODES[@]}"; do
        pid_of "slurmd-$n" >/dev/null && continue
        install -d -m 0755 "$DIR/spool/$n" "$DIR/tmpfs/$n"
        start_daemon "slurmd-$n" /usr/sbin/slurmd -D -N "$n"
    done
}

# nodes_idle [STATES]: all nodes are in one of STATES (an awk regex; default: idle)
nodes_idle() {
    local ok
    ok=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | awk -v re="^(${1:-idle})\$" '$2 ~ re' | wc -l)
    [ "$ok" -eq "${#NODES[@]}" ]
}

# wait_nodes_idle [STATES]: wait (resuming drained nodes) until nodes_idle STATES holds
wait_nodes_idle() {
    local deadline=$((SECONDS + TIMEOUT)) n
    until nodes_idle "${1:-idle}"; do
        for n in "${NODES[@]}"; do
            pid_of "slurmd-$n" >/dev/null || { tails; die "slurmd -N $n died during start"; }
        done
        if [ $SECONDS -ge $deadline ]; then
            sinfo -N -o '%N %T %E' >&2 || true
            squeue -o '%i %T %R' >&2 || true
            tails
            die "timed out after ${TIMEOUT}s waiting for ${#NODES[*]} nodes to be ${1:-idle}"
        fi
        # DOWN nodes come back by themselves (ReturnToService=2); a node drained by an
        # earlier run (e.g. "Kill task failed") would not, so resume it.
        local drained
        drained=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | awk '$2 ~ /^drain|^drng/ {print $1}' | paste -sd, -)
        if [ -n "$drained" ]; then
            log "resuming drained nodes: $drained"
            scontrol update NodeName="$drained" State=RESUME >/dev/null 2>&1 || true
        fi
        sleep 0.2
    done
}

# ----------------------------------------------------------------- commands
running_count() {
    local c k=0
    for c in $(components); do pid_of "$c" >/dev/null && k=$((k + 1)); done
    echo "$k"
}

cmd_status() {
    local total; total=$(components | wc -l)
    local k; k=$(running_count)
    local c
    for c in $(components); do
        if pid=$(pid_of "$c"); then echo "$c: running (pid $pid)"; else echo "$c: stopped"; fi
    done
    if [ "$k" -eq "$total" ]; then
        if SLURM_CONF="$SLURM_CONF_FILE" nodes_idle || SLURM_CONF="$SLURM_CONF_FILE" sinfo -h >/dev/null 2>&1; then
            echo "cluster: running ($DIR)"; return 0
        fi
        echo "cluster: daemons up but slurmctld not answering ($DIR)"; return 1
    elif [ "$k" -eq 0 ]; then
        echo "cluster: stopped ($DIR)"; return 3
    fi
    echo "cluster: partly running ($k/$total daemons, $DIR)"; return 1
}

cmd_env() {
    printf 'export SLURM_CONF=%q\n' "$SLURM_CONF_FILE"
    printf 'export HPCDL_SLURM_DIR=%q\n' "$DIR"
}

lock() { # serialise start/stop (e.g. several pytest-xdist workers); the lock lives next to $DIR
    command -v flock >/dev/null || return 0
    mkdir -p "$(dirname "$DIR")"
    exec 9>>"$DIR.lock"
    flock -w 600 9 || die "could not lock $DIR.lock"
}

cmd_stop() {
    [ -d "$DIR" ] || { log "nothing to stop ($DIR does not exist)"; return 0; }
    export SLURM_CONF="$SLURM_CONF_FILE"
    # Cancel jobs first so slurmstepd/job processes go away cleanly.
    if pid_of slurmctld >/dev/null && [ -n "$(squeue -h -o %A 2>/dev/null | head -n1)" ]; then
        cancel_all_jobs
        local deadline=$((SECONDS + 10))
        while [ -n "$(squeue -h -o %A 2>/dev/null | head -n1)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.3; done
    fi
    local c pid pids
    # Stop in reverse dependency order.
    for c in $(for n in "${NODES[@]}"; do echo "slurmd-$n"; done) slurmctld slurmdbd mariadbd munged; do
        pids=()
        if [ "${c%%-*}" = slurmd ]; then
            # stop all slurmd together
            [ "$c" = "slurmd-${NODES[0]}" ] || continue
            for n in "${NODES[@]}"; do pid=$(pid_of "slurmd-$n") && pids+=("$pid"); done
        else
            pid=$(pid_of "$c") && pids+=("$pid")
        fi
        kill_pids "${pids[@]}"
    done
    # slurmstepd outlives slurmd by design; if jobs could not be cancelled above, kill
    # their processes (descendants / job cgroups) and then the slurmstepds themselves.
    pids=($(marked_pids))
    local tasks=($( (descendants "${pids[@]}"; job_cgroup_pids) | sort -un |
        grep -vxF -f <(printf '%s\n' "${pids[@]}" "$$") ))
    if [ ${#pids[@]} -gt 0 ] || [ ${#tasks[@]} -gt 0 ]; then
        log "killing leftover processes: $(for p in "${pids[@]}" "${tasks[@]}"; do
            printf '%s; ' "$(tr '\0' ' ' 2>/dev/null </proc/$p/cmdline | cut -c1-50)"; done)"
        [ ${#tasks[@]} -gt 0 ] && kill_pids "${tasks[@]}"
        if [ ${#pids[@]} -gt 0 ]; then
            kill -KILL "${pids[@]}" 2>/dev/null || true
            wait_gone 5 "${pids[@]}" || log "WARNING: could not kill: ${pids[*]}"
        fi
    fi
    rm -f "$RUN"/*.pid "$MUNGE_SOCK" "$MUNGE_SOCK.lock" "$DB_SOCK"
    log "stopped ($DIR)"
}

cmd_start() {
    [ "$(id -u)" = 0 ] || die "must run as root"
    local total; total=$(components | wc -l)
    local k; k=$(running_count)
    if [ "$k" -eq "$total" ]; then
        export SLURM_CONF="$SLURM_CONF_FILE"
        # Nodes may be busy with jobs; only wait for down/drained/not-responding ones.
        wait_nodes_idle 'idle|mix|alloc|comp|resv|plnd'
        log "already running ($DIR)"; return 0
    fi
    if [ "$k" -gt 0 ]; then
        log "partly running ($k/$total daemons): restarting"
        cmd_stop
    fi
    local t0=$SECONDS
    # A failed start must not leave half a cluster behind (logs stay in $LOG).
    trap 'rc=$?; if [ $rc != 0 ] && [ "${HPCDL_SLURM_KEEP_ON_FAILURE:-0}" != 1 ]; then
              log "start failed: stopping what was started (logs kept in $LOG)"; cmd_stop; fi' EXIT
    install_packages
    install -d -m 0755 "$DIR" "$ETC" "$RUN" "$LOG" "$DIR/state" "$DIR/spool" "$DIR/tmpfs"
    export SLURM_CONF="$SLURM_CONF_FILE"
    write_configs
    ensure_hosts
    start_munge
    start_mariadb
    start_slurmdbd
    add_cluster_to_accounting
    start_slurmctld
    start_slurmd
    wait_nodes_idle
    trap - EXIT
    log "running: ${#NODES[@]} nodes idle after $((SECONDS - t0))s ($DIR); eval \"\$($0 env)\""
}

case "${1:-}" in
    start) lock; cmd_start ;;
    stop) lock; cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    restart) lock; cmd_stop; cmd_start ;;
    *) echo "usage: $0 start|stop|status|env|restart" >&2; exit 2 ;;
esac
