import sys
from pathlib import Path

import pytest

from approvald_client.testing import WorkerHarness

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    work = tmp_path_factory.mktemp("langgraph")
    data = work / "data"
    h = WorkerHarness(
        work,
        lambda port: [sys.executable, str(HERE / "refund_graph.py"), "serve", "--data", str(data), "--port", str(port)],
        name="langgraph worker",
    )
    h.data = data
    with h:
        yield h


@pytest.fixture(scope="module")
def app(harness):
    """The application side, in this (another) process: same data folder."""
    from refund_graph import RefundApp

    return RefundApp(harness.data, harness.client)
