"""examples/slurm/ without a cluster: the scripts' Slurm settings, the --signal margin check, and the batch script's
decision after the training step (requeue on every node's clean-stop marker, finish, or fail) with ``srun`` and
``scontrol`` replaced by stand-ins on the PATH. tests/cluster/test_slurm.py runs them under a real Slurm."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "examples" / "slurm"
LIB = SLURM / "lib.bash"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
TRAINING = [p for p in SCRIPTS if p.name != "rollout.sbatch"]


def test_the_scripts_are_there():
    assert {p.name for p in SCRIPTS} == {"hetjob.sbatch", "rollout.sbatch", "tiny.sbatch", "train.sbatch"}


@pytest.mark.parametrize("script", [*SCRIPTS, LIB], ids=lambda p: p.name)
def test_bash_syntax_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True, capture_output=True, text=True)
    text = script.read_text()
    if script.suffix == ".sbatch":
        assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
        assert 'source "${REPO_ROOT:-$SLURM_SUBMIT_DIR}/examples/slurm/lib.bash"' in text
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", "-x", "-s", "bash", str(script)], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("script", TRAINING, ids=lambda p: p.name)
def test_training_jobs_requeue_append_and_signal_early_enough(script):
    text = script.read_text()
    assert "#SBATCH --requeue\n" in text and "#SBATCH --open-mode=append\n" in text
    assert 'check_signal_margin "$0"' in text and "run_training " in text
    (seconds,) = re.findall(r"^#SBATCH --signal=TERM@(\d+)$", text, re.M)
    assert int(seconds) >= 60 + 30  # the recipes' --exit-signal-grace-seconds plus lib.bash's default margin
    assert _check(script).returncode == 0


def _check(script: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SLURM_"))}
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{LIB}"; check_signal_margin "$1"; echo passed', "check", script],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("signal", "grace", "refused"),
    [
        ("TERM@90", "60", None),
        ("R:SIGTERM@100", "60", None),
        ("15@90", "60", None),
        ("TERM@45", "60", "--signal=TERM@45 sends SIGTERM 45s before the time limit, less than "),
        ("TERM@45", "15", None),
        ("TERM", "60", "sends SIGTERM 60s before"),  # Slurm's default of 60 s
        ("B:TERM@200", "60", "signals only the batch shell"),
        ("USR1@200", "60", "SIGTERM only"),
        ("TERM@x", "60", "cannot read --signal=TERM@x"),
    ],
)
def test_check_signal_margin(tmp_path, signal, grace, refused):
    script = tmp_path / "job.sbatch"
    script.write_text(f"#!/usr/bin/env bash\n#SBATCH --nodes=2\n#SBATCH --signal={signal}\n")
    out = _check(script, EXIT_SIGNAL_GRACE_SECONDS=grace)
    if refused is None:
        assert out.returncode == 0 and "passed" in out.stdout, out.stderr
    else:
        assert out.returncode == 2 and refused in out.stderr and "passed" not in out.stdout, out.stderr
        if "less than" in refused:
            assert f"--exit-signal-grace-seconds {grace}s plus a margin of 30s" in out.stderr


def test_sbatch_signal_overrides_the_scripts_line_and_no_signal_only_warns(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text("#!/usr/bin/env bash\n#SBATCH --signal=TERM@120\n")
    assert "TERM@30 sends SIGTERM 30s" in _check(script, SBATCH_SIGNAL="TERM@30").stderr
    script.write_text("#!/usr/bin/env bash\n#SBATCH --nodes=1\n")
    out = _check(script)
    assert out.returncode == 0 and "warning: no --signal=TERM@N" in out.stderr


#: srun's stand-in: leaves MARKERS clean-stop markers in the STOP_DIR given through --export, exits RC.
FAKE_SRUN = """#!/usr/bin/env bash
for a in "$@"; do
    if [[ "$a" == --export=* ]]; then stop_dir="${a##*STOP_DIR=}"; fi
done
for ((i = 0; i < MARKERS; i++)); do echo '{"stopped_on": "SIGTERM", "step": 4}' > "$stop_dir/node$i.json"; done
echo "srun $*" >> "$CALLS"
exit "$RC"
"""


@pytest.mark.parametrize(
    ("markers", "rc", "code", "requeued", "says"),
    [
        (0, 0, 0, False, "training finished"),
        (2, 0, 0, True, "every node stopped cleanly on the exit signal after saving step 4: requeueing"),
        (1, 0, 1, False, "exited 0 with clean-stop markers from 1 of 2 node(s): not requeued"),
        (0, 3, 3, False, "exited 3 with clean-stop markers from 0 of 2 node(s)"),
        (2, 1, 1, False, "exited 1 with clean-stop markers from 2 of 2 node(s)"),
    ],
)
def test_after_the_training_step_the_job_requeues_only_when_every_node_stopped_cleanly(
    tmp_path, markers, rc, code, requeued, says
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\necho "scontrol $*" >> "$CALLS"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    stop_dir = tmp_path / "stops"
    stop_dir.mkdir()
    (stop_dir / "node1.json").write_text("{}")  # stale, from the previous start: removed before the launch
    calls = tmp_path / "calls"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SLURM_"))},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "MARKERS": str(markers),
        "RC": str(rc),
        "STOP_DIR": str(stop_dir),
        "SLURM_JOB_ID": "42",
    }
    script = f'source "{LIB}"; MASTER_ADDR=node0; run_training 2 --het-group=0 -- recipe.sh --lr 1; echo returned'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == code and says in out.stderr, out.stderr
    assert ("returned" in out.stdout) is (code == 0 and not requeued)
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("srun --kill-on-bad-exit=1 --nodes 2 --ntasks 2 --ntasks-per-node 1 --het-group=0 ")
    assert lines[0].endswith(" run_training recipe.sh --lr 1 --exit-signal-grace-seconds 60")
    assert ("scontrol requeue 42" in lines) is requeued
