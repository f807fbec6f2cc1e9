"""`phalanx train --launcher ray` refuses what it cannot run in one line and its own exit code, before
any Ray cluster is involved (no cluster needed)."""

import subprocess
import sys

import pytest

from tests.helpers import free_port, phalanx


@pytest.mark.parametrize(
    "extra, message, code",
    [
        (["--launcher", "ray", "--rdzv-endpoint", "127.0.0.1:29500"], "places the nodes itself", 2),
        (["--launcher", "ray", "--node-rank", "1"], "places the nodes itself", 2),
        (["--launcher", "slurm"], "--launcher must be local or ray", 2),
        (["--ray-address", "127.0.0.1:6379"], "--ray-address needs --launcher ray", 2),
        (["--launcher", "ray", "--nnodes", "3:2"], "--nnodes must be N or MIN:MAX", 2),
    ],
)
def test_bad_ray_launches_are_refused_in_one_line(tiny_args, extra, message, code):
    proc = phalanx("train", *tiny_args, *extra, check=False, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_an_unreachable_ray_cluster_exits_5(tiny_args):
    pytest.importorskip("ray", reason="needs the ray extra (pip install 'phalanx[ray]')")
    port = free_port()  # nothing listens there
    proc = phalanx(
        "train",
        *tiny_args,
        "--launcher",
        "ray",
        "--ray-address",
        f"127.0.0.1:{port}",
        "--nnodes",
        "2",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 5, proc.stderr
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr


def test_without_ray_installed_the_launcher_says_how_to_get_it(tiny_args):
    # The real command line, in a Python where `import ray` fails as it does without the extra.
    hide_ray = (
        "import sys; sys.modules['ray'] = None; from phalanx.cli import main; "
        "sys.argv = ['phalanx'] + sys.argv[1:]; main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", hide_ray, "train", *tiny_args, "--launcher", "ray", "--nnodes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'phalanx[ray]'" in proc.stderr and "Traceback" not in proc.stderr
