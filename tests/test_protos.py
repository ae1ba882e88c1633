"""The wire contracts: checked-in stubs are fresh, and the public API matches its fixed contract."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from protos.tandem.v1 import generation_pb2, generation_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
# The same proto list, in the same order, as `make protos`.
PROTO_FILES = ["protos/tandem/v1/generation.proto", "protos/tandem/internal/v1/prefill.proto"]
STUB_SUFFIXES = ["_pb2.py", "_pb2.pyi", "_pb2_grpc.py"]
# A method's registration in a `_pb2_grpc.py`: its streaming kind, path, request and response types.
_GRPC_METHOD = re.compile(
    r"channel\.(\w+)\(\s*'([^']+)',\s*request_serializer=\w+\.(\w+)\.SerializeToString,"
    r"\s*response_deserializer=\w+\.(\w+)\.FromString"
)


def _run_protoc(source_root: Path, out_dir: Path, *extra_args: str) -> None:
    """Run protoc exactly as `make protos` does, from source_root, writing under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "grpc_tools.protoc", "-I", "."]
    if not extra_args:
        command += [f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}"]
    subprocess.run([*command, *extra_args, *PROTO_FILES], cwd=source_root, check=True, capture_output=True)


def _stub_paths() -> list[str]:
    return [proto.removesuffix(".proto") + suffix for proto in PROTO_FILES for suffix in STUB_SUFFIXES]


def _descriptors(source_root: Path, out_dir: Path) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """What the protos under source_root define, by proto path, as protoc parses them."""
    descriptor_set = out_dir / "protos.binpb"
    _run_protoc(source_root, out_dir, f"--descriptor_set_out={descriptor_set}")
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file
    for file in files:
        _drop_json_names(file.message_type)
    return {file.name: file for file in files}


def _drop_json_names(messages) -> None:
    """protoc's descriptor sets spell out each field's JSON name; the Python stubs leave it implied."""
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def _checked_in_descriptor(proto: str) -> descriptor_pb2.FileDescriptorProto:
    """The descriptor a checked-in `_pb2.py` registers (what the running server speaks)."""
    module = importlib.import_module(proto.removesuffix(".proto").replace("/", ".") + "_pb2")
    return descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)


def _grpc_methods(stub_source: str) -> set[tuple[str, ...]]:
    return set(_GRPC_METHOD.findall(stub_source))


def _pyi_shape(pyi_source: str) -> dict[str, set[str]]:
    """Per class of a `.pyi` stub, the names it declares: fields, field numbers, constructor arguments."""
    shape: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(pyi_source)):
        if not isinstance(node, ast.ClassDef):
            continue
        names = shape.setdefault(node.name, set())
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
            elif isinstance(item, ast.FunctionDef) and item.name == "__init__":
                names.update(arg.arg for arg in item.args.args + item.args.kwonlyargs)
    return shape


def _stale_stubs(source_root: Path, out_dir: Path) -> list[str]:
    """Stub paths whose checked-in contents say something other than what the protos define.

    What is compared is meaning, never bytes: the descriptor each `_pb2.py` registers against protoc's
    parse of the protos, the methods each `_pb2_grpc.py` registers, the classes and fields of each
    `.pyi`. The bytes depend on the grpcio-tools version that wrote them (its version string, its
    formatting), which is not what the stubs promise."""
    fresh = out_dir / "fresh"
    _run_protoc(source_root, fresh)
    descriptors = _descriptors(source_root, out_dir)
    stale = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        if _checked_in_descriptor(proto) != descriptors[proto]:
            stale.append(stem + "_pb2.py")
        pyi, grpc_stub = stem + "_pb2.pyi", stem + "_pb2_grpc.py"
        if _pyi_shape((REPO_ROOT / pyi).read_text()) != _pyi_shape((fresh / pyi).read_text()):
            stale.append(pyi)
        if _grpc_methods((REPO_ROOT / grpc_stub).read_text()) != _grpc_methods(
            (fresh / grpc_stub).read_text()
        ):
            stale.append(grpc_stub)
    return stale


def test_checked_in_stubs_are_fresh(tmp_path: Path) -> None:
    stale = _stale_stubs(REPO_ROOT, tmp_path / "out")
    assert stale == [], f"stubs out of date, run `make protos`: {stale}"


def test_stub_readers_see_every_method_and_field() -> None:
    """The freshness check reads real content: every RPC and every message of both protos."""
    for proto, grpc_module in zip(PROTO_FILES, (generation_pb2_grpc, prefill_pb2_grpc), strict=True):
        descriptor = _checked_in_descriptor(proto)
        methods = _grpc_methods(Path(grpc_module.__file__).read_text())
        expected = {
            f"/{descriptor.package}.{service.name}/{method.name}"
            for service in descriptor.service
            for method in service.method
        }
        assert {path for _, path, _, _ in methods} == expected and expected
        shape = _pyi_shape((REPO_ROOT / (proto.removesuffix(".proto") + "_pb2.pyi")).read_text())
        for message in descriptor.message_type:
            assert {field.name for field in message.field} <= shape[message.name]


def _floor(requirement: str) -> tuple[int, ...]:
    """The lowest version a pyproject requirement such as "grpcio>=1.85.1" admits."""
    return tuple(int(part) for part in requirement.split(">=", 1)[1].split(",")[0].split("."))


def test_the_wheel_admits_no_runtime_older_than_the_stubs_need() -> None:
    """Generated stubs check the runtime at import: a range below what they need installs, then fails."""
    tomllib = pytest.importorskip("tomllib")
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    by_name = {re.split(r"[<>=!~; ]", text, maxsplit=1)[0]: text for text in dependencies}
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        grpc_stub = (REPO_ROOT / (stem + "_pb2_grpc.py")).read_text()
        grpc_needs = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub)
        assert grpc_needs is not None
        assert _floor(by_name["grpcio"]) >= tuple(int(part) for part in grpc_needs.group(1).split("."))
        protobuf_needs = re.search(
            r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),",
            (REPO_ROOT / (stem + "_pb2.py")).read_text(),
        )
        assert protobuf_needs is not None
        assert _floor(by_name["protobuf"]) >= tuple(int(part) for part in protobuf_needs.groups())


def _stale_after_edit(tmp_path: Path, old: str, new: str) -> list[str]:
    """The stale stubs once the public proto's `old` text reads `new` (in a copy of the protos)."""
    source_root = tmp_path / "src"
    for proto in PROTO_FILES:
        (source_root / proto).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / proto, source_root / proto)
    changed = source_root / PROTO_FILES[0]
    text = changed.read_text()
    assert old in text
    changed.write_text(text.replace(old, new))
    return _stale_stubs(source_root, tmp_path / "out")


def test_freshness_check_catches_a_changed_proto(tmp_path: Path) -> None:
    stale = _stale_after_edit(
        tmp_path, "  string tenant = 8;\n", "  string tenant = 8;\n  string added = 99;\n"
    )
    assert "protos/tandem/v1/generation_pb2.py" in stale
    assert "protos/tandem/v1/generation_pb2.pyi" in stale


def test_freshness_check_catches_a_changed_rpc(tmp_path: Path) -> None:
    abort = "rpc Abort(AbortRequest) returns (AbortResponse)"
    stale = _stale_after_edit(tmp_path, abort, abort.replace("(AbortResponse)", "(stream AbortResponse)"))
    assert "protos/tandem/v1/generation_pb2_grpc.py" in stale


def _fields(message_type) -> dict[str, FieldDescriptor]:
    return dict(message_type.DESCRIPTOR.fields_by_name)


def test_generate_request_field_names_match_the_contract() -> None:
    assert set(_fields(generation_pb2.GenerateRequest)) == {
        "request_id",
        "prompt",
        "token_ids",
        "messages",
        "sampling",
        "stopping",
        "priority",
        "tenant",
        "n",
        "cache_salt",
        "structured_output",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs_json",
        "skip_special_tokens",
    }
    assert set(_fields(generation_pb2.ChatMessage)) == {
        "role",
        "content",
        "tool_calls",
        "tool_call_id",
        "name",
    }
    output_kinds = generation_pb2.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"]
    assert {field.name for field in output_kinds.fields} == {
        "json_schema",
        "json_object",
        "regex",
        "choice",
        "grammar",
    }
    assert set(_fields(generation_pb2.FunctionTool)) == {"name", "description", "parameters_json"}
    assert set(_fields(generation_pb2.ToolChoice)) == {"mode", "function_name"}
    assert set(_fields(generation_pb2.SamplingParams)) == {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "disable_speculation",
    }
    assert _fields(generation_pb2.SamplingParams)["logit_bias"].message_type.GetOptions().map_entry
    assert set(_fields(generation_pb2.StoppingParams)) == {
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
    }


def test_prompt_inputs_are_not_a_oneof_so_the_server_sees_all_of_them() -> None:
    fields = _fields(generation_pb2.GenerateRequest)
    for name in ("prompt", "token_ids", "messages"):
        assert fields[name].containing_oneof is None
    request = generation_pb2.GenerateRequest(
        prompt="hi", token_ids=[1, 2], messages=[generation_pb2.ChatMessage(role="user", content="hi")]
    )
    decoded = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded.prompt == "hi" and list(decoded.token_ids) == [1, 2] and len(decoded.messages) == 1


@pytest.mark.parametrize(
    ("message_type", "name", "cpp_type", "has_presence"),
    [
        (generation_pb2.SamplingParams, "temperature", FieldDescriptor.CPPTYPE_FLOAT, True),
        (generation_pb2.SamplingParams, "top_p", FieldDescriptor.CPPTYPE_FLOAT, True),
        (generation_pb2.SamplingParams, "top_k", FieldDescriptor.CPPTYPE_INT32, True),
        (generation_pb2.SamplingParams, "min_p", FieldDescriptor.CPPTYPE_FLOAT, True),
        (generation_pb2.SamplingParams, "seed", FieldDescriptor.CPPTYPE_UINT64, True),
        (generation_pb2.SamplingParams, "logprobs", FieldDescriptor.CPPTYPE_INT32, False),
        (generation_pb2.StoppingParams, "max_tokens", FieldDescriptor.CPPTYPE_INT32, True),
        (generation_pb2.StoppingParams, "min_tokens", FieldDescriptor.CPPTYPE_INT32, False),
        (generation_pb2.GenerateRequest, "priority", FieldDescriptor.CPPTYPE_INT32, False),
        (generation_pb2.SamplingParams, "presence_penalty", FieldDescriptor.CPPTYPE_FLOAT, True),
        (generation_pb2.SamplingParams, "frequency_penalty", FieldDescriptor.CPPTYPE_FLOAT, True),
        (generation_pb2.SamplingParams, "repetition_penalty", FieldDescriptor.CPPTYPE_FLOAT, True),
        (generation_pb2.GenerateRequest, "n", FieldDescriptor.CPPTYPE_INT32, False),
        (generation_pb2.GenerateResponse, "index", FieldDescriptor.CPPTYPE_INT32, False),
    ],
)
def test_numeric_field_types_and_presence(message_type, name: str, cpp_type: int, has_presence: bool) -> None:
    field = _fields(message_type)[name]
    assert field.cpp_type == cpp_type
    assert field.has_presence == has_presence


def test_unset_optional_differs_from_explicit_zero() -> None:
    unset = generation_pb2.SamplingParams()
    greedy = generation_pb2.SamplingParams(temperature=0.0, top_k=0, seed=0)
    decoded = generation_pb2.SamplingParams.FromString(greedy.SerializeToString())
    for name in ("temperature", "top_k", "seed"):
        assert not unset.HasField(name)
        assert decoded.HasField(name)
    assert generation_pb2.StoppingParams(max_tokens=-1).max_tokens == -1


def test_generate_response_shape() -> None:
    assert set(_fields(generation_pb2.GenerateResponse)) == {
        "request_id",
        "token_ids",
        "text",
        "logprobs",
        "finish_reason",
        "stop_string",
        "stop_token_id",
        "usage",
        "timings",
        "index",
        "reasoning_text",
        "tool_calls",
    }
    assert set(_fields(generation_pb2.ToolCallDelta)) == {"index", "id", "name", "arguments"}
    oneof = generation_pb2.GenerateResponse.DESCRIPTOR.oneofs_by_name["matched_stop"]
    assert {field.name for field in oneof.fields} == {"stop_string", "stop_token_id"}
    assert dict(generation_pb2.FinishReason.items()) == {
        "FINISH_REASON_UNSPECIFIED": 0,
        "STOP": 1,
        "LENGTH": 2,
        "ABORT": 3,
        "TOOL_CALLS": 4,
    }
    assert set(_fields(generation_pb2.TokenLogprob)) == {"token_id", "logprob", "top"}
    assert set(_fields(generation_pb2.Usage)) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
    assert set(_fields(generation_pb2.ServerTimings)) == {
        "queue_seconds",
        "prefill_seconds",
        "first_token_seconds",
    }


def test_model_info_fields() -> None:
    assert set(_fields(generation_pb2.ModelInfo)) == {
        "model_name",
        "max_context_length",
        "vocab_size",
        "eos_token_ids",
        "dtype",
        "block_size",
        "mode",
        "server_version",
        "prefix_caching",
    }
    assert set(_fields(generation_pb2.AbortRequest)) == {"request_id"}


def _methods(service_descriptor) -> dict[str, tuple[str, str, bool, bool]]:
    return {
        method.name: (
            method.input_type.full_name,
            method.output_type.full_name,
            method.client_streaming,
            method.server_streaming,
        )
        for method in service_descriptor.methods
    }


def test_services_have_the_contracted_rpcs() -> None:
    assert _methods(generation_pb2.DESCRIPTOR.services_by_name["Generation"]) == {
        "Generate": ("tandem.v1.GenerateRequest", "tandem.v1.GenerateResponse", False, True),
        "Abort": ("tandem.v1.AbortRequest", "tandem.v1.AbortResponse", False, False),
        "GetModelInfo": ("tandem.v1.GetModelInfoRequest", "tandem.v1.ModelInfo", False, False),
    }
    assert _methods(prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]) == {
        "GetInfo": ("tandem.internal.v1.GetInfoRequest", "tandem.internal.v1.PrefillInfo", False, False),
        "Prefill": ("tandem.internal.v1.PrefillRequest", "tandem.internal.v1.PrefillResponse", False, True),
    }
    assert hasattr(generation_pb2_grpc, "GenerationStub") and hasattr(prefill_pb2_grpc, "PrefillStub")


def test_internal_proto_reuses_the_public_sampling_params() -> None:
    assert generation_pb2.DESCRIPTOR in prefill_pb2.DESCRIPTOR.dependencies
    sampling = _fields(prefill_pb2.PrefillRequest)["sampling"]
    assert sampling.message_type is generation_pb2.SamplingParams.DESCRIPTOR
    request = prefill_pb2.PrefillRequest(sampling=generation_pb2.SamplingParams(top_k=5, seed=7))
    assert prefill_pb2.PrefillRequest.FromString(request.SerializeToString()).sampling.seed == 7


def test_prefill_messages() -> None:
    assert set(_fields(prefill_pb2.PrefillRequest)) == {
        "request_id",
        "prompt_token_ids",
        "sampling",
        "compatibility_hash",
        "cache_salt",
        "num_held_blocks",
        "held_prefix_hash",
    }
    kind = prefill_pb2.PrefillResponse.DESCRIPTOR.oneofs_by_name["kind"]
    assert {field.name: field.message_type.name for field in kind.fields} == {
        "kv": "KVChunk",
        "done": "PrefillDone",
    }
    assert set(_fields(prefill_pb2.KVChunk)) == {
        "block_start",
        "num_blocks",
        "layer_start",
        "num_layers",
        "dtype",
        "shape",
        "payload",
        "crc32c",
        "group",
    }
    assert _fields(prefill_pb2.KVChunk)["payload"].type == FieldDescriptor.TYPE_BYTES
    assert set(_fields(prefill_pb2.KVLayout)) == {
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "block_size",
        "dtype",
        "groups",
    }
    assert {field.name for field in prefill_pb2.KVGroup.DESCRIPTOR.fields} == {"window", "layers"}
    assert {"model_fingerprint", "kv_layout", "compatibility_hash", "version"} == set(
        _fields(prefill_pb2.PrefillInfo)
    )


def _undocumented(file_proto: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Names of services, methods, messages, fields, oneofs, enums and values with no leading comment.

    Paths follow descriptor.proto's field numbers: message_type=4, enum_type=5, service=6;
    within a message field=2, nested_type=3, enum_type=4, oneof_decl=8; enum value=2; method=2.
    """
    documented = {
        tuple(location.path)
        for location in file_proto.source_code_info.location
        if location.leading_comments.strip()
    }
    missing: list[str] = []

    def check(path: tuple[int, ...], name: str) -> None:
        if path not in documented:
            missing.append(name)

    def walk_enum(enum, path, prefix):
        check(path, prefix + enum.name)
        for index, value in enumerate(enum.value):
            check((*path, 2, index), f"{prefix}{enum.name}.{value.name}")

    def walk_message(message, path, prefix):
        name = prefix + message.name
        check(path, name)
        for index, field in enumerate(message.field):
            check((*path, 2, index), f"{name}.{field.name}")
        for index, oneof in enumerate(message.oneof_decl):
            if not oneof.name.startswith("_"):  # synthetic oneofs of proto3 `optional`
                check((*path, 8, index), f"{name}.{oneof.name}")
        for index, nested in enumerate(message.nested_type):
            if not nested.options.map_entry:  # synthetic entry type of a map field, documented by the field
                walk_message(nested, (*path, 3, index), name + ".")
        for index, enum in enumerate(message.enum_type):
            walk_enum(enum, (*path, 4, index), name + ".")

    for index, message in enumerate(file_proto.message_type):
        walk_message(message, (4, index), "")
    for index, enum in enumerate(file_proto.enum_type):
        walk_enum(enum, (5, index), "")
    for index, service in enumerate(file_proto.service):
        check((6, index), service.name)
        for method_index, method in enumerate(service.method):
            check((6, index, 2, method_index), f"{service.name}.{method.name}")
    return missing


def _descriptor_set(source_root: Path, tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path / "descriptors.pb"
    _run_protoc(source_root, tmp_path, f"--descriptor_set_out={out}", "--include_source_info")
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def test_every_element_of_both_protos_is_documented(tmp_path: Path) -> None:
    descriptor_set = _descriptor_set(REPO_ROOT, tmp_path)
    assert [file.name for file in descriptor_set.file] == PROTO_FILES
    missing = {file.name: _undocumented(file) for file in descriptor_set.file}
    assert missing == {name: [] for name in PROTO_FILES}


def test_documentation_check_catches_an_undocumented_field(tmp_path: Path) -> None:
    source_root = tmp_path / "src"
    for proto in PROTO_FILES:
        (source_root / proto).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / proto, source_root / proto)
    target = source_root / PROTO_FILES[0]
    target.write_text(
        target.read_text().replace("  string tenant = 8;\n", "  string tenant = 8;\n  int32 bare = 99;\n")
    )
    descriptor_set = _descriptor_set(source_root, tmp_path)
    assert _undocumented(descriptor_set.file[0]) == ["GenerateRequest.bare"]
