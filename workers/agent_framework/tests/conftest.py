import sys
from pathlib import Path

import pytest

from approvald_client.testing import WorkerHarness

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    work = tmp_path_factory.mktemp("agent_framework")
    data = work / "data"
    h = WorkerHarness(
        work,
        lambda port: [
            sys.executable,
            str(HERE / "worker.py"),
            "serve",
            "--data",
            str(data),
            "--port",
            str(port),
            "--approver",
            "user-1",
        ],
        name="agent-framework worker",
        cwd=HERE,
    )
    h.data = data
    with h:
        yield h


@pytest.fixture(scope="module")
def app(harness):
    """The application side, in this (another) process: same data folder. It
    has no effect secret: it never receives deliveries."""
    from refund_workflow import RefundWorkflowApp

    return RefundWorkflowApp(harness.data, harness.client, approver="user-1")
