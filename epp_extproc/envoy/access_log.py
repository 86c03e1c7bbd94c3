"""Envoy's gRPC access log (`envoy.service.accesslog.v3.AccessLogService`), as lean mode's usage channel.

In lean mode no response chunk crosses the picker's stream; a Lua filter keeps the answer's `usage` in the
stream's dynamic metadata and Envoy ships it, batched, with the response flags (client gone, upstream reset)
and the booking id the picker put in `envoy.lb`. Protobuf stops here: the picker gets plain values.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from epp_extproc.core.api import Picker
from epp_extproc.envoy.streams import LongLivedStreams
from epp_extproc.gaie import BOOKING_KEY, LB_NAMESPACE, USAGE_NAMESPACE

log = logging.getLogger(__name__)

MAX_USAGE_TAIL = 16_384  # what the Lua filter keeps; anything longer is not ours
_FLAGS = [f.name for f in accesslog_pb2.ResponseFlags.DESCRIPTOR.fields if f.type == f.TYPE_BOOL]


def _flags(common: accesslog_pb2.AccessLogCommon) -> list[str]:
    if not common.HasField("response_flags"):
        return []
    rf = common.response_flags
    return [name for name in _FLAGS if getattr(rf, name)]


def _string(common: accesslog_pb2.AccessLogCommon, namespace: str, key: str) -> str | None:
    ns = common.metadata.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return ns.fields[key].string_value or None


class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.streams = LongLivedStreams()  # Envoy keeps one open per connection: a drain ends them last

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],  # noqa: N802
                               context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        with self.streams.track():
            await self._read(request_iterator)
        return als_pb2.StreamAccessLogsResponse()

    async def _read(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage]) -> None:
        async for msg in request_iterator:
            if not msg.HasField("http_logs"):
                continue
            for entry in msg.http_logs.log_entry:
                common = entry.common_properties
                booking = _string(common, LB_NAMESPACE, BOOKING_KEY)
                if booking is None:  # a request the picker did not route (rejected, or another listener)
                    continue
                usage = _string(common, USAGE_NAMESPACE, "usage")
                tail = usage.encode()[:MAX_USAGE_TAIL] if usage else None
                try:
                    self.picker.access_logged(booking, tail, _flags(common))
                except Exception:
                    log.exception("access-log entry could not be applied")
