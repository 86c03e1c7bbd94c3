"""`epp-extproc` refuses a bad setting with ONE line that names what the user typed (the flag, and its env
name), says "not set" for a missing value and what to do; a port already taken is one line naming its flag,
on both ext_proc transports, never a traceback. The command is run as users run it: a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from epp_extproc.config import GROUPS, OPTIONS, build_parser, load_config

# every listening port on a free one, so that only the port under test can collide
FREE_PORTS = ["--bind", "127.0.0.1", "--grpc-port", "0", "--health-port", "0", "--metrics-port", "0",
              "--admin-port", "0", "--secure-serving=false"]


def epp(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the installed command with a clean DYN_* environment (plus `env`)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "POD_")) and k != "KUBECONFIG"}
    return subprocess.run([sys.executable, "-m", "epp_extproc.cli", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    """The process failed with exactly one `epp-extproc: ...` line on stderr and no traceback."""
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("epp-extproc:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_a_host_name_in_endpoints_names_the_flag_and_its_env_and_the_expected_form() -> None:
    msg = one_line_error(epp("--endpoints", "localhost:8000"))
    assert msg.startswith("epp-extproc: --endpoints (DYN_EPP_ENDPOINTS): bad address 'localhost:8000'")
    assert "name=ip:port" in msg and "127.0.0.1" in msg


def test_a_missing_renderer_url_says_not_set_and_names_both_flags() -> None:
    msg = one_line_error(epp("--tokenizer-protocol", "trtllm-render"))
    assert "--tokenizer-service-url (DYN_EPP_TOKENIZER_SERVICE_URL) is not set" in msg
    assert "--tokenizer-protocol" in msg and "None" not in msg


def test_a_relative_renderer_url_from_the_env_is_quoted_with_what_is_expected() -> None:
    msg = one_line_error(epp(env={"DYN_EPP_TOKENIZER_PROTOCOL": "trtllm-render",
                                  "DYN_EPP_TOKENIZER_SERVICE_URL": "renderer:9"}))
    assert "DYN_EPP_TOKENIZER_SERVICE_URL" in msg and "'renderer:9'" in msg and "http(s)" in msg


def test_a_non_integer_env_value_names_the_variable_and_its_flag() -> None:
    msg = one_line_error(epp(env={"DYN_EPP_GRPC_PORT": "x"}))
    assert msg == "epp-extproc: DYN_EPP_GRPC_PORT (--grpc-port): expected an integer, got 'x'"


def test_a_bad_flag_value_is_one_line_without_the_usage() -> None:
    r = epp("--grpc-port", "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--grpc-port" in r.stderr and "usage" not in r.stderr


def test_an_unknown_env_choice_lists_the_choices() -> None:
    msg = one_line_error(epp(env={"DYN_EPP_CACHE_SALT_POLICY": "drop"}))
    assert "DYN_EPP_CACHE_SALT_POLICY (--cache-salt-policy)" in msg and "reject, load-only" in msg


@pytest.mark.parametrize("argv, named", [
    (["--max-body-bytes", "0"], "--max-body-bytes (DYN_EPP_MAX_BODY_BYTES) must be positive, got 0"),
    (["--extproc-keepalive-s", "-1"], "--extproc-keepalive-s (DYN_EPP_EXTPROC_KEEPALIVE_S) must be >= 0"),
    (["--kv-cache-util-threshold", "2"], "--kv-cache-util-threshold (DYN_EPP_KV_CACHE_UTIL_THRESHOLD)"),
    (["--peers", "a:1", "--peer-service", "s"], "--peers (DYN_EPP_PEERS) or --peer-service"),
    (["--endpoints", "1.2.3.4:1", "--endpoints-file", "f"], "--endpoints (DYN_EPP_ENDPOINTS) and "
                                                            "--endpoints-file (DYN_EPP_ENDPOINTS_FILE)"),
    (["--allowed-body-modes", "STREAMED"], "--allowed-body-modes (DYN_EPP_ALLOWED_BODY_MODES): unknown"),
    (["--replica-sync-linger-ms", "500"], "--replica-sync-linger-ms (DYN_EPP_REPLICA_SYNC_LINGER_MS) must be under "
                                          "a quarter of --peer-timeout-ms (DYN_EPP_PEER_TIMEOUT_MS)"),
    (["--replica-sync-linger-ms", "-1"], "--replica-sync-linger-ms (DYN_EPP_REPLICA_SYNC_LINGER_MS) must be >= 0"),
])
def test_value_errors_name_the_flag_and_its_env(argv: list[str], named: str) -> None:
    with pytest.raises(SystemExit) as e:
        load_config(argv, env={})
    assert named in str(e.value) and "\n" not in str(e.value)


def test_every_option_is_in_exactly_one_help_group() -> None:
    grouped = [d for _, dests in GROUPS for d in dests]
    assert sorted(grouped) == sorted(o.dest for o in OPTIONS)


def test_help_shows_the_groups_and_an_epilog_with_a_minimal_command() -> None:
    text = build_parser().format_help()
    for title, _ in GROUPS:
        assert f"\n{title}:\n" in text
    assert "--tokenizer-service-url http://127.0.0.1:8001" in text and "epp-extproc envoy-config" in text


def test_version_prints_the_package_version() -> None:
    from importlib.metadata import version

    r = epp("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"epp-extproc {version('epp-extproc')}"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other process listens on (as a picker still running would)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
@pytest.mark.parametrize("flag, env", [("--grpc-port", "DYN_EPP_GRPC_PORT"),
                                       ("--health-port", "DYN_EPP_HEALTH_PORT"),
                                       ("--metrics-port", "DYN_EPP_METRICS_PORT"),
                                       ("--admin-port", "DYN_EPP_ADMIN_PORT")])
def test_a_port_in_use_is_one_line_naming_its_flag(taken_port: int, transport: str, flag: str, env: str) -> None:
    argv = list(FREE_PORTS)
    argv[argv.index(flag) + 1] = str(taken_port)
    msg = one_line_error(epp(*argv, "--extproc-transport", transport))
    assert msg == (f"epp-extproc: {flag} {taken_port} is already in use ({env}); stop the other picker or "
                   "choose another port")


def test_two_flags_on_one_port_are_named_together() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = str(s.getsockname()[1])
    s.close()  # free: the picker's own two listeners collide
    argv = list(FREE_PORTS)
    argv[argv.index("--grpc-port") + 1] = argv[argv.index("--health-port") + 1] = port
    msg = one_line_error(epp(*argv))
    assert f"--grpc-port (DYN_EPP_GRPC_PORT) and --health-port (DYN_EPP_HEALTH_PORT) are both {port}" in msg


def test_an_option_missing_from_the_groups_still_reaches_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    import epp_extproc.config as config

    monkeypatch.setattr(config, "GROUPS", tuple((t, tuple(d for d in ds if d != "peers")) for t, ds in GROUPS))
    assert load_config(["--peers", "10.0.0.1:9004"], env={}).peers == "10.0.0.1:9004"
    assert "\nother:\n" in config.build_parser().format_help()
