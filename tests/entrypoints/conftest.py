from __future__ import annotations

import pytest

from tests.entrypoints.server_utils import RunningServer, shared_server


@pytest.fixture(scope="session")
def server() -> RunningServer:
    return shared_server()
