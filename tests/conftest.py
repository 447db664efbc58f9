from __future__ import annotations

import os

os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tests.helpers import close_worlds  # noqa: E402

collect_ignore = ["elastic_job.py", "multinode_job.py"]  # scripts torchrun runs, not test modules


@pytest.fixture(scope="session", autouse=True)
def _close_worlds():
    yield
    close_worlds()
