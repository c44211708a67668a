import sys
from pathlib import Path

import pytest

from approvald_client.testing import WorkerHarness

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    work = tmp_path_factory.mktemp("openai_agents")
    data = work / "data"
    h = WorkerHarness(
        work,
        lambda port: [
            sys.executable,
            str(HERE / "refund_agent.py"),
            "serve",
            "--data",
            str(data),
            "--port",
            str(port),
            "--approver",
            "user-1",
        ],
        name="openai-agents worker",
    )
    h.data = data
    with h:
        yield h


@pytest.fixture(scope="module")
def app(harness):
    """The application side, in this (another) process: same data folder."""
    from refund_agent import RefundAgentApp

    return RefundAgentApp(harness.data, harness.client, approver="user-1")
