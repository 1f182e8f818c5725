# Shared by the sbatch scripts in examples/slurm/ (sourced, not run): the --signal check, the training step under
# srun, and the self-requeue of a run that stopped on the exit signal. See docs/cluster.md, "Slurm".
#
# A batch script runs from a copy in slurmd's spool folder, so it finds the repository through REPO_ROOT (default:
# the folder sbatch was called from, $SLURM_SUBMIT_DIR: submit from the repository root).
#
# Environment (every variable has a default):
#   EXIT_SIGNAL_GRACE_SECONDS   the trainer's --exit-signal-grace-seconds (60, as the recipes): finish the step, save
#   SIGNAL_MARGIN_SECONDS       what --signal=TERM@N must leave above the grace period (30): Slurm sends the signal up
#                               to its scheduling interval early or late, and the batch script still has to requeue
#   STOP_DIR                    where each node's launcher leaves its clean-stop marker (a folder per job under
#                               $SLURM_SUBMIT_DIR/slurm-stops; on the shared filesystem)
#   MASTER_PORT                 the training ranks' rendezvous port (20000 + job id mod 20000: jobs sharing a node
#                               do not collide)
#   SRUN_EXTRA_ARGS             more srun flags for every step, e.g. a container's (docs/cluster.md, "Slurm")
#   RAY_START_ARGS              more `ray start` flags for the rollout cluster's nodes (e.g. --temp-dir DIR)

REPO_ROOT="${REPO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
RAY_STEP_PIDS=() # the Ray cluster's background steps (start_ray_cluster), for stop_ray_cluster
EXIT_SIGNAL_GRACE_SECONDS="${EXIT_SIGNAL_GRACE_SECONDS:-60}"
SIGNAL_MARGIN_SECONDS="${SIGNAL_MARGIN_SECONDS:-30}"
STOP_DIR="${STOP_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/slurm-stops/${SLURM_JOB_ID:-nojob}}"

# slurm_log MESSAGE...: one line on the job's output, prefixed with the job and its restart count.
slurm_log() {
    echo "slurm job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}): $*" >&2
}

# signal_setting SCRIPT: the job's --signal as the job can see it. Slurm 22.05 shows the setting nowhere to the job
# (not in `scontrol show job`, `squeue --json` or the environment), so: SBATCH_SIGNAL when the submitter set it
# (it overrides the script's lines and reaches the job through sbatch's default --export=ALL), else the last
# `#SBATCH --signal` line of SCRIPT. A --signal on sbatch's command line is invisible to the job.
signal_setting() {
    if [[ -n "${SBATCH_SIGNAL:-}" ]]; then
        echo "$SBATCH_SIGNAL"
        return
    fi
    sed -n -E 's/^#SBATCH[[:space:]]+--signal[=[:space:]][[:space:]]*([^[:space:]]+).*/\1/p' "$1" | tail -n 1
}

# check_signal_margin SCRIPT: refuse (exit 2) a --signal that gives the ranks less than the grace period plus the
# margin before Slurm's time limit, one that only signals the batch shell (B:), or one that is not SIGTERM (the
# trainer's exit signal). Runs in the batch script before any srun, so no node has done any work.
check_signal_margin() {
    local spec seconds sig
    spec="$(signal_setting "$1")"
    if [[ -z "$spec" ]]; then
        slurm_log "warning: no --signal=TERM@N: at the time limit the ranks get SIGTERM only KillWait seconds" \
            "before SIGKILL; add #SBATCH --signal=TERM@$((EXIT_SIGNAL_GRACE_SECONDS + SIGNAL_MARGIN_SECONDS))"
        return 0
    fi
    if [[ ! "$spec" =~ ^((R|B|RB|BR):)?([A-Za-z0-9]+)(@([0-9]+))?$ ]]; then
        slurm_log "error: cannot read --signal=$spec (expected [R:]TERM@SECONDS)"
        exit 2
    fi
    if [[ "${BASH_REMATCH[2]}" == *B* ]]; then
        slurm_log "error: --signal=$spec signals only the batch shell; the ranks would never see it: use TERM@N"
        exit 2
    fi
    sig="${BASH_REMATCH[3]#SIG}"
    if [[ "$sig" != TERM && "$sig" != 15 ]]; then
        slurm_log "error: --signal=$spec: the trainer stops cleanly on SIGTERM only (--exit-signal-handler)"
        exit 2
    fi
    seconds="${BASH_REMATCH[5]:-60}" # Slurm's default when @N is left out
    if ((seconds < EXIT_SIGNAL_GRACE_SECONDS + SIGNAL_MARGIN_SECONDS)); then
        slurm_log "error: --signal=$spec sends SIGTERM ${seconds}s before the time limit, less than" \
            "--exit-signal-grace-seconds ${EXIT_SIGNAL_GRACE_SECONDS}s plus a margin of ${SIGNAL_MARGIN_SECONDS}s:" \
            "a step cut short there is lost. Raise N to at least" \
            "$((EXIT_SIGNAL_GRACE_SECONDS + SIGNAL_MARGIN_SECONDS)) or lower EXIT_SIGNAL_GRACE_SECONDS"
        exit 2
    fi
}

# first_host NODELIST: the first host of a Slurm node list (e.g. node[0-3] -> node0).
first_host() {
    scontrol show hostnames "$1" | head -n 1
}

# run_training NNODES SRUN_FLAGS... -- RECIPE [TRAINER_FLAGS...]: RECIPE once per node under srun (NODE_RANK from
# SLURM_NODEID), each node's launcher told where to leave its clean-stop marker. Then:
#   - every node left a marker (all ranks stopped cleanly on the exit signal and saved): requeue this job, which
#     resumes from that checkpoint when it starts again (the recipes pass --load $SAVE_DIR);
#   - srun succeeded and no marker: the run finished; the job ends COMPLETED;
#   - otherwise: the job fails with srun's exit status (a crash is not requeued by this script).
run_training() {
    local nnodes="$1" srun_flags=() rc=0 markers step
    shift
    read -r -a srun_flags <<<"${SRUN_EXTRA_ARGS:-}"
    while (($#)) && [[ "$1" != -- ]]; do
        srun_flags+=("$1")
        shift
    done
    shift
    rm -rf "$STOP_DIR" # a stale marker from the previous start of this job
    mkdir -p "$STOP_DIR"
    # a port of this job's own: two jobs sharing a node (their ranks rendezvous there) would both take 6000
    MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
    slurm_log "training on $nnodes node(s), MASTER_ADDR=$MASTER_ADDR, MASTER_PORT=$MASTER_PORT"
    # --kill-on-bad-exit: one failed node ends the step at once
    # shellcheck disable=SC2016 # expanded by the step's shell on each node
    srun --kill-on-bad-exit=1 --nodes "$nnodes" --ntasks "$nnodes" --ntasks-per-node 1 "${srun_flags[@]}" \
        --export=ALL,NNODES="$nnodes",MASTER_ADDR="$MASTER_ADDR",MASTER_PORT="$MASTER_PORT",STOP_DIR="$STOP_DIR" \
        bash -c 'NODE_RANK="$SLURM_NODEID" MEGATRON_PACS_STOP_MARKER="$STOP_DIR/node$SLURM_NODEID.json" exec bash "$@"' \
        run_training "$@" --exit-signal-grace-seconds "$EXIT_SIGNAL_GRACE_SECONDS" || rc=$?
    markers=$(find "$STOP_DIR" -maxdepth 1 -name 'node*.json' | wc -l)
    if ((rc == 0 && markers == nnodes)); then
        step=$(sed -n -E 's/.*"step": ([0-9]+|null).*/\1/p' "$STOP_DIR/node0.json")
        slurm_log "every node stopped cleanly on the exit signal after saving step $step: requeueing to resume"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    if ((rc == 0 && markers == 0)); then
        slurm_log "training finished"
        return 0
    fi
    slurm_log "error: training exited $rc with clean-stop markers from $markers of $nnodes node(s): not requeued"
    exit $((rc ? rc : 1))
}

# start_ray_cluster NODELIST [SRUN_FLAGS...]: the rollout fleet's Ray cluster on NODELIST (examples/lib/ray_cluster.sh:
# the head on its first node, a worker on each other node), as background job steps. Waits (up to RAY_WAIT_SECONDS,
# 300) until the head's Ray Client port answers, then sets RAY_ADDRESS=ray://HEAD:RAY_CLIENT_PORT and RAY_STEP_PIDS.
# A head whose `ray start` gives up (Ray waits a fixed 30 s for its raylet to register, too short on a loaded node)
# is started again, up to RAY_START_ATTEMPTS (3) times in all.
# RAY_AUTH_TOKEN_PATH must name a file on the shared filesystem: the head writes the token there, the workers and
# the trainer read it. Extra SRUN_FLAGS (e.g. --het-group=1) go to both steps.
start_ray_cluster() {
    local nodelist="$1" head count waited attempt up extra=() ray_args=()
    shift
    read -r -a extra <<<"${SRUN_EXTRA_ARGS:-}"
    set -- "$@" "${extra[@]}"
    read -r -a ray_args <<<"${RAY_START_ARGS:-}"
    local hosts=()
    mapfile -t hosts < <(scontrol show hostnames "$nodelist")
    head="${hosts[0]}"
    count="${#hosts[@]}"
    : "${RAY_AUTH_TOKEN_PATH:?set RAY_AUTH_TOKEN_PATH to a file on the shared filesystem}"
    export RAY_AUTH_TOKEN_PATH
    RAY_STEP_PIDS=()
    slurm_log "rollout cluster: Ray head on $head, $((count - 1)) worker(s)"
    for ((attempt = 1; ; attempt++)); do
        # --overlap: Ray's steps share their nodes with nothing else of this job, but must not block later steps there
        srun "$@" --overlap --nodes 1 --ntasks 1 --nodelist "$head" \
            bash "$REPO_ROOT/examples/lib/ray_cluster.sh" head --block "${ray_args[@]}" &
        RAY_STEP_PIDS=($!)
        waited=0 up=0
        while ((waited < ${RAY_WAIT_SECONDS:-300})) && kill -0 "${RAY_STEP_PIDS[0]}" 2>/dev/null; do
            if timeout 2 bash -c "exec 3<>/dev/tcp/$head/${RAY_CLIENT_PORT:-10001}" 2>/dev/null; then
                up=1
                break
            fi
            sleep 2
            waited=$((waited + 2))
        done
        ((up)) && break
        if kill -0 "${RAY_STEP_PIDS[0]}" 2>/dev/null || ((attempt >= ${RAY_START_ATTEMPTS:-3})); then
            slurm_log "error: the Ray head on $head did not open port ${RAY_CLIENT_PORT:-10001}" \
                "(attempt $attempt, ${waited}s)"
            exit 1
        fi
        slurm_log "warning: the Ray head's start on $head failed (attempt $attempt): starting it again"
    done
    if ((count > 1)); then
        srun "$@" --overlap --nodes $((count - 1)) --ntasks $((count - 1)) --ntasks-per-node 1 --exclude "$head" \
            bash "$REPO_ROOT/examples/lib/ray_cluster.sh" worker "$head:${RAY_PORT:-6379}" --block "${ray_args[@]}" &
        RAY_STEP_PIDS+=($!)
    fi
    export RAY_ADDRESS="ray://$head:${RAY_CLIENT_PORT:-10001}"
    slurm_log "rollout cluster up: RAY_ADDRESS=$RAY_ADDRESS"
}

# stop_ray_cluster: end the Ray steps started by start_ray_cluster (srun passes the TERM on as a SIGKILL of the step:
# right for Ray at the end of the job, never for the trainer, which must get its SIGTERM to save).
# Does nothing when the batch script exits before start_ray_cluster started a step.
stop_ray_cluster() {
    local pid
    ((${#RAY_STEP_PIDS[@]})) || return 0
    for pid in "${RAY_STEP_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    wait "${RAY_STEP_PIDS[@]}" 2>/dev/null || true
}
