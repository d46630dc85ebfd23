"""The built wheel is the whole tool: installed without -e, it composes and runs a point from any
directory (its Hydra config ships inside the package)."""

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_the_wheel_installed_elsewhere_runs_a_point(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("harness-*.whl")
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # torch and the other dependencies from this environment (a path entry, so its editable harness
    # is not seen); harness itself only from the wheel.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(py), "-c", "import harness; print(harness.__file__)"], cwd=elsewhere,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(str(site)), where
    r = subprocess.run([str(py), "-m", "harness", "run", "model=tiny", "backend=sim", "seq_len=32",
                        "results_dir=out"], cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = (elsewhere / "out").glob("runs/*/result.json")
    assert '"status": "ok"' in row.read_text()
