"""A small gRPC server on HTTP/2 for asyncio: grpcio's servicers, a third of grpcio's cost a message.

Its own package, importing nothing from the application that uses it: codec (frames, HPACK), connection
(one connection's states and flow control), call (one RPC and its servicer context), server (listen, caps,
drain), limits (every bound, named). README.md says what it offers servicers and every bound it holds peers to.
"""

from h2grpc.limits import DEFAULT, Limits
from h2grpc.server import H2GrpcServer

__all__ = ["DEFAULT", "H2GrpcServer", "Limits"]
