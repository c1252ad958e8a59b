"""deltamq: Apache RocketMQ's consumption semantics on Delta Lake, as Spark batch jobs.

Names are imported lazily, so that light modules (e.g. the listener worker processes)
can import ``deltamq.message`` without loading PySpark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Broker": "deltamq.broker",
    "BrokerConfig": "deltamq.config",
    "DeltaMQError": "deltamq.errors",
    "FakeClock": "deltamq.clock",
    "SystemClock": "deltamq.clock",
    "Message": "deltamq.message",
    "StoredMessage": "deltamq.message",
    "ConsumeStatus": "deltamq.consumer",
    "ConsumeContext": "deltamq.consumer",
    "ConsumeOrderlyStatus": "deltamq.consumer",
    "columnar": "deltamq.consumer",
    "TxState": "deltamq.constants",
    "TickResult": "deltamq.orchestration.tick",
    "GroupConfig": "deltamq.config",
    "register": "deltamq.broker",
}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from deltamq.broker import Broker, register  # noqa: F401
    from deltamq.clock import FakeClock, SystemClock  # noqa: F401
    from deltamq.config import BrokerConfig, GroupConfig  # noqa: F401
    from deltamq.constants import TxState  # noqa: F401
    from deltamq.consumer import ConsumeContext, ConsumeOrderlyStatus, ConsumeStatus, columnar  # noqa: F401
    from deltamq.errors import DeltaMQError  # noqa: F401
    from deltamq.message import Message, StoredMessage  # noqa: F401
    from deltamq.orchestration.tick import TickResult  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deltamq' has no attribute {name!r}")
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("pyspark", "pysail"):
            raise ImportError(
                f'deltamq.{name} needs PySpark and Sail: pip install "deltamq[broker]" (a service '
                "that only sends can use deltamq.lite.Producer)"
            ) from e
        raise
