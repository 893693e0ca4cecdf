import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniwalk.tensor_parallel_ranks import free_port


@pytest.fixture
def run_rank_script():
    """Runs `script RANK 2 PORT` as two processes joined in one gloo group; fails the test
    with their stderr unless both exit 0 within `timeout` seconds."""
    def run(script: Path, timeout: float) -> None:
        port, env = free_port(), {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        ranks = [subprocess.Popen([sys.executable, str(script), str(rank), "2", str(port)], env=env,
                                  stderr=subprocess.PIPE, text=True) for rank in range(2)]
        try:
            errors = [rank.communicate(timeout=timeout)[1] for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
        assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(errors)
    return run
