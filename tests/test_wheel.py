"""The package works from a wheel: presets, examples and calibrated profiles are package data."""

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from diffcost import predict

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.platform == "win32", reason="venv layout differs")
def test_wheel_predicts_from_any_directory(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    junk = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, src, symlinks=True, ignore=junk)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("diffcost-*.whl")
    env_dir = tmp_path / "venv"
    # The dependencies (jax, flax, ...) come from this interpreter's site-packages; diffcost
    # itself only from the wheel, which the venv's own site-packages puts first.
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DIFFCOST_CONFIGS")}
    where = subprocess.run(
        [str(python), "-c", "import diffcost; print(diffcost.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert str(env_dir) in where, f"diffcost imported from {where}, not from the wheel"
    out = subprocess.run(
        [str(env_dir / "bin" / "diffcost"), "predict", "gpt3-175b.yaml", "--json"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    # the shipped calibrated profiles were found: the same prediction as this checkout's
    assert "device profile device-a100.yaml" in result["profile"]
    here = predict(ROOT / "configs" / "examples" / "gpt3-175b.yaml")
    assert result["iteration_s"] == pytest.approx(float(here.iteration_s), rel=1e-6)
