"""The generated code is current, and our inference.proto is wire-compatible with Triton's."""

from __future__ import annotations

import importlib.util
import warnings

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from test_server_support import ROOT

from deepco.wire import deepco_service_pb2, inference_pb2


def _generate_module():
    spec = importlib.util.spec_from_file_location("deepco_protos_generate", ROOT / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_current() -> None:
    # Regenerates into a temporary directory with the installed grpcio-tools and compares byte for byte.
    assert _generate_module().stale_files() == [], "run: .venv/bin/python protos/generate.py"


def _fields(message: Descriptor) -> dict[str, tuple]:
    """name -> (number, type, repeated, oneof, message type) for a message and its nested messages."""
    out = {}
    for f in message.fields:
        out[f"{message.full_name}.{f.name}"] = (
            f.number, f.type, f.is_repeated, f.containing_oneof.name if f.containing_oneof else None,
            f.message_type.full_name if f.type == FieldDescriptor.TYPE_MESSAGE else None,
            f.enum_type.full_name if f.type == FieldDescriptor.TYPE_ENUM else None)
    for nested in message.nested_types:
        out.update(_fields(nested))
    return out


def test_inference_proto_matches_tritons_field_for_field() -> None:
    # tritonclient ships Triton's own grpc_service.proto and model_config.proto: every message, field, enum
    # value and RPC we declare must be there with the same number and type. The messages that Triton's
    # protocol answers in full match field for field; of Triton's model configuration and statistics we
    # declare the fields we fill in (protobuf skips the rest), so those are checked as subsets.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from tritonclient.grpc import service_pb2 as triton
    ours, theirs = inference_pb2.DESCRIPTOR, triton.DESCRIPTOR
    assert ours.package == theirs.package == "inference"
    assert len(ours.message_types_by_name) >= 30
    partial = {"ModelConfig", "ModelInput", "ModelOutput", "ModelStatistics"}
    for name, message in ours.message_types_by_name.items():
        reference = theirs.pool.FindMessageTypeByName(f"inference.{name}")
        mine, triton_fields = _fields(message), _fields(reference)
        if name in partial:
            assert {k: triton_fields.get(k) for k in mine} == mine, name
            assert len(mine) >= 3, name
        else:
            assert mine == triton_fields, name
    for name, enum in ours.enum_types_by_name.items():
        reference = theirs.pool.FindEnumTypeByName(f"inference.{name}")
        assert [(v.name, v.number) for v in enum.values] == [(v.name, v.number) for v in reference.values], name
    service, triton_service = ours.services_by_name["GRPCInferenceService"], theirs.services_by_name[
        "GRPCInferenceService"]
    for method in service.methods:
        other = triton_service.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            other.input_type.full_name, other.output_type.full_name)
    assert {m.name for m in service.methods} == {
        "ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata", "ModelInfer",
        "ModelConfig", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"}


def test_messages_cross_between_the_two_implementations() -> None:
    from tritonclient.grpc import service_pb2 as triton

    ours = inference_pb2.ModelInferRequest(model_name="m", id="7", raw_input_contents=[b"\x00" * 8])
    ours.inputs.add(name="x", datatype="FP32", shape=[1, 2]).parameters["p"].double_param = 0.5
    ours.parameters["priority"].uint64_param = 3
    theirs = triton.ModelInferRequest.FromString(ours.SerializeToString())
    assert theirs.inputs[0].parameters["p"].double_param == 0.5
    assert theirs.parameters["priority"].uint64_param == 3
    assert inference_pb2.ModelInferRequest.FromString(theirs.SerializeToString()) == ours


def test_deepco_service_is_its_own_package() -> None:
    assert deepco_service_pb2.DESCRIPTOR.package == "deepco"
    assert [m.name for m in deepco_service_pb2.DESCRIPTOR.services_by_name["DeepcoService"].methods] == [
        "Profile", "Run", "Echo", "SplitRun", "SplitExchange", "ProbePeer", "FetchWhole"]
