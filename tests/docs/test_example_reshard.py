import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reshard_demo_runs_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "reshard_demo.py"), "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("exact=True") == 5  # 4 TP=4 ranks + the single-process read
    assert (tmp_path / "ckpt" / "COMMITTED").is_file()
