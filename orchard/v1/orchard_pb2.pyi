from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceState(_message.Message):
    __slots__ = ("battery_percent", "charging", "temperature_c", "unmetered_network", "idle", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: str | None = ..., value: float | None = ...) -> None: ...
    BATTERY_PERCENT_FIELD_NUMBER: _ClassVar[int]
    CHARGING_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    UNMETERED_NETWORK_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    battery_percent: float
    charging: bool
    temperature_c: float
    unmetered_network: bool
    idle: bool
    extra: _containers.ScalarMap[str, float]
    def __init__(self, battery_percent: float | None = ..., charging: bool | None = ..., temperature_c: float | None = ..., unmetered_network: bool | None = ..., idle: bool | None = ..., extra: _Mapping[str, float] | None = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: str | None = ..., shape: _Iterable[int] | None = ..., dtype: str | None = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node_id", "role", "device", "capabilities")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    device: DeviceState
    capabilities: _containers.ScalarMap[str, str]
    def __init__(self, node_id: str | None = ..., role: str | None = ..., device: DeviceState | _Mapping | None = ..., capabilities: _Mapping[str, str] | None = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("node_id", "heartbeat_s", "long_poll_s", "max_chunk_bytes", "server_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    LONG_POLL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_s: float
    long_poll_s: float
    max_chunk_bytes: int
    server_id: str
    def __init__(self, node_id: str | None = ..., heartbeat_s: float | None = ..., long_poll_s: float | None = ..., max_chunk_bytes: int | None = ..., server_id: str | None = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("node_id", "device", "pool_size", "pool_eligible", "wait_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    device: DeviceState
    pool_size: int
    pool_eligible: int
    wait_s: float
    def __init__(self, node_id: str | None = ..., device: DeviceState | _Mapping | None = ..., pool_size: int | None = ..., pool_eligible: int | None = ..., wait_s: float | None = ...) -> None: ...

class TaskSpec(_message.Message):
    __slots__ = ("run_id", "round", "attempt", "task_id", "model_hash", "model_bytes", "config_json", "schema", "deadline_unix", "cohort_target", "shared_seed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    COHORT_TARGET_FIELD_NUMBER: _ClassVar[int]
    SHARED_SEED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    attempt: int
    task_id: str
    model_hash: str
    model_bytes: int
    config_json: str
    schema: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    deadline_unix: float
    cohort_target: int
    shared_seed: int
    def __init__(self, run_id: str | None = ..., round: int | None = ..., attempt: int | None = ..., task_id: str | None = ..., model_hash: str | None = ..., model_bytes: int | None = ..., config_json: str | None = ..., schema: _Iterable[TensorSpec | _Mapping] | None = ..., deadline_unix: float | None = ..., cohort_target: int | None = ..., shared_seed: int | None = ...) -> None: ...

class Idle(_message.Message):
    __slots__ = ("retry_after_s", "reason")
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    retry_after_s: float
    reason: str
    def __init__(self, retry_after_s: float | None = ..., reason: str | None = ...) -> None: ...

class PollReply(_message.Message):
    __slots__ = ("task", "idle")
    TASK_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    task: TaskSpec
    idle: Idle
    def __init__(self, task: TaskSpec | _Mapping | None = ..., idle: Idle | _Mapping | None = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "device", "task_id", "progress")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    device: DeviceState
    task_id: str
    progress: float
    def __init__(self, node_id: str | None = ..., device: DeviceState | _Mapping | None = ..., task_id: str | None = ..., progress: float | None = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("task_still_wanted",)
    TASK_STILL_WANTED_FIELD_NUMBER: _ClassVar[int]
    task_still_wanted: bool
    def __init__(self, task_still_wanted: bool | None = ...) -> None: ...

class PullModelRequest(_message.Message):
    __slots__ = ("node_id", "model_hash", "offset")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model_hash: str
    offset: int
    def __init__(self, node_id: str | None = ..., model_hash: str | None = ..., offset: int | None = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "offset", "total_bytes", "blob_sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOB_SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    total_bytes: int
    blob_sha256: str
    def __init__(self, data: bytes | None = ..., offset: int | None = ..., total_bytes: int | None = ..., blob_sha256: str | None = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("node_id", "run_id", "round", "attempt", "task_id", "kind", "schema", "payload_sizes", "codec", "payload_sha256", "weight", "count", "num_examples", "num_steps", "metric_sums", "metric_weights", "bytes_up", "bytes_down", "tier_participants")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CLIENT_UPDATE: _ClassVar[UploadHeader.Kind]
        PARTIAL_SUM: _ClassVar[UploadHeader.Kind]
    CLIENT_UPDATE: UploadHeader.Kind
    PARTIAL_SUM: UploadHeader.Kind
    class MetricSumsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: str | None = ..., value: float | None = ...) -> None: ...
    class MetricWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: str | None = ..., value: float | None = ...) -> None: ...
    class TierParticipantsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: str | None = ..., value: int | None = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    METRIC_SUMS_FIELD_NUMBER: _ClassVar[int]
    METRIC_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    TIER_PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    round: int
    attempt: int
    task_id: str
    kind: UploadHeader.Kind
    schema: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    payload_sizes: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    payload_sha256: str
    weight: float
    count: int
    num_examples: int
    num_steps: int
    metric_sums: _containers.ScalarMap[str, float]
    metric_weights: _containers.ScalarMap[str, float]
    bytes_up: int
    bytes_down: int
    tier_participants: _containers.ScalarMap[str, int]
    def __init__(self, node_id: str | None = ..., run_id: str | None = ..., round: int | None = ..., attempt: int | None = ..., task_id: str | None = ..., kind: UploadHeader.Kind | str | None = ..., schema: _Iterable[TensorSpec | _Mapping] | None = ..., payload_sizes: _Iterable[int] | None = ..., codec: str | None = ..., payload_sha256: str | None = ..., weight: float | None = ..., count: int | None = ..., num_examples: int | None = ..., num_steps: int | None = ..., metric_sums: _Mapping[str, float] | None = ..., metric_weights: _Mapping[str, float] | None = ..., bytes_up: int | None = ..., bytes_down: int | None = ..., tier_participants: _Mapping[str, int] | None = ...) -> None: ...

class UploadPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    data: bytes
    def __init__(self, header: UploadHeader | _Mapping | None = ..., data: bytes | None = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: bool | None = ..., reason: str | None = ...) -> None: ...

class VerifyTokenRequest(_message.Message):
    __slots__ = ("token", "role")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    token: str
    role: str
    def __init__(self, token: str | None = ..., role: str | None = ...) -> None: ...

class VerifyTokenReply(_message.Message):
    __slots__ = ("valid",)
    VALID_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    def __init__(self, valid: bool | None = ...) -> None: ...

class StartRunHeader(_message.Message):
    __slots__ = ("config_json", "model_bytes", "model_sha256")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    model_bytes: int
    model_sha256: str
    def __init__(self, config_json: str | None = ..., model_bytes: int | None = ..., model_sha256: str | None = ...) -> None: ...

class StartRunPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StartRunHeader
    data: bytes
    def __init__(self, header: StartRunHeader | _Mapping | None = ..., data: bytes | None = ...) -> None: ...

class StartRunReply(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: str | None = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: str | None = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: str
    def __init__(self, status_json: str | None = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes_json",)
    NODES_JSON_FIELD_NUMBER: _ClassVar[int]
    nodes_json: str
    def __init__(self, nodes_json: str | None = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: str | None = ...) -> None: ...

class StopRunReply(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: bool
    def __init__(self, stopped: bool | None = ...) -> None: ...

class PullGlobalRequest(_message.Message):
    __slots__ = ("run_id", "round")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    def __init__(self, run_id: str | None = ..., round: int | None = ...) -> None: ...
