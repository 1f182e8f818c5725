"""A full ``--log-dir`` at the metric sinks' writes: the error names the file, the step and ENOSPC in one
line (not a traceback naming no path or step), TensorBoard's writer thread prints no traceback of its own,
and closing the writer afterwards raises nothing more. A real full filesystem: a small tmpfs (root only)."""

import subprocess

import pytest

from megatron_pacs.utils.log_writes import LogWriteError
from megatron_pacs.utils.sinks import MetricsWriter


@pytest.fixture
def small_disk(tmp_path):
    """A 16 KiB tmpfs, unmounted after the test; skipped where this process may not mount."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_log_dir_stops_the_sinks_with_one_line_naming_path_step_and_enospc(small_disk, capfd):
    writer = MetricsWriter(small_disk / "run", config={"run": {"seed": 1}})
    metrics = {f"train/metric_{i:03d}": float(i) for i in range(100)}  # ~2.5 kB a line, more in TensorBoard
    step = 0
    with pytest.raises(LogWriteError) as failed:
        for step in range(1, 100):
            writer.log(step, metrics)
    error = failed.value
    assert error.step == step > 1 and error.path.parent.parent == small_disk
    assert str(error) == f"--log-dir: writing {error.path} at step {step} failed: ENOSPC (No space left on device)"
    writer.close()  # what it cannot write any more is dropped: no second error
    assert "Traceback" not in capfd.readouterr().err
