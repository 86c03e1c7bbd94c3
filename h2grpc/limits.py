"""Every bound the server holds a peer to, with its number and why, in one place.

A peer is hostile until proven otherwise: this server is the first code the bytes of the ext_proc port meet.
Each bound answers a peer that crosses it in a defined way (README.md, "Bounds", lists the answers and the
tests that drive each bound). The defaults suit Envoy, the port's only legitimate client.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Limits:
    # --- frames and header blocks --------------------------------------------------------------------
    max_frame: int = 16_384  # a frame's payload we accept: the protocol's default, and Envoy's frame size
    max_header_list_bytes: int = 65_536  # a header block, encoded and decoded (HPACK list size, RFC 7541 §4.1)
    max_header_frames: int = 64  # HEADERS + CONTINUATIONs of one block: 64 KiB is 4 full frames; Envoy sends 1-2
    header_table_size: int = 4_096  # the HPACK dynamic table a peer may use (our SETTINGS_HEADER_TABLE_SIZE)
    # empty DATA/HEADERS frames without END_STREAM in a row (CVE-2019-9518): each costs a
    # frame's parse and carries nothing; Envoy's own limit is 1, a well-behaved peer sends none
    max_consecutive_empty_frames: int = 16
    # --- streams -------------------------------------------------------------------------------------
    max_streams_per_connection: int = 1_024  # open at once (SETTINGS_MAX_CONCURRENT_STREAMS); more: REFUSED
    # rapid reset (CVE-2023-44487), Envoy's premature-reset rule: once a connection has opened this many
    # streams, more than half of them reset by the peer within `premature_reset_s` of opening gets GOAWAY
    premature_reset_min_streams: int = 500
    premature_reset_s: float = 1.0
    # --- flow control --------------------------------------------------------------------------------
    stream_window: int = 1 << 20  # per stream: a 16 MiB BUFFERED body needs ~32 refills, localhost round trips
    connection_window: int = 1 << 26
    max_output_buffer: int = 8 << 20  # bytes the peer has not read: past it the connection is aborted
    # --- time ----------------------------------------------------------------------------------------
    preface_timeout_s: float = 10.0  # a connection that has not sent the HTTP/2 preface by then is closed
    keepalive_time_s: float = 60.0  # a peer this long silent is sent a PING (grpcio's server waits 2 h)
    keepalive_timeout_s: float = 20.0  # and closed if nothing at all arrives this long after it (grpcio's)
    # --- the server ----------------------------------------------------------------------------------
    max_connections: int = 4_096  # Envoy opens one per worker thread: 50 gateway pods x 16 threads is 800

    def __post_init__(self) -> None:
        if not 65_535 <= self.connection_window < 1 << 31 or not 0 < self.stream_window < 1 << 31:
            raise ValueError("windows must lie in [65,535 (connection) or 1 (stream), 2^31-1]")
        if not 16_384 <= self.max_frame < 1 << 24:
            raise ValueError("max_frame must lie in [16,384, 2^24-1] (RFC 9113 §6.5.2)")

    @property
    def credit_step(self) -> int:
        """Stream window is given back in steps this big: no WINDOW_UPDATE per small message."""
        return self.stream_window // 4


DEFAULT = Limits()
