import sys
from pathlib import Path

import pytest

from approvald_client.testing import WorkerHarness

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    work = tmp_path_factory.mktemp("plain_http")
    db = work / "orders.db"
    h = WorkerHarness(
        work,
        lambda port: [sys.executable, str(HERE / "orders_service.py"), "serve", "--db", str(db), "--port", str(port)],
        name="orders service",
    )
    h.db_path = str(db)
    with h:
        yield h
