"""The integration suite's shared server.

``default_server``: one server on DEFAULT_TEST_ARGS for the modules that only send it requests
(no flag of their own, no change to the server's state: no flush, abort, weight update, pause,
counter reading or kill). A server start costs about 17 CPU-seconds (docs/testing.md): sharing one
saves that for each module below. It lives until the session ends, idle between its users.

Users: test_dp_server (the dp=1 reference), test_openai_fields_e2e, test_responses,
test_server_concurrency, test_structured_output, test_vision_server (the text-only model)."""

from __future__ import annotations

import pytest

from tests.helpers.server import ServerProcess


@pytest.fixture(scope="session")
def default_server():
    with ServerProcess() as s:
        yield s
