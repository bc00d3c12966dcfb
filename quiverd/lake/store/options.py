"""How quiverd talks OpenDAL: service options checked before use, errors classified.

OpenDAL accepts unknown service options silently and its Python exceptions carry no
HTTP status, so both are done here: ``checked_options`` refuses what OpenDAL would
ignore, with a did-you-mean hint (what one service adds or requires beyond that is its
store class's ``complete_options``, see ``quiverd.lake.store``); ``classify`` turns an
exception into the kind the store retries on (throttled, server, timeout, connection),
fails on (denied) or reports. Nothing here knows a scheme by name.
"""

from __future__ import annotations

import difflib
import re

import opendal.exceptions as oe

from quiverd.kernel.config import StoreConfig
from quiverd.kernel.errors import ConfigError, ObjectExists, VerifyFailed

_STATUS = re.compile(r"status: (\d{3})\b")


def classify(exc: BaseException) -> str | None:
    """The failure kind of a store error; None when the error is not the store's."""
    if isinstance(exc, TimeoutError):
        return "timeout"  # anyio.fail_after around the attempt
    if isinstance(exc, VerifyFailed):
        return "verify"
    if isinstance(exc, ObjectExists):
        return "exists"
    if type(exc).__module__ != oe.__name__:
        return None
    if isinstance(exc, oe.PermissionDenied):
        return "denied"
    if isinstance(exc, oe.RateLimited):
        return "throttled"
    if isinstance(exc, oe.ConditionNotMatch | oe.AlreadyExists):
        return "exists"
    if "NoSuchBucket" in str(exc):
        return "missing"  # S3 answers 404 with this code: the bucket is not there
    # Fallback on the text, because OpenDAL 0.47's Python exceptions carry neither the
    # HTTP status nor is_temporary(): 5xx answers, resets and undecodable replies all
    # arrive as Unexpected, and a HEAD answer (no body) even loses S3's error code
    # (a 503 on stat is Unexpected, not RateLimited). The message has "status: NNN"
    # when a response came and "(temporary)" when OpenDAL judged a retry may help.
    text = str(exc)
    if match := _STATUS.search(text):
        status = int(match.group(1))
        if status in (401, 403):
            return "denied"
        if status in (429, 503):
            return "throttled"
        if status >= 500:
            return "server"
        return "other"
    lowered = text.lower()
    if "timeout" in lowered or "timed out" in lowered:
        return "timeout"
    if "(temporary)" in text:
        return "connection" if "send http request" in lowered else "server"
    return "other"


def brief(exc: BaseException | None) -> str:
    """First line of an error, plus the HTTP status OpenDAL buries in its context."""
    if exc is None:
        return ""
    if isinstance(exc, TimeoutError):
        return "no answer within lake.store.timeout_ms"
    text = str(exc)
    first = text.split("\n", 1)[0].strip() or type(exc).__name__
    match = _STATUS.search(text)
    return f"{first} (HTTP {match.group(1)})" if match and match.group(1) not in first else first


def checked_options(cfg: StoreConfig) -> dict[str, str]:
    """A copy of ``cfg.options``, checked against OpenDAL's typed config of the service
    (which accepts unknown keys silently); ``root`` is refused (lake.store.root owns it)."""
    where = "lake.store.options"
    options = dict(cfg.options)
    if "root" in options:
        raise ConfigError(f"{where}.root", "set lake.store.root instead")
    keys = service_keys(cfg.scheme)
    if keys is not None:
        known, required = keys
        if unknown := sorted(set(options) - known):
            close = difflib.get_close_matches(unknown[0], known, n=1)
            raise ConfigError(f"{where}.{unknown[0]}", f"not an option of OpenDAL's "
                              f"{cfg.scheme} service", hint=f"did you mean {close[0]!r}?"
                              if close else f"known options: {', '.join(sorted(known))}")
        if missing := sorted(required - set(options)):
            raise ConfigError(where, f"{missing[0]} is missing: the {cfg.scheme} service "
                              "needs it", hint=f'add {missing[0]} = "..." under '
                              "[lake.store.options]")
    return options


def service_keys(scheme: str) -> tuple[set[str], set[str]] | None:
    """Known and required option names of a service, from OpenDAL's typed configs."""
    try:
        import opendal.config as typed
    except ImportError:  # older bindings: only our own checks apply
        return None
    schemes: list[str] = []
    for name in getattr(typed, "__all__", ()):
        hints = getattr(getattr(typed, name), "__annotations__", {})
        # Annotations are postponed (strings or ForwardRefs): read their text.
        fields = {k: str(getattr(v, "__forward_arg__", v)) for k, v in hints.items()}
        found = re.findall(r"""Literal\[['"]([\w-]+)['"]\]""", fields.get("scheme", ""))
        schemes += found
        if scheme in found:
            fields.pop("scheme")
            return set(fields), {k for k, v in fields.items() if v.startswith("Required[")}
    if schemes:  # OpenDAL told us its services, and this is not one of them
        close = difflib.get_close_matches(scheme, schemes, n=1)
        raise ConfigError("lake.store.scheme", f"{scheme!r} is not an OpenDAL service",
                          hint=f"did you mean {close[0]!r}?" if close
                          else f"services: {', '.join(sorted(schemes))}")
    return None
