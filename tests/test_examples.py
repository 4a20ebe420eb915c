"""The README's examples run as written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_fsdp2_example_runs_under_torchrun_and_is_the_readme_text(tmp_path):
    example = (ROOT / "examples" / "fsdp2_tp.py").read_text()
    assert example in (ROOT / "README.md").read_text()
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "4", "examples/fsdp2_tp.py", str(tmp_path / "run")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert sorted(p.name for p in (tmp_path / "run").glob("iter_*")) == ["iter_0000005", "iter_0000010"]
