from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_REPLICATED: _ClassVar[Role]
    ROLE_COLUMN: _ClassVar[Role]
    ROLE_ROW: _ClassVar[Role]
    ROLE_VOCAB_PARALLEL: _ClassVar[Role]
    ROLE_QKV_COLUMN: _ClassVar[Role]
    ROLE_GATED_MLP_COLUMN: _ClassVar[Role]
    ROLE_EXPERT_COLUMN: _ClassVar[Role]
    ROLE_EXPERT_ROW: _ClassVar[Role]

class MemType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEM_TYPE_UNSPECIFIED: _ClassVar[MemType]
    MEM_TYPE_DRAM: _ClassVar[MemType]
    MEM_TYPE_VRAM: _ClassVar[MemType]

class VersionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_STATE_UNSPECIFIED: _ClassVar[VersionState]
    VERSION_STATE_PENDING: _ClassVar[VersionState]
    VERSION_STATE_READY: _ClassVar[VersionState]
    VERSION_STATE_DRAINING: _ClassVar[VersionState]
    VERSION_STATE_RETIRED: _ClassVar[VersionState]
    VERSION_STATE_EXPIRED: _ClassVar[VersionState]

class DeltaForm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_FORM_UNSPECIFIED: _ClassVar[DeltaForm]
    DELTA_FORM_WHOLE: _ClassVar[DeltaForm]
    DELTA_FORM_SPARSE: _ClassVar[DeltaForm]
    DELTA_FORM_BLOCKS: _ClassVar[DeltaForm]
ROLE_UNSPECIFIED: Role
ROLE_REPLICATED: Role
ROLE_COLUMN: Role
ROLE_ROW: Role
ROLE_VOCAB_PARALLEL: Role
ROLE_QKV_COLUMN: Role
ROLE_GATED_MLP_COLUMN: Role
ROLE_EXPERT_COLUMN: Role
ROLE_EXPERT_ROW: Role
MEM_TYPE_UNSPECIFIED: MemType
MEM_TYPE_DRAM: MemType
MEM_TYPE_VRAM: MemType
VERSION_STATE_UNSPECIFIED: VersionState
VERSION_STATE_PENDING: VersionState
VERSION_STATE_READY: VersionState
VERSION_STATE_DRAINING: VersionState
VERSION_STATE_RETIRED: VersionState
VERSION_STATE_EXPIRED: VersionState
DELTA_FORM_UNSPECIFIED: DeltaForm
DELTA_FORM_WHOLE: DeltaForm
DELTA_FORM_SPARSE: DeltaForm
DELTA_FORM_BLOCKS: DeltaForm

class MeshPosition(_message.Message):
    __slots__ = ("tp_rank", "tp_size", "pp_rank", "pp_size", "ep_rank", "ep_size", "etp_rank", "etp_size")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ETP_RANK_FIELD_NUMBER: _ClassVar[int]
    ETP_SIZE_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    ep_rank: int
    ep_size: int
    etp_rank: int
    etp_size: int
    def __init__(self, tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., ep_rank: _Optional[int] = ..., ep_size: _Optional[int] = ..., etp_rank: _Optional[int] = ..., etp_size: _Optional[int] = ...) -> None: ...

class TensorDescriptor(_message.Message):
    __slots__ = ("name", "dtype", "global_shape", "local_shape", "addr", "nbytes", "role", "shard_axis", "shard_offset", "mem_type", "device_id", "extras_json", "compile_target", "compile_metadata")
    class CompileMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_AXIS_FIELD_NUMBER: _ClassVar[int]
    SHARD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_JSON_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TARGET_FIELD_NUMBER: _ClassVar[int]
    COMPILE_METADATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    local_shape: _containers.RepeatedScalarFieldContainer[int]
    addr: int
    nbytes: int
    role: Role
    shard_axis: int
    shard_offset: int
    mem_type: MemType
    device_id: int
    extras_json: str
    compile_target: str
    compile_metadata: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., global_shape: _Optional[_Iterable[int]] = ..., local_shape: _Optional[_Iterable[int]] = ..., addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., shard_axis: _Optional[int] = ..., shard_offset: _Optional[int] = ..., mem_type: _Optional[_Union[MemType, str]] = ..., device_id: _Optional[int] = ..., extras_json: _Optional[str] = ..., compile_target: _Optional[str] = ..., compile_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CompileCompat(_message.Message):
    __slots__ = ("framework", "torch_version", "cuda_version", "triton_version", "gpu_arch", "compile_config_digest")
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRITON_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPU_ARCH_FIELD_NUMBER: _ClassVar[int]
    COMPILE_CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    framework: str
    torch_version: str
    cuda_version: str
    triton_version: str
    gpu_arch: str
    compile_config_digest: str
    def __init__(self, framework: _Optional[str] = ..., torch_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., triton_version: _Optional[str] = ..., gpu_arch: _Optional[str] = ..., compile_config_digest: _Optional[str] = ...) -> None: ...

class SourceInfo(_message.Message):
    __slots__ = ("source_id", "mesh", "agent_name", "agent_metadata", "tensors", "ready", "regions", "layout_digest", "tensors_omitted", "incarnation", "agent_metadata_digest", "agent_metadata_omitted", "cuda_ipc", "checksums", "mirrors", "lease_fence_s", "revision", "compat", "delta")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_OMITTED_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    MIRRORS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FENCE_S_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    mesh: MeshPosition
    agent_name: str
    agent_metadata: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDescriptor]
    ready: bool
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    layout_digest: str
    tensors_omitted: bool
    incarnation: str
    agent_metadata_digest: str
    agent_metadata_omitted: bool
    cuda_ipc: CudaIpcExport
    checksums: BlockChecksums
    mirrors: _containers.RepeatedCompositeFieldContainer[Mirror]
    lease_fence_s: float
    revision: str
    compat: CompileCompat
    delta: SourceDelta
    def __init__(self, source_id: _Optional[str] = ..., mesh: _Optional[_Union[MeshPosition, _Mapping]] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorDescriptor, _Mapping]]] = ..., ready: bool = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., layout_digest: _Optional[str] = ..., tensors_omitted: bool = ..., incarnation: _Optional[str] = ..., agent_metadata_digest: _Optional[str] = ..., agent_metadata_omitted: bool = ..., cuda_ipc: _Optional[_Union[CudaIpcExport, _Mapping]] = ..., checksums: _Optional[_Union[BlockChecksums, _Mapping]] = ..., mirrors: _Optional[_Iterable[_Union[Mirror, _Mapping]]] = ..., lease_fence_s: _Optional[float] = ..., revision: _Optional[str] = ..., compat: _Optional[_Union[CompileCompat, _Mapping]] = ..., delta: _Optional[_Union[SourceDelta, _Mapping]] = ...) -> None: ...

class TensorDelta(_message.Message):
    __slots__ = ("tensor", "form", "offset", "nbytes", "changed", "narrow")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    FORM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    NARROW_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    form: DeltaForm
    offset: int
    nbytes: int
    changed: int
    narrow: int
    def __init__(self, tensor: _Optional[int] = ..., form: _Optional[_Union[DeltaForm, str]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., changed: _Optional[int] = ..., narrow: _Optional[int] = ...) -> None: ...

class SourceDelta(_message.Message):
    __slots__ = ("base_version", "base_digest", "addr", "nbytes", "tensors", "record_sums")
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RECORD_SUMS_FIELD_NUMBER: _ClassVar[int]
    base_version: int
    base_digest: str
    addr: int
    nbytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDelta]
    record_sums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, base_version: _Optional[int] = ..., base_digest: _Optional[str] = ..., addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorDelta, _Mapping]]] = ..., record_sums: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockChecksums(_message.Message):
    __slots__ = ("block_bytes", "sums", "sums_le64")
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    SUMS_LE64_FIELD_NUMBER: _ClassVar[int]
    block_bytes: int
    sums: _containers.RepeatedScalarFieldContainer[int]
    sums_le64: bytes
    def __init__(self, block_bytes: _Optional[int] = ..., sums: _Optional[_Iterable[int]] = ..., sums_le64: _Optional[bytes] = ...) -> None: ...

class Mirror(_message.Message):
    __slots__ = ("source_id", "source_addr", "nbytes", "addr")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    source_addr: int
    nbytes: int
    addr: int
    def __init__(self, source_id: _Optional[str] = ..., source_addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., addr: _Optional[int] = ...) -> None: ...

class CudaIpcExport(_message.Message):
    __slots__ = ("boot_id", "host_name", "pid", "pid_namespace", "device_uuid", "regions")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    host_name: str
    pid: int
    pid_namespace: str
    device_uuid: bytes
    regions: _containers.RepeatedCompositeFieldContainer[IpcRegion]
    def __init__(self, boot_id: _Optional[str] = ..., host_name: _Optional[str] = ..., pid: _Optional[int] = ..., pid_namespace: _Optional[str] = ..., device_uuid: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[IpcRegion, _Mapping]]] = ...) -> None: ...

class IpcRegion(_message.Message):
    __slots__ = ("addr", "nbytes", "handle", "offset")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    addr: int
    nbytes: int
    handle: bytes
    offset: int
    def __init__(self, addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., handle: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("addr", "nbytes")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    addr: int
    nbytes: int
    def __init__(self, addr: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("model", "version", "state", "expected_sources", "sources", "sidecar_json", "sidecar_digest", "sidecar_omitted", "replicas", "readers")
    class ReadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_JSON_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_OMITTED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    state: VersionState
    expected_sources: int
    sources: _containers.RepeatedCompositeFieldContainer[SourceInfo]
    sidecar_json: str
    sidecar_digest: str
    sidecar_omitted: bool
    replicas: _containers.RepeatedCompositeFieldContainer[SourceInfo]
    readers: _containers.ScalarMap[str, int]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., state: _Optional[_Union[VersionState, str]] = ..., expected_sources: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SourceInfo, _Mapping]]] = ..., sidecar_json: _Optional[str] = ..., sidecar_digest: _Optional[str] = ..., sidecar_omitted: bool = ..., replicas: _Optional[_Iterable[_Union[SourceInfo, _Mapping]]] = ..., readers: _Optional[_Mapping[str, int]] = ...) -> None: ...

class VersionSummary(_message.Message):
    __slots__ = ("model", "version", "state", "expected_sources", "registered_sources", "ready_sources", "leases", "expected_readers", "completed_reads")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    READY_SOURCES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_READERS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_READS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    state: VersionState
    expected_sources: int
    registered_sources: int
    ready_sources: int
    leases: int
    expected_readers: int
    completed_reads: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., state: _Optional[_Union[VersionState, str]] = ..., expected_sources: _Optional[int] = ..., registered_sources: _Optional[int] = ..., ready_sources: _Optional[int] = ..., leases: _Optional[int] = ..., expected_readers: _Optional[int] = ..., completed_reads: _Optional[int] = ...) -> None: ...

class RegisterSourceRequest(_message.Message):
    __slots__ = ("model", "version", "expected_sources", "source", "sidecar_json", "ttl_s", "expected_readers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_JSON_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_READERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    expected_sources: int
    source: SourceInfo
    sidecar_json: str
    ttl_s: float
    expected_readers: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., expected_sources: _Optional[int] = ..., source: _Optional[_Union[SourceInfo, _Mapping]] = ..., sidecar_json: _Optional[str] = ..., ttl_s: _Optional[float] = ..., expected_readers: _Optional[int] = ...) -> None: ...

class RegisterSourceReply(_message.Message):
    __slots__ = ("state", "catalog_epoch")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    state: VersionState
    catalog_epoch: str
    def __init__(self, state: _Optional[_Union[VersionState, str]] = ..., catalog_epoch: _Optional[str] = ...) -> None: ...

class MarkReadyRequest(_message.Message):
    __slots__ = ("model", "version", "source_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    source_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., source_id: _Optional[str] = ...) -> None: ...

class MarkReadyReply(_message.Message):
    __slots__ = ("state", "catalog_epoch")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    state: VersionState
    catalog_epoch: str
    def __init__(self, state: _Optional[_Union[VersionState, str]] = ..., catalog_epoch: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("source_ids", "lease_ids", "source_incarnations", "watch_source_ids")
    class SourceIncarnationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SOURCE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    WATCH_SOURCE_IDS_FIELD_NUMBER: _ClassVar[int]
    source_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    source_incarnations: _containers.ScalarMap[str, str]
    watch_source_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, source_ids: _Optional[_Iterable[str]] = ..., lease_ids: _Optional[_Iterable[str]] = ..., source_incarnations: _Optional[_Mapping[str, str]] = ..., watch_source_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("gone_source_ids", "catalog_epoch")
    GONE_SOURCE_IDS_FIELD_NUMBER: _ClassVar[int]
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    gone_source_ids: _containers.RepeatedScalarFieldContainer[str]
    catalog_epoch: str
    def __init__(self, gone_source_ids: _Optional[_Iterable[str]] = ..., catalog_epoch: _Optional[str] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("model", "version", "min_version", "known_layout_digests", "known_sidecar_digest", "known_agent_metadata_digests")
    class KnownLayoutDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class KnownAgentMetadataDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LAYOUT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_SIDECAR_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KNOWN_AGENT_METADATA_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    min_version: int
    known_layout_digests: _containers.ScalarMap[str, str]
    known_sidecar_digest: str
    known_agent_metadata_digests: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., min_version: _Optional[int] = ..., known_layout_digests: _Optional[_Mapping[str, str]] = ..., known_sidecar_digest: _Optional[str] = ..., known_agent_metadata_digests: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetVersionReply(_message.Message):
    __slots__ = ("version_info", "catalog_epoch")
    VERSION_INFO_FIELD_NUMBER: _ClassVar[int]
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    version_info: VersionInfo
    catalog_epoch: str
    def __init__(self, version_info: _Optional[_Union[VersionInfo, _Mapping]] = ..., catalog_epoch: _Optional[str] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListVersionsReply(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionSummary]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionSummary, _Mapping]]] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("model", "version", "reader_id", "ttl_s", "lease_id", "sources", "max_readers_per_source")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    READER_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    MAX_READERS_PER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    reader_id: str
    ttl_s: float
    lease_id: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    max_readers_per_source: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., reader_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., lease_id: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., max_readers_per_source: _Optional[int] = ...) -> None: ...

class AcquireLeaseReply(_message.Message):
    __slots__ = ("lease_id", "catalog_epoch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    catalog_epoch: str
    def __init__(self, lease_id: _Optional[str] = ..., catalog_epoch: _Optional[str] = ...) -> None: ...

class LeaseVersionRequest(_message.Message):
    __slots__ = ("find", "reader_id", "ttl_s", "lease_id")
    FIND_FIELD_NUMBER: _ClassVar[int]
    READER_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    find: GetVersionRequest
    reader_id: str
    ttl_s: float
    lease_id: str
    def __init__(self, find: _Optional[_Union[GetVersionRequest, _Mapping]] = ..., reader_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., lease_id: _Optional[str] = ...) -> None: ...

class LeaseVersionReply(_message.Message):
    __slots__ = ("version_info", "lease_id", "express_port", "catalog_epoch")
    VERSION_INFO_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPRESS_PORT_FIELD_NUMBER: _ClassVar[int]
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    version_info: VersionInfo
    lease_id: str
    express_port: int
    catalog_epoch: str
    def __init__(self, version_info: _Optional[_Union[VersionInfo, _Mapping]] = ..., lease_id: _Optional[str] = ..., express_port: _Optional[int] = ..., catalog_epoch: _Optional[str] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "completed")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    completed: bool
    def __init__(self, lease_id: _Optional[str] = ..., completed: bool = ...) -> None: ...

class ReleaseLeaseReply(_message.Message):
    __slots__ = ("catalog_epoch",)
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    catalog_epoch: str
    def __init__(self, catalog_epoch: _Optional[str] = ...) -> None: ...

class RetireVersionRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class RetireVersionReply(_message.Message):
    __slots__ = ("state", "catalog_epoch")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    state: VersionState
    catalog_epoch: str
    def __init__(self, state: _Optional[_Union[VersionState, str]] = ..., catalog_epoch: _Optional[str] = ...) -> None: ...

class WaitDrainedRequest(_message.Message):
    __slots__ = ("model", "version", "timeout_s", "registered_epoch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    timeout_s: float
    registered_epoch: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., registered_epoch: _Optional[str] = ...) -> None: ...

class WaitDrainedReply(_message.Message):
    __slots__ = ("drained", "catalog_epoch")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    CATALOG_EPOCH_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    catalog_epoch: str
    def __init__(self, drained: bool = ..., catalog_epoch: _Optional[str] = ...) -> None: ...

class WaitReadRequest(_message.Message):
    __slots__ = ("model", "version", "timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    timeout_s: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitReadReply(_message.Message):
    __slots__ = ("done", "expected_readers", "completed_readers")
    DONE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_READERS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_READERS_FIELD_NUMBER: _ClassVar[int]
    done: bool
    expected_readers: int
    completed_readers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, done: bool = ..., expected_readers: _Optional[int] = ..., completed_readers: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterReplicaRequest(_message.Message):
    __slots__ = ("model", "version", "source", "ttl_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    source: SourceInfo
    ttl_s: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., source: _Optional[_Union[SourceInfo, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RegisterReplicaReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WithdrawReplicaRequest(_message.Message):
    __slots__ = ("model", "version", "source_id", "timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    source_id: str
    timeout_s: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., source_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WithdrawReplicaReply(_message.Message):
    __slots__ = ("drained",)
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    def __init__(self, drained: bool = ...) -> None: ...
