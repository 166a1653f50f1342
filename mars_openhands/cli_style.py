"""One error style for every ``mars-openhands`` command line: one line, naming the flag, exit 2.

argparse prints its whole usage (twenty lines for ``compare``) before a one-line error, and our
own checks after parsing used to print ``error: ...`` or ``mars-openhands <cmd>: ...`` as each
module pleased. Every parser is a :class:`CliParser` (sub-parsers inherit the class from the
top-level parser) and every check after parsing reports through :func:`cli_error`, so a mistake
reads the same wherever it is made::

    mars-openhands compare: error: --admission: invalid choice: 'x' (choose from 'auto', 'off', 'on', 'both')
    mars-openhands gateway: error: --port 8000: 127.0.0.1:8000 is in use; pass a free --port

Standard library only: every layer's command line imports it.
"""

from __future__ import annotations

import argparse
import errno
import re
import socket
import sys
from typing import IO, NoReturn

__all__ = ["EXIT_USAGE", "CliParser", "check_port_free", "cli_error", "one_line"]

EXIT_USAGE = 2
"""Exit status of a usage error (argparse's, and the shell convention)."""

_ARGUMENT = re.compile(r"^argument (?:(?:-\w|--[\w-]+)/)*(?P<flag>[^:]+): ")
"""argparse's ``argument -o/--output: `` prefix; the last spelling (the long flag) is kept."""


def one_line(message: str) -> str:
    """``message`` as the one line :func:`cli_error` prints: argparse's ``argument -o/--output:``
    becomes ``--output:``, line breaks become ``; ``. Pure."""
    text = _ARGUMENT.sub(lambda m: m.group("flag") + ": ", message.strip())
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def cli_error(prog: str, message: str, file: IO[str] | None = None) -> int:
    """Print ``<prog>: error: <message>`` as one line on stderr and return :data:`EXIT_USAGE`.

    Args:
        prog: the command as typed, e.g. ``"mars-openhands compare"``.
        message: what failed, the value and the fix; should start with the flag
            (``"--out runs/x: is a file; give a directory"``).
        file: where to print (default ``sys.stderr``).
    """
    print(f"{prog}: error: {one_line(message)}", file=file or sys.stderr)
    return EXIT_USAGE


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one :func:`cli_error` line (no usage dump), exit 2.

    ``--help`` is unchanged. Sub-parsers made with ``add_subparsers().add_parser`` are of the
    parent's class, so making the top-level parser a ``CliParser`` covers every subcommand.
    """

    def error(self, message: str) -> NoReturn:
        """Print one line and exit 2 (argparse calls this for a bad flag, choice or value)."""
        cli_error(self.prog, message)
        sys.exit(EXIT_USAGE)


def check_port_free(host: str, port: int, flag: str = "--port") -> str | None:
    """Whether a server could listen on ``host:port`` now; the error line (naming ``flag``) if not.

    Binds a socket with ``SO_REUSEADDR``, as uvicorn does, so a port left in TIME_WAIT counts as
    free and only a listening process makes it busy. Port 0 (any free port) is always free.

    Returns:
        ``None`` when free; else e.g. ``"--port 8000: 127.0.0.1:8000 is in use (another server
        listens there); stop it or pass a free --port"``.
    """
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"{flag} {port}: {host}:{port} is in use (another server listens there); "
                        f"stop it or pass a free {flag}")
            if e.errno == errno.EACCES:
                return (f"{flag} {port}: not allowed to listen on {host}:{port} (ports below 1024 need "
                        f"root); pass {flag} 1024 or above")
            return f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror or e}); check --host and {flag}"
    return None
