"""TLS, mutual TLS, the shared token and sha256-verified uploads, against real servers on 127.0.0.1."""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from deepco_server.app import ServeConfig, Server
from deepco_server.security import ServerSecurity, is_loopback, plaintext_warning
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server_support import ROOT, conv_model, reference, serve_process
from tls_support import Certs, make_certs

from deepco.errors import UserError
from deepco.wire import inference_pb2 as pb
from deepco.wire import inference_pb2_grpc as pb_grpc
from deepco.wire import security as wire_security
from deepco.wire.client import InferenceClient, ServerError
from deepco.wire.security import ChannelSecurity, make_channel

MODEL = conv_model(channels=(3, 4))
TOKEN = "t0ken-for-tests"
X = np.random.default_rng(0).standard_normal((1, 3, 6, 5)).astype(np.float32)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _server(certs: Certs, *, mutual: bool, token: str | None = TOKEN, **config: object) -> Server:
    security = ServerSecurity(cert=certs.server_cert, key=certs.server_key, ca=certs.ca if mutual else None,
                              token=token)
    return Server(ServeConfig(port=0, device="cpu", threads=1, security=security, **config))


@pytest.fixture(scope="module")
def tls_server(certs: Certs) -> Iterator[Server]:
    srv = _server(certs, mutual=False)
    yield srv
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def mtls_server(certs: Certs) -> Iterator[Server]:
    srv = _server(certs, mutual=True)
    yield srv
    srv.stop(grace=1)


def _code(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServerError) as info:
        call(*args, **kwargs)
    return info.value.code, info.value.details


def _works(address: str, security: ChannelSecurity) -> None:
    with InferenceClient(address, timeout=10, security=security) as c:
        c.load_model(MODEL, "conv")
        np.testing.assert_allclose(c.infer("conv", X), reference(MODEL, X), rtol=0, atol=1e-5)


def test_tls_with_ca_and_token_works(tls_server: Server, certs: Certs) -> None:
    _works(tls_server.address, ChannelSecurity(ca=certs.ca, token=TOKEN))
    # PEM bytes work as well as paths, and the TLS name may be given explicitly
    _works(f"localhost:{tls_server.port}", ChannelSecurity(ca=certs.ca.read_bytes(), token=TOKEN,
                                                           server_name="localhost"))


def test_missing_ill_formed_or_wrong_token_is_refused(tls_server: Server, certs: Certs) -> None:
    with InferenceClient(tls_server.address, timeout=10, security=ChannelSecurity(ca=certs.ca)) as c:
        for call, args in ((c.load_model, (MODEL, "x")), (c.infer_many, ("conv", {"input": X})),
                           (c.server_metadata, ()), (c.loaded_models, ()), (c.profile, ("conv", [1, 3, 8, 8])),
                           (c.echo, (10,))):
            code, msg = _code(call, *args)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "missing token" in msg, call
        assert c.server_live() and c.server_ready()  # probes stay open
        with make_channel(tls_server.address, ChannelSecurity(ca=certs.ca)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            index = pb_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex
            for metadata in ((("authorization", f"Basic {TOKEN}"),), (("authorization", "Bearer"),)):
                with pytest.raises(grpc.RpcError) as info:
                    index(pb.RepositoryIndexRequest(), metadata=metadata, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "ill-formed authorization" in info.value.details()
            # Garbage bytes without a token are refused for the token, not parsed.
            raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as info:
                raw(b"\xff\xff\xff", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with InferenceClient(tls_server.address, timeout=10, security=ChannelSecurity(ca=certs.ca, token="nope")) as c:
        code, msg = _code(c.load_model, MODEL, "x")
        assert code == grpc.StatusCode.PERMISSION_DENIED and msg == "wrong token"


@pytest.mark.parametrize("security", [
    pytest.param(ChannelSecurity(token=TOKEN), id="plain-text-client"),
    pytest.param("rogue", id="wrong-ca"),
])
def test_client_without_the_ca_fails_the_handshake(tls_server: Server, certs: Certs,
                                                   security: ChannelSecurity | str) -> None:
    if security == "rogue":
        security = ChannelSecurity(ca=certs.rogue_ca, token=TOKEN)
    with InferenceClient(tls_server.address, timeout=10, security=security) as c:
        start = time.perf_counter()
        assert _code(c.infer_many, "conv", {"input": X})[0] == grpc.StatusCode.UNAVAILABLE
        assert time.perf_counter() - start < 9  # refused, not timed out


def test_mutual_tls_needs_a_client_certificate_from_the_ca(mtls_server: Server, certs: Certs) -> None:
    _works(mtls_server.address, ChannelSecurity(ca=certs.ca, cert=certs.client_cert, key=certs.client_key,
                                                token=TOKEN))
    # The server's own identity is what it dials its MoDNN peers with.
    _works(mtls_server.address, mtls_server.peer_security)
    for security in (ChannelSecurity(ca=certs.ca, token=TOKEN),
                     ChannelSecurity(ca=certs.ca, cert=certs.rogue_client_cert, key=certs.rogue_client_key,
                                     token=TOKEN)):
        with InferenceClient(mtls_server.address, timeout=10, security=security) as c:
            assert _code(c.server_live)[0] == grpc.StatusCode.UNAVAILABLE


def test_sha256_mismatch_is_refused_and_a_match_loads(tls_server: Server, certs: Certs) -> None:
    with InferenceClient(tls_server.address, timeout=10, security=ChannelSecurity(ca=certs.ca, token=TOKEN)) as c:
        wrong = hashlib.sha256(b"another model").hexdigest()
        code, msg = _code(c.load_model, MODEL, "checked", sha256=wrong)
        actual = hashlib.sha256(MODEL).hexdigest()
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sha256 mismatch: expected {wrong}, actual {actual}" in msg
        code, msg = _code(c.load_model, MODEL, "checked", sha256="abc")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "must be 64 hex digits" in msg
        assert "checked" not in c.loaded_models()
        c.load_model(MODEL, "checked", sha256=actual.upper())  # hex is hex in either case
        c.load_model(MODEL, "unchecked", sha256="")  # stock clients send none: still accepted
        assert {"checked", "unchecked"} <= set(c.loaded_models())
        np.testing.assert_allclose(c.infer("checked", X), reference(MODEL, X), rtol=0, atol=1e-5)


def test_model_byte_budget_refuses_with_resource_exhausted(certs: Certs) -> None:
    srv = _server(certs, mutual=False, token=None, max_model_bytes=2 * len(MODEL) + 10)
    try:
        with InferenceClient(srv.address, timeout=10, security=ChannelSecurity(ca=certs.ca)) as c:
            c.load_model(MODEL, "a")
            c.load_model(MODEL, "b")
            c.load_model(MODEL, "b")  # replacing frees the old bytes first
            code, msg = _code(c.load_model, MODEL, "c")
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"cannot load model 'c' ({len(MODEL)} bytes): loaded models hold {2 * len(MODEL)} bytes" in msg
            assert "--max-model-bytes" in msg
            c.unload_model("a")
            c.load_model(MODEL, "c")
            assert sorted(c.loaded_models()) == ["b", "c"]
    finally:
        srv.stop(grace=1)


def test_loopback_detection_and_plaintext_warning(certs: Certs) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert plaintext_warning("127.0.0.1", ServerSecurity()) is None
    tls = ServerSecurity(cert=certs.server_cert, key=certs.server_key)
    assert plaintext_warning("0.0.0.0", tls) is None
    warning = plaintext_warning("0.0.0.0", ServerSecurity(token=TOKEN))
    assert warning is not None and "without TLS" in warning and "token" in warning and "\n" not in warning


def test_serve_cli_tls_token_file_and_plaintext_warning(certs: Certs, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with serve_process("--threads", "1", "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                       "--tls-ca", str(certs.ca), "--token-file", str(token_file)) as server:
        _works(server.address, ChannelSecurity(ca=certs.ca, cert=certs.client_cert, key=certs.client_key,
                                               token=TOKEN))
        with InferenceClient(server.address, timeout=10, security=ChannelSecurity(
                ca=certs.ca, cert=certs.client_cert, key=certs.client_key)) as c:
            assert _code(c.loaded_models)[0] == grpc.StatusCode.UNAUTHENTICATED
        assert not any("warning" in line for line in server.stderr_lines)
    with serve_process("--threads", "1", "--host", "0.0.0.0") as server:
        deadline = time.monotonic() + 10
        while not any("warning" in line for line in server.stderr_lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        warnings = [line for line in server.stderr_lines if "warning" in line]
        assert len(warnings) == 1 and "listening on 0.0.0.0 without TLS" in warnings[0]


@pytest.mark.parametrize(("args", "message"), [
    (["--tls-ca", "ca.pem"], "--tls-ca (mutual TLS) needs --tls-cert and --tls-key"),
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
     "--tls-key: cannot read '/nonexistent/k.pem': No such file or directory"),
    (["--token-file", "/nonexistent/token"], "token file '/nonexistent/token': cannot read it"),
    (["--token", "has space"], "--token must be non-empty printable ASCII without spaces"),
    (["--token", "a", "--token-file", "f"], "not allowed with argument"),
])
def test_serve_cli_security_errors_are_one_line_exit_2(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "deepco", "serve", "--port", "0", "--device", "cpu", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_serve_cli_bad_pem_files_are_one_line_exit_2(certs: Certs, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    good = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    for args, message in (
            (["--tls-cert", str(junk), "--tls-key", str(certs.server_key)], "not a PEM certificate"),
            (["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.client_key)], "KEY_VALUES_MISMATCH"),
            ([*good, "--tls-ca", str(junk)], f"--tls-ca '{junk}': not PEM CA certificates")):
        done = subprocess.run([sys.executable, "-m", "deepco", "serve", "--port", "0", "--device", "cpu", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
    with pytest.raises(UserError, match=r"CA certificate \(bytes\): not PEM certificates"):
        make_channel("127.0.0.1:1", ChannelSecurity(ca=b"junk"))


def test_client_flags_build_the_same_channel_security(certs: Certs, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    wire_security.add_arguments(parser)
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    args = parser.parse_args(["--tls-ca", str(certs.ca), "--tls-cert", str(certs.client_cert),
                              "--tls-key", str(certs.client_key), "--token-file", str(token_file)])
    assert wire_security.from_args(args) == ChannelSecurity(ca=certs.ca, cert=certs.client_cert, key=certs.client_key,
                                                       token=TOKEN)
    with pytest.raises(UserError, match="--tls-cert and --tls-key go together"):
        wire_security.from_args(parser.parse_args(["--tls-cert", str(certs.client_cert)]))
