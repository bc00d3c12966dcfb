"""Clients of a running quiverd: producers (Client, AsyncClient) and consumers (``subscribe``).

    from quiverd.client import Client, AsyncClient, subscribe
"""

from quiverd.client.consumer import ReceivedBundle, subscribe
from quiverd.client.core import IpcPayload
from quiverd.client.jobs import EndAck, JobResult
from quiverd.client.producer import AsyncClient, Client

__all__ = ["AsyncClient", "Client", "EndAck", "IpcPayload", "JobResult", "ReceivedBundle",
           "subscribe"]
