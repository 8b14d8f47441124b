from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceState(_message.Message):
    __slots__ = ("battery_percent", "charging", "temperature_c", "unmetered_network", "idle", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
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
    def __init__(self, battery_percent: _Optional[float] = ..., charging: _Optional[bool] = ..., temperature_c: _Optional[float] = ..., unmetered_network: _Optional[bool] = ..., idle: _Optional[bool] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node_id", "role", "device", "capabilities", "device_public_key", "key_proof")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_PROOF_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    device: DeviceState
    capabilities: _containers.ScalarMap[str, str]
    device_public_key: bytes
    key_proof: bytes
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., device: _Optional[_Union[DeviceState, _Mapping]] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., device_public_key: _Optional[bytes] = ..., key_proof: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("node_id", "heartbeat_s", "long_poll_s", "max_chunk_bytes", "server_id", "credential", "certificate", "root_public_key")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    LONG_POLL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    ROOT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_s: float
    long_poll_s: float
    max_chunk_bytes: int
    server_id: str
    credential: str
    certificate: bytes
    root_public_key: bytes
    def __init__(self, node_id: _Optional[str] = ..., heartbeat_s: _Optional[float] = ..., long_poll_s: _Optional[float] = ..., max_chunk_bytes: _Optional[int] = ..., server_id: _Optional[str] = ..., credential: _Optional[str] = ..., certificate: _Optional[bytes] = ..., root_public_key: _Optional[bytes] = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("node_id", "device", "pool_size", "pool_eligible", "wait_s", "dropped")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    device: DeviceState
    pool_size: int
    pool_eligible: int
    wait_s: float
    dropped: _containers.RepeatedCompositeFieldContainer[DroppedUpload]
    def __init__(self, node_id: _Optional[str] = ..., device: _Optional[_Union[DeviceState, _Mapping]] = ..., pool_size: _Optional[int] = ..., pool_eligible: _Optional[int] = ..., wait_s: _Optional[float] = ..., dropped: _Optional[_Iterable[_Union[DroppedUpload, _Mapping]]] = ...) -> None: ...

class DroppedUpload(_message.Message):
    __slots__ = ("run_id", "round", "attempt", "node_id", "task_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    attempt: int
    node_id: str
    task_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., node_id: _Optional[str] = ..., task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

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
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., task_id: _Optional[str] = ..., model_hash: _Optional[str] = ..., model_bytes: _Optional[int] = ..., config_json: _Optional[str] = ..., schema: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., deadline_unix: _Optional[float] = ..., cohort_target: _Optional[int] = ..., shared_seed: _Optional[int] = ...) -> None: ...

class Idle(_message.Message):
    __slots__ = ("retry_after_s", "reason")
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    retry_after_s: float
    reason: str
    def __init__(self, retry_after_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class PollReply(_message.Message):
    __slots__ = ("task", "idle")
    TASK_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    task: TaskSpec
    idle: Idle
    def __init__(self, task: _Optional[_Union[TaskSpec, _Mapping]] = ..., idle: _Optional[_Union[Idle, _Mapping]] = ...) -> None: ...

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
    def __init__(self, node_id: _Optional[str] = ..., device: _Optional[_Union[DeviceState, _Mapping]] = ..., task_id: _Optional[str] = ..., progress: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("task_still_wanted",)
    TASK_STILL_WANTED_FIELD_NUMBER: _ClassVar[int]
    task_still_wanted: bool
    def __init__(self, task_still_wanted: _Optional[bool] = ...) -> None: ...

class PullModelRequest(_message.Message):
    __slots__ = ("node_id", "model_hash", "offset", "have_hash")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    HAVE_HASH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model_hash: str
    offset: int
    have_hash: str
    def __init__(self, node_id: _Optional[str] = ..., model_hash: _Optional[str] = ..., offset: _Optional[int] = ..., have_hash: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "offset", "total_bytes", "blob_sha256", "delta_from", "target_hash", "result_sha256", "encoding")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOB_SHA256_FIELD_NUMBER: _ClassVar[int]
    DELTA_FROM_FIELD_NUMBER: _ClassVar[int]
    TARGET_HASH_FIELD_NUMBER: _ClassVar[int]
    RESULT_SHA256_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    total_bytes: int
    blob_sha256: str
    delta_from: str
    target_hash: str
    result_sha256: str
    encoding: str
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., blob_sha256: _Optional[str] = ..., delta_from: _Optional[str] = ..., target_hash: _Optional[str] = ..., result_sha256: _Optional[str] = ..., encoding: _Optional[str] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("node_id", "run_id", "round", "attempt", "task_id", "kind", "schema", "payload_sizes", "codec", "payload_sha256", "weight", "count", "num_examples", "num_steps", "metric_sums", "metric_weights", "bytes_up", "bytes_down", "tier_participants", "staleness", "dropped")
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
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TierParticipantsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StalenessEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
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
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
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
    staleness: _containers.ScalarMap[int, int]
    dropped: int
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., task_id: _Optional[str] = ..., kind: _Optional[_Union[UploadHeader.Kind, str]] = ..., schema: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., payload_sizes: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., payload_sha256: _Optional[str] = ..., weight: _Optional[float] = ..., count: _Optional[int] = ..., num_examples: _Optional[int] = ..., num_steps: _Optional[int] = ..., metric_sums: _Optional[_Mapping[str, float]] = ..., metric_weights: _Optional[_Mapping[str, float]] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., tier_participants: _Optional[_Mapping[str, int]] = ..., staleness: _Optional[_Mapping[int, int]] = ..., dropped: _Optional[int] = ...) -> None: ...

class UploadPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SecAggRequest(_message.Message):
    __slots__ = ("node_id", "run_id", "round", "attempt", "task_id", "stage", "message", "wait_s", "header", "client_id", "roster", "bytes_down")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROSTER_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    round: int
    attempt: int
    task_id: str
    stage: int
    message: bytes
    wait_s: float
    header: UploadHeader
    client_id: str
    roster: SecAggRoster
    bytes_down: int
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., task_id: _Optional[str] = ..., stage: _Optional[int] = ..., message: _Optional[bytes] = ..., wait_s: _Optional[float] = ..., header: _Optional[_Union[UploadHeader, _Mapping]] = ..., client_id: _Optional[str] = ..., roster: _Optional[_Union[SecAggRoster, _Mapping]] = ..., bytes_down: _Optional[int] = ...) -> None: ...

class SecAggRoster(_message.Message):
    __slots__ = ("nodes", "tiers")
    NODES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggReply(_message.Message):
    __slots__ = ("stage", "broadcast", "done", "aborted", "roster_credential")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    ROSTER_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    stage: int
    broadcast: bytes
    done: bool
    aborted: str
    roster_credential: bytes
    def __init__(self, stage: _Optional[int] = ..., broadcast: _Optional[bytes] = ..., done: _Optional[bool] = ..., aborted: _Optional[str] = ..., roster_credential: _Optional[bytes] = ...) -> None: ...

class VerifyTokenRequest(_message.Message):
    __slots__ = ("token", "role", "node_id", "enroll", "device_public_key", "key_proof")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENROLL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_PROOF_FIELD_NUMBER: _ClassVar[int]
    token: str
    role: str
    node_id: str
    enroll: bool
    device_public_key: bytes
    key_proof: bytes
    def __init__(self, token: _Optional[str] = ..., role: _Optional[str] = ..., node_id: _Optional[str] = ..., enroll: _Optional[bool] = ..., device_public_key: _Optional[bytes] = ..., key_proof: _Optional[bytes] = ...) -> None: ...

class VerifyTokenReply(_message.Message):
    __slots__ = ("valid", "reason", "node_id", "credential", "certificate", "root_public_key", "roster_credential")
    VALID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    ROOT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ROSTER_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    reason: str
    node_id: str
    credential: str
    certificate: bytes
    root_public_key: bytes
    roster_credential: bytes
    def __init__(self, valid: _Optional[bool] = ..., reason: _Optional[str] = ..., node_id: _Optional[str] = ..., credential: _Optional[str] = ..., certificate: _Optional[bytes] = ..., root_public_key: _Optional[bytes] = ..., roster_credential: _Optional[bytes] = ...) -> None: ...

class StartRunHeader(_message.Message):
    __slots__ = ("config_json", "model_bytes", "model_sha256")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    model_bytes: int
    model_sha256: str
    def __init__(self, config_json: _Optional[str] = ..., model_bytes: _Optional[int] = ..., model_sha256: _Optional[str] = ...) -> None: ...

class StartRunPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StartRunHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[StartRunHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StartRunReply(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: str
    def __init__(self, status_json: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes_json",)
    NODES_JSON_FIELD_NUMBER: _ClassVar[int]
    nodes_json: str
    def __init__(self, nodes_json: _Optional[str] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StopRunReply(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: bool
    def __init__(self, stopped: _Optional[bool] = ...) -> None: ...

class PullGlobalRequest(_message.Message):
    __slots__ = ("run_id", "round")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListRunsReply(_message.Message):
    __slots__ = ("runs_json",)
    RUNS_JSON_FIELD_NUMBER: _ClassVar[int]
    runs_json: str
    def __init__(self, runs_json: _Optional[str] = ...) -> None: ...

class RunLogRequest(_message.Message):
    __slots__ = ("run_id", "after", "max_lines")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_LINES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after: int
    max_lines: int
    def __init__(self, run_id: _Optional[str] = ..., after: _Optional[int] = ..., max_lines: _Optional[int] = ...) -> None: ...

class RunLogReply(_message.Message):
    __slots__ = ("lines", "next", "run_status")
    LINES_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    RUN_STATUS_FIELD_NUMBER: _ClassVar[int]
    lines: _containers.RepeatedScalarFieldContainer[str]
    next: int
    run_status: str
    def __init__(self, lines: _Optional[_Iterable[str]] = ..., next: _Optional[int] = ..., run_status: _Optional[str] = ...) -> None: ...
