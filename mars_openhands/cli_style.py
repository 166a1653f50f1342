"""One error style for every ``mars-openhands`` command line: one line, naming the flag, exit 2.

argparse prints its whole usage (twenty lines for ``compare``) before a one-line error, and our
own checks after parsing used to print ``error: ...`` or ``mars-openhands <cmd>: ...`` as each
module pleased. Every parser is a :class:`CliParser` (sub-parsers inherit the class from the
top-level parser) and every check after parsing reports through :func:`cli_error`, so a mistake
reads the same wherever it is made::

    mars-openhands compare: error: --admission: invalid choice: 'x' (choose from 'auto', 'off', 'on', 'both')
    mars-openhands gateway: error: --port 8000: 127.0.0.1:8000 is in use; pass a free --port

The range-checked ``type=`` helpers (:func:`positive_int`, :func:`non_negative_int`,
:func:`count_or_zero`, :func:`port_number`, :func:`finite_float`, :func:`positive_float`,
:func:`non_negative_float`, :func:`positive_fraction`) and :func:`config_error_lines` live here, not
in ``eval.argtypes`` (which re-exports them), because the ``mars_openhands`` layers may not import
``eval`` (tests/unit/test_layering.py) and their command lines need them too. The config loaders
below the command lines (``policy.params``, a workload file, the in-process gateway's environment
variable) report through :func:`config_error_lines` as well, so a bad key reads the same in a flag,
a file or a variable; :func:`redact_url` hides the password of a URL in any error line.

Standard library only: every layer's command line imports it.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import math
import re
import socket
import sys
import typing
from collections.abc import Callable, Collection, Mapping
from typing import IO, Any, Literal, NoReturn

__all__ = ["EXIT_USAGE", "CliParser", "check_port_free", "cli_error", "config_error_lines", "count_or_zero",
           "finite_float", "keys_hint", "long_flags", "non_negative_float", "non_negative_int",
           "one_line", "port_number", "positive_float", "positive_fraction", "positive_int", "redact_url"]

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


# -- argparse types and config errors (shared by every layer's command line) ---------------------

def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (e.g. a random seed)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def count_or_zero(text: str) -> int:
    """An integer >= 0, where 0 means no limit."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0 = no limit), got {text!r}")
    return value


def port_number(text: str) -> int:
    """A TCP port to listen on: an integer in 1..65535 (0, "any free port", is not offered: the
    server would not say which port it got)."""
    value = _integer(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """A finite number (``nan`` and ``inf`` rejected)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (e.g. a rate, or a timeout in seconds)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive_fraction(text: str) -> float:
    """A number in (0, 1] (e.g. nucleus sampling's ``top_p``)."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def long_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``dest -> long option`` of every optional flag of ``parser`` (``--help`` left out)."""
    return {action.dest: next(o for o in action.option_strings if o.startswith("--"))
            for action in parser._actions
            if action.dest != "help" and any(o.startswith("--") for o in action.option_strings)}


_CONTAINERS = (dict, list, tuple, set, frozenset)
"""Inputs not echoed as ``(got ...)``: the message names the bad part (and a dict may hold keys)."""

_SECRET_NAME = re.compile(r"(?:^|_)(?:key|token|secret|password|passwd|credentials?)$", re.IGNORECASE)
"""Field or key names whose value is never echoed (``api_key``, ``admin_key``, ``hf_token``): a key
given with a typo or a bad character would otherwise be printed, and land in logs."""


def config_error_lines(error: Any, flags: Mapping[str, str] | None = None, *,
                       file_flag: str | None = None,
                       model_errors: Literal["assign", "as_is"] = "assign",
                       dashed_nested: bool = False,
                       unknown_key_hint: Callable[[tuple[Any, ...]], str | None] | None = None,
                       examples: Mapping[str, str] | None = None,
                       key_prefix: str | None = None) -> list[str]:
    """One ``--flag: <msg> (got <value>)`` line per problem of a config built from flags. Pure.

    The one formatter of every command line's pydantic errors::

        --num-tool-workers: Input should be greater than or equal to 1 (got 0)
        --model: required; pass --model VALUE
        --replica[0] url: replica url must start with http:// or https://, got 'x'
        --gateway-config: unknown key 'admission.window_mx'; 'admission' takes: window_min, ...

    and, with ``key_prefix``, of a document's (a file, a JSON flag value, an environment
    variable; the caller's prefix names it)::

        mars.window.size: Input should be greater than or equal to 1 (got 0)
        unknown key 'mars.levels.agng'; 'mars.levels' takes: prompt_thresholds_tokens, ...
        problem_statement: required; add the key

    ``(got <value>)`` is left out where the message already says ``got`` or quotes the value,
    where the value is a dict, list or tuple (the message names the bad part; a dict may hold
    secrets), where the field is a secret (a ``SecretStr``, or a name such as ``api_key``,
    ``admin_key``, ``*_token``: see :data:`_SECRET_NAME`), and for the whole document (an error
    with no location: invalid JSON, not an object). An unknown key (``extra="forbid"``) never
    shows its value: it may be a secret under a misspelt name. A ``too_short`` error of a list
    whose item failed is left out (pydantic counts only the items that passed). The userinfo of
    any URL in a line is hidden (:func:`redact_url`).

    Args:
        error: a pydantic ``ValidationError``.
        flags: field name → flag, e.g. ``{"num_tool_workers": "--num-tool-workers"}``; a field not
            in it prints as ``--<field with dashes>`` (or, with ``file_flag``, as a file key). A
            location below a field adds its index and key path: ``--replica[0] url``.
        file_flag: the config's keys (some or all) come from a file given with this flag (``serve
            --gateway-config``, ``gateway --config FILE``): an unknown key is reported under it,
            a model-level error not assigned to a field prints as ``<file_flag>``, and (without
            ``dashed_nested``) a field not in ``flags`` as ``<file_flag> <dotted key path>``.
        model_errors: how an error of a model-level check (no field location) prints.
            ``"assign"``: on the first field of ``flags`` its message names, with that field's
            value where it was given (else on ``config``, or ``file_flag``). ``"as_is"``: the
            message alone, for a model whose cross-field checks write whole lines (``serve``'s
            check of each engine's options, the gateway's distinct keys and replicas).
        dashed_nested: the command line has one flag per nested field (``gateway``:
            ``admission.window_max`` → ``--admission-window-max``): a field not in ``flags``
            prints as its whole key path with dashes.
        unknown_key_hint: location of an unknown key → what to write instead (``"'admission'
            takes: window_min, ..."``; :func:`keys_hint` makes one from the model), or ``None``
            for the default advice.
        examples: field → the example value a ``required`` line offers in place of ``VALUE``
            (``{"replicas": "http://127.0.0.1:8001"}``).
        key_prefix: the config is a document, not flags: every location prints as this prefix
            and its dotted key path (``"mars."``: ``mars.levels.agng``; ``""``:
            ``turns.1.output_tokens``), a model-level error as its message alone; ``flags``,
            ``file_flag``, ``model_errors``, ``dashed_nested`` and ``examples`` are not used.

    Returns:
        The lines, without pydantic's input dump and documentation URL (no ``error:`` prefix).
    """
    flags, examples = flags or {}, examples or {}
    items = error.errors(include_url=False)
    lines = []
    for item in items:
        message = str(item["msg"]).removeprefix("Value error, ")
        loc, got = tuple(item["loc"]), item.get("input")
        if item["type"] == "too_short" and any(tuple(i["loc"])[:len(loc)] == loc and len(i["loc"]) > len(loc)
                                               for i in items):
            continue  # pydantic's follow-up of a bad item: "at least 1 item after validation, not 0"
        if item["type"] == "extra_forbidden":
            lines.append(_unknown_key_line(loc, flags, file_flag, unknown_key_hint, key_prefix))
            continue
        if not loc and (model_errors == "as_is" or key_prefix is not None):
            lines.append(message)
            continue
        if not loc and isinstance(got, dict):  # the model validator: find the field it names
            named = [w for w in re.findall(r"[a-z][a-z0-9_]*", message) if w in flags]
            # (a field not given keeps the input dict as its value, which is not shown)
            loc, got = ((named[0],), got.get(named[0], got)) if named else ((), got)
        flag = (key_prefix + _dotted(loc) if key_prefix is not None
                else _flag_of(loc, flags, file_flag, dashed_nested))
        message = message.removesuffix(f" ({flag})")
        if item["type"] == "missing":
            fix = _missing_fix(loc, flag, flags, file_flag, dashed_nested, examples, key_prefix)
            lines.append(f"{flag}: required; {fix}")
        elif _shows_value(loc, got, message):
            lines.append(f"{flag}: {message} (got {got!r})")
        else:
            lines.append(f"{flag}: {message}")
    return [redact_url(line) for line in lines]


def _missing_fix(loc: tuple[Any, ...], flag: str, flags: Mapping[str, str], file_flag: str | None,
                 dashed_nested: bool, examples: Mapping[str, str], key_prefix: str | None) -> str:
    """How to give a required field: ``pass --model VALUE``, ``add the key ...``. Pure."""
    if key_prefix is not None:
        return "add the key"
    if file_flag is not None and not dashed_nested and str(loc[0]) not in flags:
        return f"add the key to the {file_flag} file"
    return f"pass {flag} {examples.get(str(loc[0]), 'VALUE') if len(loc) == 1 else 'VALUE'}"


def _shows_value(loc: tuple[Any, ...], got: Any, message: str) -> bool:
    """Whether a line ends with ``(got <value>)``: not for a secret, a container, the whole
    document or a value the message already shows. Pure."""
    if not loc or hasattr(got, "get_secret_value") or any(
            isinstance(part, str) and _SECRET_NAME.search(part) for part in loc):
        return False
    if isinstance(got, _CONTAINERS) or "got " in message:
        return False
    return not (isinstance(got, str) and repr(got) in message)


def _unknown_key_line(loc: tuple[Any, ...], flags: Mapping[str, str], file_flag: str | None,
                      hint: Callable[[tuple[Any, ...]], str | None] | None, key_prefix: str | None) -> str:
    """``<where>: unknown key '<a.b>'; <what to write instead>``, without its value (a document's:
    ``unknown key '<prefix><a.b>'; ...``). Pure."""
    fix = (hint(loc) if hint is not None else None) or "remove it or correct its spelling"
    if key_prefix is not None:
        return f"unknown key '{key_prefix}{_dotted(loc)}'; {fix}"
    if file_flag is not None or len(loc) < 2:
        where, key = file_flag or "config", loc
    else:  # a key inside a field given as a flag (a JSON object)
        where, key = _flag_of(loc[:1], flags, None, False), loc[1:]
    return f"{where}: unknown key '{_dotted(key)}'; {fix}"


def _dotted(loc: tuple[Any, ...]) -> str:
    """A location as a dotted key path: ``("turns", 1, "output_tokens")`` → ``"turns.1.output_tokens"``."""
    return ".".join(str(p) for p in loc)


def _flag_of(loc: tuple[Any, ...], flags: Mapping[str, str], file_flag: str | None,
             dashed_nested: bool) -> str:
    """The flag (or ``file_flag`` and key path) an error location names. Pure."""
    if not loc:
        return file_flag or "config"
    if str(loc[0]) in flags:
        return flags[str(loc[0])] + _path(loc[1:])
    if dashed_nested:
        end = next((i for i, part in enumerate(loc) if isinstance(part, int)), len(loc))
        return "--" + "-".join(str(p) for p in loc[:end]).replace("_", "-") + _path(loc[end:])
    if file_flag is not None:
        return f"{file_flag} {_dotted(loc)}"
    return "--" + str(loc[0]).replace("_", "-") + _path(loc[1:])


def _path(rest: tuple[Any, ...]) -> str:
    """The part of a location below its flag: ``(0, "url")`` → ``"[0] url"``. Pure."""
    indexes = ""
    while rest and isinstance(rest[0], int):
        indexes, rest = indexes + f"[{rest[0]}]", rest[1:]
    return indexes + (" " + ".".join(str(p) for p in rest) if rest else "")


def keys_hint(model: Any, root: str = "", *, hidden: Collection[str] = (),
              added: Collection[str] = ()) -> Callable[[tuple[Any, ...]], str | None]:
    """An ``unknown_key_hint`` for :func:`config_error_lines`: the keys the unknown key's section
    of ``model`` takes, after the closest one, e.g. ``"did you mean 'aging_interval_s'?
    'mars.levels' takes: prompt_thresholds_tokens, quanta_tokens, aging_interval_s"``.

    The section is found by following the location's keys through the fields' annotations (a
    nested model, a ``tuple[Model, ...]``, a ``Model | None``); item indexes are kept in its name.
    Duck-typed on pydantic's ``model_fields``, so this module stays standard library only.

    Args:
        model: the pydantic model class the document is validated as.
        root: how the top section is named (``"mars"``; ``""``: by the keys alone).
        hidden: top-level fields not to offer (set another way: the in-process gateway's
            ``replicas``).
        added: top-level keys read before validation, to offer too (its ``replica``).

    Returns:
        location → hint, or ``None`` where the section is not a model (the default advice).
    """
    def hint(loc: tuple[Any, ...]) -> str | None:
        section: Any = model
        for part in loc[:-1]:
            if isinstance(part, int):
                continue  # an item: the annotation's model was taken at its field
            field = getattr(section, "model_fields", {}).get(part)
            section = _model_in(field.annotation) if field is not None else None
            if section is None:
                return None
        keys = list(getattr(section, "model_fields", {}))
        if len(loc) == 1:
            keys = [k for k in keys if k not in hidden] + [k for k in added if k not in keys]
        name = ".".join(str(p) for p in (root, *loc[:-1]) if p != "")
        close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
        return ((f"did you mean '{close[0]}'? " if close else "")
                + (f"'{name}' takes: " if name else "the keys are: ") + ", ".join(keys))

    return hint


def _model_in(annotation: Any) -> Any:
    """The model class in a field annotation (``Model``, ``Model | None``, ``tuple[Model, ...]``),
    or ``None``."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    return next((m for m in map(_model_in, typing.get_args(annotation)) if m is not None), None)


_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/?#'\"<>]*)@")
"""A URL's ``scheme://userinfo@``: the userinfo runs to the last ``@`` before the path (an
unencoded ``@`` in a password stays hidden, as ``urllib`` splits it)."""


def is_usable_key(key: str) -> bool:
    """Whether ``key`` can be an API key or token: non-empty, printable, without whitespace (a key
    pasted with its newline is not). Pure."""
    return bool(key) and key.isprintable() and not any(c.isspace() for c in key)


def redact_url(text: str) -> str:
    """``text`` (a URL, or a line naming URLs) with each URL's userinfo hidden. Pure.

    ``http://user:pass@host`` → ``http://user:***@host`` (the user name helps find a wrong one;
    SQLAlchemy shows URLs the same way); a userinfo without a password, ``https://TOKEN@host``, is
    hidden whole, ``https://***@host`` (it is often a token).

    >>> redact_url("replica URLs must be distinct, got ['http://u:p@a:1', 'https://tok@b']")
    "replica URLs must be distinct, got ['http://u:***@a:1', 'https://***@b']"
    """
    def hide(match: re.Match[str]) -> str:
        user, has_password, _ = match["userinfo"].partition(":")
        return match["scheme"] + (f"{user}:***@" if has_password else "***@")

    return _URL_USERINFO.sub(hide, text)
