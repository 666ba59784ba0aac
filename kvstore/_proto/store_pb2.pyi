from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Scope(_message.Message):
    __slots__ = ("model", "layout")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout: str
    def __init__(self, model: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ValueMeta(_message.Message):
    __slots__ = ("dtype", "shape", "kind", "nbytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    kind: int
    nbytes: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., kind: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_value_bytes", "max_batch", "max_message_bytes")
    MAX_VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_value_bytes: int
    max_batch: int
    max_message_bytes: int
    def __init__(self, max_value_bytes: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "node_id", "tenant", "admin", "host_id", "hostname", "data_port", "shm_name", "shm_size", "lease_ttl_ms", "limits", "tiers", "instance_id", "draining", "unix_socket", "shm_index", "pid", "scope_key", "put_sums_follow", "ucx", "ucx_address", "ucx_tag", "put_layers", "put_credits", "ucx_wire", "group", "shard", "shard_count", "shards")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SHM_INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_KEY_FIELD_NUMBER: _ClassVar[int]
    PUT_SUMS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    UCX_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_TAG_FIELD_NUMBER: _ClassVar[int]
    PUT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PUT_CREDITS_FIELD_NUMBER: _ClassVar[int]
    UCX_WIRE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    version: str
    node_id: str
    tenant: str
    admin: bool
    host_id: str
    hostname: str
    data_port: int
    shm_name: str
    shm_size: int
    lease_ttl_ms: int
    limits: Limits
    tiers: _containers.RepeatedScalarFieldContainer[str]
    instance_id: str
    draining: bool
    unix_socket: str
    shm_index: str
    pid: int
    scope_key: bytes
    put_sums_follow: bool
    ucx: bool
    ucx_address: bytes
    ucx_tag: int
    put_layers: bool
    put_credits: bool
    ucx_wire: int
    group: str
    shard: int
    shard_count: int
    shards: _containers.RepeatedCompositeFieldContainer[Shard]
    def __init__(self, version: _Optional[str] = ..., node_id: _Optional[str] = ..., tenant: _Optional[str] = ..., admin: _Optional[bool] = ..., host_id: _Optional[str] = ..., hostname: _Optional[str] = ..., data_port: _Optional[int] = ..., shm_name: _Optional[str] = ..., shm_size: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., tiers: _Optional[_Iterable[str]] = ..., instance_id: _Optional[str] = ..., draining: _Optional[bool] = ..., unix_socket: _Optional[str] = ..., shm_index: _Optional[str] = ..., pid: _Optional[int] = ..., scope_key: _Optional[bytes] = ..., put_sums_follow: _Optional[bool] = ..., ucx: _Optional[bool] = ..., ucx_address: _Optional[bytes] = ..., ucx_tag: _Optional[int] = ..., put_layers: _Optional[bool] = ..., put_credits: _Optional[bool] = ..., ucx_wire: _Optional[int] = ..., group: _Optional[str] = ..., shard: _Optional[int] = ..., shard_count: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("index", "address", "node_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    node_id: str
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "version", "instance_id")
    class ServingStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[HealthResponse.ServingStatus]
        SERVING: _ClassVar[HealthResponse.ServingStatus]
        DRAINING: _ClassVar[HealthResponse.ServingStatus]
    UNKNOWN: HealthResponse.ServingStatus
    SERVING: HealthResponse.ServingStatus
    DRAINING: HealthResponse.ServingStatus
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.ServingStatus
    version: str
    instance_id: str
    def __init__(self, status: _Optional[_Union[HealthResponse.ServingStatus, str]] = ..., version: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("matched",)
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    matched: int
    def __init__(self, matched: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tier: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("scope", "keys", "layer_from", "layer_to")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FROM_FIELD_NUMBER: _ClassVar[int]
    LAYER_TO_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    layer_from: int
    layer_to: int
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., layer_from: _Optional[int] = ..., layer_to: _Optional[int] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("found", "header", "payload", "lease_id", "offset", "error", "tenant", "model", "range_checksum")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RANGE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    found: bool
    header: bytes
    payload: bytes
    lease_id: int
    offset: int
    error: Status
    tenant: str
    model: str
    range_checksum: int
    def __init__(self, found: _Optional[bool] = ..., header: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., offset: _Optional[int] = ..., error: _Optional[_Union[Status, _Mapping]] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ..., range_checksum: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("blocks", "shm_name", "lease_expires_ns", "server_now_ns", "namespace_fp")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_NS_FIELD_NUMBER: _ClassVar[int]
    SERVER_NOW_NS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FP_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    shm_name: str
    lease_expires_ns: int
    server_now_ns: int
    namespace_fp: bytes
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., shm_name: _Optional[str] = ..., lease_expires_ns: _Optional[int] = ..., server_now_ns: _Optional[int] = ..., namespace_fp: _Optional[bytes] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("keys", "payload_bytes", "call_seconds")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    payload_bytes: int
    call_seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., payload_bytes: _Optional[int] = ..., call_seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("key", "meta", "checksum", "payload", "namespace_fp", "tenant", "model")
    KEY_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FP_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    meta: ValueMeta
    checksum: int
    payload: bytes
    namespace_fp: bytes
    tenant: str
    model: str
    def __init__(self, key: _Optional[bytes] = ..., meta: _Optional[_Union[ValueMeta, _Mapping]] = ..., checksum: _Optional[int] = ..., payload: _Optional[bytes] = ..., namespace_fp: _Optional[bytes] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("scope", "items", "sums_follow", "layers", "credits")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SUMS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    items: _containers.RepeatedCompositeFieldContainer[PutItem]
    sums_follow: bool
    layers: int
    credits: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., items: _Optional[_Iterable[_Union[PutItem, _Mapping]]] = ..., sums_follow: _Optional[bool] = ..., layers: _Optional[int] = ..., credits: _Optional[_Iterable[int]] = ...) -> None: ...

class PutResult(_message.Message):
    __slots__ = ("stored", "error", "lease_id", "offset")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    error: Status
    lease_id: int
    offset: int
    def __init__(self, stored: _Optional[bool] = ..., error: _Optional[_Union[Status, _Mapping]] = ..., lease_id: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results", "shm_name", "lease_expires_ns", "credits", "credits_expire_ns")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_NS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_EXPIRE_NS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    shm_name: str
    lease_expires_ns: int
    credits: _containers.RepeatedCompositeFieldContainer[PutResult]
    credits_expire_ns: int
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ..., shm_name: _Optional[str] = ..., lease_expires_ns: _Optional[int] = ..., credits: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ..., credits_expire_ns: _Optional[int] = ...) -> None: ...

class CommitItem(_message.Message):
    __slots__ = ("lease_id", "checksum", "key", "meta")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    checksum: int
    key: bytes
    meta: ValueMeta
    def __init__(self, lease_id: _Optional[int] = ..., checksum: _Optional[int] = ..., key: _Optional[bytes] = ..., meta: _Optional[_Union[ValueMeta, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("items", "scope", "credits")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CommitItem]
    scope: Scope
    credits: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, items: _Optional[_Iterable[_Union[CommitItem, _Mapping]]] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ..., credits: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("released", "expired")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    released: int
    expired: int
    def __init__(self, released: _Optional[int] = ..., expired: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity", "used", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    capacity: int
    used: int
    blocks: int
    def __init__(self, tier: _Optional[str] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "blocks", "pinned", "events_dropped", "tiers", "counters", "server")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ServerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks: int
    pinned: int
    events_dropped: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    counters: _containers.ScalarMap[str, int]
    server: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., blocks: _Optional[int] = ..., pinned: _Optional[int] = ..., events_dropped: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., server: _Optional[_Mapping[str, int]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("tier", "target_bytes", "tenant", "model", "key_prefix", "idle_s", "dry_run", "list_limit")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    LIST_LIMIT_FIELD_NUMBER: _ClassVar[int]
    tier: str
    target_bytes: int
    tenant: str
    model: str
    key_prefix: bytes
    idle_s: float
    dry_run: bool
    list_limit: int
    def __init__(self, tier: _Optional[str] = ..., target_bytes: _Optional[int] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ..., key_prefix: _Optional[bytes] = ..., idle_s: _Optional[float] = ..., dry_run: _Optional[bool] = ..., list_limit: _Optional[int] = ...) -> None: ...

class StoredBlock(_message.Message):
    __slots__ = ("key", "tier", "size", "tenant", "model")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    tier: str
    size: int
    tenant: str
    model: str
    def __init__(self, key: _Optional[bytes] = ..., tier: _Optional[str] = ..., size: _Optional[int] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("moved", "skipped_pinned", "bytes", "demoted", "dropped", "used_before", "used_after", "capacity", "dry_run", "next_tier", "blocks")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PINNED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    USED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    USED_AFTER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    moved: int
    skipped_pinned: int
    bytes: int
    demoted: int
    dropped: int
    used_before: int
    used_after: int
    capacity: int
    dry_run: bool
    next_tier: str
    blocks: _containers.RepeatedCompositeFieldContainer[StoredBlock]
    def __init__(self, moved: _Optional[int] = ..., skipped_pinned: _Optional[int] = ..., bytes: _Optional[int] = ..., demoted: _Optional[int] = ..., dropped: _Optional[int] = ..., used_before: _Optional[int] = ..., used_after: _Optional[int] = ..., capacity: _Optional[int] = ..., dry_run: _Optional[bool] = ..., next_tier: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[StoredBlock, _Mapping]]] = ...) -> None: ...

class ScanRequest(_message.Message):
    __slots__ = ("limit", "tier", "tenant", "model", "key_prefix")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    limit: int
    tier: str
    tenant: str
    model: str
    key_prefix: bytes
    def __init__(self, limit: _Optional[int] = ..., tier: _Optional[str] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ..., key_prefix: _Optional[bytes] = ...) -> None: ...

class ScanResponse(_message.Message):
    __slots__ = ("blocks", "more")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[StoredBlock]
    more: bool
    def __init__(self, blocks: _Optional[_Iterable[_Union[StoredBlock, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("token", "protocol", "pid", "host_id", "ucx_address", "ucx_wire")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_WIRE_FIELD_NUMBER: _ClassVar[int]
    token: str
    protocol: int
    pid: int
    host_id: str
    ucx_address: bytes
    ucx_wire: int
    def __init__(self, token: _Optional[str] = ..., protocol: _Optional[int] = ..., pid: _Optional[int] = ..., host_id: _Optional[str] = ..., ucx_address: _Optional[bytes] = ..., ucx_wire: _Optional[int] = ...) -> None: ...
