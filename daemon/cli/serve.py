"""`oomguard serve` (the read-only web dashboard, daemon/web/) and `oomguard web-url` (a user's
own link to it, asked for over its Unix socket, where the kernel says who asks)."""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import socket
import stat
import sys
from pathlib import Path

from oomguard.daemon.cli.output import EXIT_FAILED, EXIT_OK, CliError
from oomguard.daemon.paths import StateDir

DEFAULT_PORT = 8470
SOCKET_NAME = "web.sock"
KEY_NAME = "web.key"


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from oomguard.daemon.web.app import ServeSettings, make_app
    from oomguard.daemon.web.peer import PeerCredentialsProtocol
    from oomguard.daemon.web.tokens import Tokens

    host, port = _listen_address(args.listen)
    state = StateDir(args.state_dir)
    if not state.root.is_dir():
        raise CliError(f"no state directory at {state.root}: start the daemon first, or pass the daemon's --state-dir", EXIT_FAILED)
    socket_path = Path(args.socket) if args.socket else state.root / SOCKET_NAME
    try:
        tokens = Tokens(state.secrets / KEY_NAME)
    except PermissionError:
        raise CliError(
            f"cannot read or make the dashboard's key in {state.secrets}: run `oomguard serve` as the daemon's user "
            f"(root for a system daemon), who reads every job's files and shows each user their own", EXIT_FAILED,
        ) from None
    except ValueError as error:
        raise CliError(str(error), EXIT_FAILED) from None
    tcp = _bind_tcp(host, port)
    unix = _bind_unix(socket_path)
    try:
        shown_host = f"[{host}]" if ":" in host else host
        base_url = f"http://{shown_host}:{tcp.getsockname()[1]}/"
        settings = ServeSettings(state_dir=state.root, tokens=tokens, server_uid=os.getuid(), admin_group=args.admin_group, base_url=base_url)
        print(f"oomguard dashboard of {state.root} on {base_url} and {socket_path}", flush=True)
        print("each user opens the link `oomguard web-url` prints for them (README: Watching from a browser)", flush=True)
        if sys.stdout.isatty():
            # Only to a terminal: a service's log is read by others, and this link is the server user's.
            print(f"yours: {base_url}?token={tokens.token_for(os.getuid())}", flush=True)
        config = uvicorn.Config(make_app(settings), http=PeerCredentialsProtocol, lifespan="off", log_level=args.log_level, access_log=False)
        uvicorn.Server(config).run(sockets=[tcp, unix])
    finally:
        socket_path.unlink(missing_ok=True)
    return EXIT_OK


def cmd_web_url(args: argparse.Namespace) -> int:
    socket_path = Path(args.socket) if args.socket else StateDir(args.state_dir).root / SOCKET_NAME
    connection = _UnixConnection(socket_path)
    try:
        connection.request("GET", "/token", headers={"Host": "localhost"})
        answer = connection.getresponse()
        body = json.loads(answer.read() or b"{}")
    except (FileNotFoundError, ConnectionRefusedError):
        raise CliError(f"no dashboard answers on {socket_path}: start it with `oomguard serve` (as the daemon's user)", EXIT_FAILED) from None
    except PermissionError:
        raise CliError(f"cannot connect to {socket_path}: its mode lets you not; the dashboard makes it 0666 (ask the admin)", EXIT_FAILED) from None
    except (OSError, ValueError, http.client.HTTPException) as error:
        raise CliError(f"the dashboard on {socket_path} did not answer as one: {error}", EXIT_FAILED) from None
    finally:
        connection.close()
    if answer.status != 200 or not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise CliError(f"the dashboard on {socket_path} refused: {body.get('error') if isinstance(body, dict) else body}", EXIT_FAILED)
    print(body["url"])
    return EXIT_OK


def _listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT (or PORT) on a loopback address: the dashboard speaks plain HTTP, so it is
    reached from elsewhere through an SSH tunnel, never on a network address."""
    host, _, port_text = text.rpartition(":") if ":" in text else ("127.0.0.1", "", text)
    host = host.strip("[]") or "127.0.0.1"
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise CliError(f"--listen: not a port: {port_text!r} (expected HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT})")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise CliError(
            f"--listen: {host} is not a loopback address; the dashboard has no TLS, so it listens on this machine only: "
            f"reach it from a laptop through an SSH tunnel (ssh -L {DEFAULT_PORT}:localhost:{DEFAULT_PORT} box)"
        )
    return host, int(port_text)


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise CliError(f"--listen: cannot listen on {host}:{port} ({error.strerror}); choose another port with --listen {host}:PORT", EXIT_FAILED) from None
    sock.listen(128)
    return sock


def _bind_unix(path: Path) -> socket.socket:
    """The socket users reach the dashboard through with their identity: anyone may connect
    (0666); the kernel tells the server who did. A socket left by a server that died is
    replaced; one a live server answers on is not."""
    if path.is_symlink() or (path.exists() and not stat.S_ISSOCK(path.lstat().st_mode)):
        raise CliError(f"{path} exists and is not a socket; remove it or pass --socket PATH", EXIT_FAILED)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # no one listens: left by a server that died
        else:
            raise CliError(f"another dashboard answers on {path}; stop it first, or pass --socket PATH", EXIT_FAILED)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o666)
    sock.listen(128)
    return sock


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.path))
