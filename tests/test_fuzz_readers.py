"""Every reader against crafted input (issue 54, "tests that find the next ones").

Runs :mod:`tests.fuzz_readers` in a fresh process: mutants of real checkpoints of every
kind shardpoint reads (its ``dist`` and ``torch`` formats with stored-once references and
validation logits, safetensors shards and their index, Megatron-LM legacy and
``torch_dist``, DeepSpeed ZeRO), each read by ``load``, ``verify``, ``inspect``,
``convert`` and ``export``. ``SHARDPOINT_FUZZ_EXAMPLES`` sets how many mutants (default
about a minute's worth here); the draws are fixed (``derandomize``), so a finding
reproduces with the same number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("SHARDPOINT_FUZZ_EXAMPLES", "250"))


def test_every_reader_ends_in_success_or_a_checkpoint_error_reading_only_its_own_files(tmp_path):
    report = tmp_path / "fuzz.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.fuzz_readers", "--examples", str(EXAMPLES), "--report", str(report)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(report.read_text())
    findings = result["findings"]
    shown = "\n\n".join(
        f"{f['source']} / {f['reader']} / {f['mutant']}:\n" + "\n".join(f["problems"]) for f in findings[:8]
    )
    assert not findings, f"{len(findings)} readers misbehaved on crafted input; the first:\n{shown}"
    # the run exercised both answers: mutants readers must refuse, and mutants that change nothing they read
    assert result["outcomes"].get("refused", 0) > EXAMPLES // 10 and result["outcomes"].get("ok", 0) > 0
    # memory: no reader sized a buffer by what a crafted file claims (the address-space cap catches the
    # allocation itself; this bounds what was really touched)
    growth = result["peak_rss_end"] - result["peak_rss_pristine"]
    assert growth < (96 << 20) + 8 * result["largest_source_bytes"], growth
