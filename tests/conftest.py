import pytest

from tests.pool import GlooPool


@pytest.fixture(scope="session")
def pool():
    workers = GlooPool()
    yield workers
    workers.close()
