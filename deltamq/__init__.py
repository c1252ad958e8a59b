"""deltamq: Apache RocketMQ's consumption semantics on Delta Lake, as Spark batch jobs."""

from __future__ import annotations

from deltamq.broker import Broker
from deltamq.clock import FakeClock, SystemClock
from deltamq.config import BrokerConfig
from deltamq.errors import DeltaMQError
from deltamq.message import Message, StoredMessage

__version__ = "0.1.0"
__all__ = [
    "Broker",
    "BrokerConfig",
    "DeltaMQError",
    "FakeClock",
    "Message",
    "StoredMessage",
    "SystemClock",
    "__version__",
]
