"""trtllm_mock: a trtllm-serve double that behaves, and fails, like the real server.

In-process use (tests, benchmarks)::

    async with MockWorker(MockConfig(port=0, kv_events_endpoint="tcp://127.0.0.1:*")) as w:
        ...  # w.url, w.kv_events_endpoint, w.cache, w.engine
"""

from .config import MockConfig
from .server import MockWorker

__all__ = ["MockConfig", "MockWorker"]
