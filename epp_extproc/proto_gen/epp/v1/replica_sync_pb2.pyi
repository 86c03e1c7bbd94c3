from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("replica_id", "incarnation")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    incarnation: int
    def __init__(self, replica_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Booking(_message.Message):
    __slots__ = ("id", "address", "prefill_blocks", "decode_blocks", "prefilling")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILLING_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    prefill_blocks: float
    decode_blocks: float
    prefilling: bool
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., prefill_blocks: _Optional[float] = ..., decode_blocks: _Optional[float] = ..., prefilling: _Optional[bool] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("bookings",)
    BOOKINGS_FIELD_NUMBER: _ClassVar[int]
    bookings: _containers.RepeatedCompositeFieldContainer[Booking]
    def __init__(self, bookings: _Optional[_Iterable[_Union[Booking, _Mapping]]] = ...) -> None: ...

class BookingDelta(_message.Message):
    __slots__ = ("kind", "id", "address", "prefill_blocks", "decode_blocks")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BookingDelta.Kind]
        BOOK: _ClassVar[BookingDelta.Kind]
        PREFILL_DONE: _ClassVar[BookingDelta.Kind]
        MOVE: _ClassVar[BookingDelta.Kind]
        FREE: _ClassVar[BookingDelta.Kind]
    KIND_UNSPECIFIED: BookingDelta.Kind
    BOOK: BookingDelta.Kind
    PREFILL_DONE: BookingDelta.Kind
    MOVE: BookingDelta.Kind
    FREE: BookingDelta.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kind: BookingDelta.Kind
    id: str
    address: str
    prefill_blocks: float
    decode_blocks: float
    def __init__(self, kind: _Optional[_Union[BookingDelta.Kind, str]] = ..., id: _Optional[str] = ..., address: _Optional[str] = ..., prefill_blocks: _Optional[float] = ..., decode_blocks: _Optional[float] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("address", "block_size", "hashes", "ttl_ms")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    address: str
    block_size: int
    hashes: _containers.RepeatedScalarFieldContainer[int]
    ttl_ms: int
    def __init__(self, address: _Optional[str] = ..., block_size: _Optional[int] = ..., hashes: _Optional[_Iterable[int]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("address", "waiting", "running", "kv_utilization", "max_running", "age_us", "next_ms")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    AGE_US_FIELD_NUMBER: _ClassVar[int]
    NEXT_MS_FIELD_NUMBER: _ClassVar[int]
    address: str
    waiting: float
    running: float
    kv_utilization: float
    max_running: float
    age_us: int
    next_ms: int
    def __init__(self, address: _Optional[str] = ..., waiting: _Optional[float] = ..., running: _Optional[float] = ..., kv_utilization: _Optional[float] = ..., max_running: _Optional[float] = ..., age_us: _Optional[int] = ..., next_ms: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("seq", "deltas", "predictions", "oldest_change_unix", "first_chunks", "loads")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_CHANGE_UNIX_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    deltas: _containers.RepeatedCompositeFieldContainer[BookingDelta]
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    oldest_change_unix: float
    first_chunks: _containers.RepeatedScalarFieldContainer[str]
    loads: _containers.RepeatedCompositeFieldContainer[WorkerLoad]
    def __init__(self, seq: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[BookingDelta, _Mapping]]] = ..., predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., oldest_change_unix: _Optional[float] = ..., first_chunks: _Optional[_Iterable[str]] = ..., loads: _Optional[_Iterable[_Union[WorkerLoad, _Mapping]]] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("hello", "snapshot", "batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    snapshot: Snapshot
    batch: Batch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("hello", "ack")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    ack: Ack
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...
